"""All collectives go through here, so API drift between torch releases is fixed in one place.

Process groups, one rule for the whole library: every function takes its group explicitly, and
``None`` means *this rank alone*: size 1, rank 0, every collective a no-op (a reduction or a
broadcast leaves the data as it is, a gather returns this rank's part, a barrier returns at
once). ``None`` never reaches torch.distributed, where it would mean the whole world; a caller
that means every rank says so with :func:`world_group`. Library signatures name their groups for
what they are: ``tp_group`` (tensor-parallel), ``pp_group`` (pipeline), ``dp_group``
(data-parallel), ``mp_group`` (model-parallel: TP x PP, what norms and inf flags are reduced
over), ``embedding_group``; only the generic functions here say plain ``group``.

In torch 2.13 ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are deprecated in favour
of ``all_gather_single`` / ``reduce_scatter_single`` (same signatures); older releases only have
the former.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Blocked(NamedTuple):
    """What the main thread is blocked in: a collective (or a wait on an asynchronous one)."""

    op: str
    group: ProcessGroup | None
    since: float  # time.monotonic()


# Read by megatron.training.watchdog from its own thread (plain assignments: no lock needed):
# the collective this process is blocked in, and when it last started or finished one.
_blocked: Blocked | None = None
_last_activity = time.monotonic()


def blocked_in() -> Blocked | None:
    """The collective this process is blocked in now (None when it is not in one)."""
    return _blocked


def last_activity() -> float:
    """``time.monotonic()`` when this process last started or finished a collective."""
    return _last_activity


class _blocking:  # noqa: N801 - used as a context manager, like contextlib's
    """Marks the main thread as blocked in ``op`` for the block's duration (a plain class: a
    few hundred nanoseconds per collective, less than a generator-based context manager)."""

    __slots__ = ("op", "group")

    def __init__(self, op: str, group: ProcessGroup | None) -> None:
        self.op, self.group = op, group

    def __enter__(self) -> None:
        global _blocked
        _blocked = Blocked(self.op, self.group, time.monotonic())

    def __exit__(self, *exc) -> None:
        global _blocked, _last_activity
        _blocked = None
        _last_activity = time.monotonic()


def _issued() -> None:
    """An asynchronous collective was posted: progress, though nothing waits yet."""
    global _last_activity
    _last_activity = time.monotonic()


def wait(handles, op: str, group: ProcessGroup | None) -> None:
    """Wait for asynchronous work handles (``None`` entries are skipped); ``op`` names what
    they are for a watchdog that finds this rank blocked here."""
    handles = [h for h in (handles if isinstance(handles, (list, tuple)) else [handles])
               if h is not None]
    if not handles:
        return
    with _blocking(op, group):
        for handle in handles:
            handle.wait()


def _run(name: str, group: ProcessGroup | None, async_op: bool, collective, /, *args,
         **kwargs):
    """``collective(*args, **kwargs)``, marked as blocking unless it is asynchronous."""
    if async_op:
        _issued()
        return collective(*args, **kwargs)
    with _blocking(name, group):
        return collective(*args, **kwargs)


def world_group() -> ProcessGroup | None:
    """Every rank: torch's default (WORLD) group. Before torch.distributed is initialized this
    process is the whole world, and the answer is None (this rank alone)."""
    return dist.group.WORLD if dist.is_initialized() else None


def world_size(group: ProcessGroup | None) -> int:
    """Size of ``group`` (1 for None, and when torch.distributed is not initialized)."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 for None, and without torch.distributed)."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op: str = "sum",
               async_op: bool = False):
    """In-place all-reduce; ``op`` is ``"sum"``, ``"max"``, ``"min"`` or ``"avg"``."""
    if world_size(group) == 1:
        return None
    if op == "avg":
        # gloo has no AVG reduction: sum, then divide.
        with _blocking("all_reduce", group):
            handle = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(world_size(group))
        return handle
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                 "min": dist.ReduceOp.MIN}[op]
    return _run("all_reduce", group, async_op, dist.all_reduce, tensor, op=reduce_op,
                group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None,
                    async_op: bool = False):
    """Gather ``tensor`` from every rank into ``output`` (concatenated along dim 0)."""
    if world_size(group) == 1:
        output.copy_(tensor)
        return None
    return _run("all_gather", group, async_op, _all_gather_single, output, tensor.contiguous(),
                group=group, async_op=async_op)


