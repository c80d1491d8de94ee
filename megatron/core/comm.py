"""All collectives go through here, so API drift between torch releases is fixed in one place.

Every function takes its process group explicitly. In torch 2.13 ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` are deprecated in favour of ``all_gather_single`` /
``reduce_scatter_single`` (same signatures); older releases only have the former.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_size(group: ProcessGroup | None) -> int:
    """Size of ``group`` (1 when torch.distributed is not initialized)."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialized)."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op: str = "sum",
               async_op: bool = False):
    """In-place all-reduce; ``op`` is ``"sum"``, ``"max"``, ``"min"`` or ``"avg"``."""
    if world_size(group) == 1:
        return None
    if op == "avg":
        # gloo has no AVG reduction: sum, then divide.
        handle = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(world_size(group))
        return handle
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                 "min": dist.ReduceOp.MIN}[op]
    return dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None,
                    async_op: bool = False):
    """Gather ``tensor`` from every rank into ``output`` (concatenated along dim 0)."""
    if world_size(group) == 1:
        output.copy_(tensor)
        return None
    return _all_gather_single(output, tensor.contiguous(), group=group, async_op=async_op)


def all_gather_list(tensor: torch.Tensor, group: ProcessGroup | None) -> list[torch.Tensor]:
    """Gather ``tensor`` from every rank; returns one tensor per rank."""
    size = world_size(group)
    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None,
                        async_op: bool = False):
    """Sum ``tensor`` over ranks and keep this rank's dim-0 shard in ``output``."""
    if world_size(group) == 1:
        output.copy_(tensor)
        return None
    return _reduce_scatter_single(output, tensor.contiguous(), group=group, async_op=async_op)


def global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group``'s member ``group_rank`` (None: the default group)."""
    if group is None or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> None:
    """Broadcast ``tensor`` in place from global rank ``src``."""
    if world_size(group) > 1:
        dist.broadcast(tensor, src=src, group=group)


def broadcast_object(obj, src: int, group: ProcessGroup | None = None):
    """Broadcast a picklable object from global rank ``src``; returns it on every rank."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: ProcessGroup | None = None) -> None:
    """Barrier over ``group`` (no-op without torch.distributed)."""
    if dist.is_initialized():
        dist.barrier(group=group)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> None:
    """Blocking point-to-point send to global rank ``dst``."""
    dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> None:
    """Blocking point-to-point receive from global rank ``src``."""
    dist.recv(tensor, src=src, group=group)