def all_gather_list(tensor: torch.Tensor, group: ProcessGroup | None) -> list[torch.Tensor]:
    """Gather ``tensor`` from every rank; returns one tensor per rank."""
    size = world_size(group)
    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    with _blocking("all_gather", group):
        dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None,
                        async_op: bool = False):
    """Sum ``tensor`` over ranks and keep this rank's dim-0 shard in ``output``."""
    if world_size(group) == 1:
        output.copy_(tensor)
        return None
    return _run("reduce_scatter", group, async_op, _reduce_scatter_single, output,
                tensor.contiguous(), group=group, async_op=async_op)


def global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group``'s member ``group_rank`` (for None, this process's own)."""
    if not dist.is_initialized():
        return group_rank
    if group is None:
        assert group_rank == 0, f"a group of one has no member {group_rank}"
        return dist.get_rank()
    return dist.get_global_rank(group, group_rank)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> None:
    """Broadcast ``tensor`` in place from global rank ``src``."""
    if world_size(group) > 1:
        with _blocking("broadcast", group):
            dist.broadcast(tensor, src=src, group=group)


def broadcast_object(obj, src: int, group: ProcessGroup | None):
    """Broadcast a picklable object from global rank ``src``; returns it on every rank."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    with _blocking("broadcast_object", group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj, group: ProcessGroup | None) -> list:
    """Gather a picklable object from every rank of ``group``; returns one per rank."""
    size = world_size(group)
    if size == 1:
        return [obj]
    out: list = [None] * size
    with _blocking("all_gather_object", group):
        dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: ProcessGroup | None) -> None:
    """Barrier over ``group`` (returns at once for a group of one)."""
    if world_size(group) > 1:
        with _blocking("barrier", group):
            dist.barrier(group=group)


def _peer_group(group: ProcessGroup | None, what: str) -> ProcessGroup:
    # A rank alone has no peer: a silent no-op would leave the receiver's buffer unfilled.
    if group is None:
        raise ValueError(f"{what} needs a group holding both ranks (None is this rank alone)")
    return group


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None) -> None:
    """Blocking point-to-point send to global rank ``dst``, a member of ``group``."""
    with _blocking(f"send to rank {dst}", group):
        dist.send(tensor, dst=dst, group=_peer_group(group, "send"))


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> None:
    """Blocking point-to-point receive from global rank ``src``, a member of ``group``."""
    with _blocking(f"recv from rank {src}", group):
        dist.recv(tensor, src=src, group=_peer_group(group, "recv"))


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None):
    """Non-blocking send to global rank ``dst`` (a member of ``group``); returns the work
    handle to ``wait()`` on."""
    _issued()
    return dist.isend(tensor, dst=dst, group=_peer_group(group, "isend"))


def irecv(tensor: torch.Tensor, src: int, group: ProcessGroup | None):
    """Non-blocking receive into ``tensor`` from global rank ``src``; returns the work handle."""
    _issued()
    return dist.irecv(tensor, src=src, group=_peer_group(group, "irecv"))


def batch_isend_irecv(ops: list[tuple[str, torch.Tensor, int]], group: ProcessGroup | None):
    """Post several sends/receives at once and return their work handles.

    Args:
        ops: ``("send" | "recv", tensor, peer global rank)`` in the order they are posted. Two
            messages between the same pair of ranks are matched in posting order on both NCCL
            and gloo, so sender and receiver must list them in the same order.
        group: the group holding this rank and every peer.

    Returns:
        The work handles (empty when ``ops`` is).
    """
    if not ops:
        return []
    group = _peer_group(group, "batch_isend_irecv")
    functions = {"send": dist.isend, "recv": dist.irecv}
    p2p_ops = [dist.P2POp(functions[kind], tensor, peer, group) for kind, tensor, peer in ops]
    _issued()
    return dist.batch_isend_irecv(p2p_ops)
