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

**What NCCL requires and gloo forgives.** With ``MEGATRON_CHECK_COLLECTIVES=1`` (the test suite
sets it for every process it starts) each tensor collective first checks what NCCL would need:
every tensor on the compute device (``device.get_device()``), contiguous, and, for the
collectives that combine ranks' tensors, the same shape and dtype on every rank (one extra
all-gather of a small descriptor). A violation raises :class:`CollectiveCheckError` on every
rank of the group, naming the caller's file and line, where an NCCL run would hang, crash or
read garbage. Point-to-point messages are checked for device and contiguity (gloo itself refuses
mismatched sizes).

**Gloo with CUDA tensors** (two ranks sharing one GPU, where NCCL refuses): gloo's collectives
take CUDA tensors but its point-to-point transport does not, so sends and receives of CUDA
tensors over a gloo group are staged through host memory here.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron.core import device

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


class CollectiveCheckError(RuntimeError):
    """A collective's tensors break a rule NCCL enforces (``MEGATRON_CHECK_COLLECTIVES=1``)."""


def checking_collectives() -> bool:
    """Whether collectives check what NCCL requires (read at each call: tests toggle it)."""
    return os.environ.get("MEGATRON_CHECK_COLLECTIVES") == "1"


def _caller() -> str:
    """``file:line`` of the first frame outside this module (who called the collective)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"


_DTYPE_CODES = {dtype: code for code, dtype in enumerate(
    (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
     torch.int16, torch.int8, torch.uint8, torch.bool))}
_MAX_DIMS = 8


def _check(op: str, group: ProcessGroup | None, tensors: list[torch.Tensor],
           same_on_every_rank: bool) -> None:
    """Raise :class:`CollectiveCheckError` where NCCL would fail (module docstring)."""
    where, compute = _caller(), device.get_device()
    for tensor in tensors:
        if tensor.device != compute:
            raise CollectiveCheckError(
                f"{where}: {op} of a tensor on {tensor.device}, but the compute device is "
                f"{compute}: NCCL takes tensors on the compute device only (make it with "
                f"device=device.get_device())")
        if not tensor.is_contiguous():
            raise CollectiveCheckError(f"{where}: {op} of a non-contiguous tensor "
                                       f"{tuple(tensor.shape)}; NCCL needs contiguous memory")
    if not same_on_every_rank or world_size(group) == 1:
        return
    mine = _descriptor(tensors[0], compute)
    every = torch.empty(world_size(group) * mine.numel(), dtype=mine.dtype, device=compute)
    # Marked as the collective it checks: a rank waiting here for a hung peer is blocked in a
    # collective (the watchdog then names the peer, not this rank).
    with _blocking(op, group):
        _all_gather_single(every, mine, group=group)
    rows = every.view(world_size(group), -1).tolist()
    if any(row != rows[0] for row in rows):
        described = "; ".join(f"rank {i}: {_describe(row)}" for i, row in enumerate(rows))
        raise CollectiveCheckError(
            f"{where}: {op} with different tensors on the ranks of the group ({described}); "
            "NCCL needs the same shape and dtype on every rank (gloo may not notice)")


def _descriptor(tensor: torch.Tensor, compute: torch.device) -> torch.Tensor:
    """``[dtype code, ndim, *shape padded to _MAX_DIMS]`` as an int64 tensor on ``compute``."""
    shape = list(tensor.shape)[:_MAX_DIMS]
    values = [_DTYPE_CODES.get(tensor.dtype, -1), tensor.dim(), *shape,
              *[0] * (_MAX_DIMS - len(shape))]
    return torch.tensor(values, dtype=torch.int64, device=compute)


def _describe(row: list[int]) -> str:
    dtypes = {code: dtype for dtype, code in _DTYPE_CODES.items()}
    return f"{dtypes.get(row[0], 'other')} {tuple(row[2:2 + row[1]])}"


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
    if checking_collectives():
        _check("all_reduce", group, [tensor], same_on_every_rank=True)
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
    if checking_collectives():
        _check("all_gather", group, [tensor, output], same_on_every_rank=True)
    return _run("all_gather", group, async_op, _all_gather_single, output, tensor.contiguous(),
                group=group, async_op=async_op)


def all_gather_list(tensor: torch.Tensor, group: ProcessGroup | None) -> list[torch.Tensor]:
    """Gather ``tensor`` from every rank; returns one tensor per rank."""
    size = world_size(group)
    if size == 1:
        return [tensor]
    if checking_collectives():
        _check("all_gather", group, [tensor], same_on_every_rank=True)
    out = [torch.empty_like(tensor) for _ in range(size)]
    with _blocking("all_gather", group):
        dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      group: ProcessGroup | None) -> None:
    """Rank ``r`` sends rows ``input_split_sizes[r]`` of ``tensor`` (dim 0, in rank order) to
    rank r and receives ``output_split_sizes[r]`` rows from it into ``output``."""
    if world_size(group) == 1:
        output.copy_(tensor)
        return
    with _blocking("all_to_all", group):
        dist.all_to_all_single(output, tensor.contiguous(), output_split_sizes,
                               input_split_sizes, group=group)


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None,
                        async_op: bool = False):
    """Sum ``tensor`` over ranks and keep this rank's dim-0 shard in ``output``."""
    if world_size(group) == 1:
        output.copy_(tensor)
        return None
    if checking_collectives():
        _check("reduce_scatter", group, [tensor, output], same_on_every_rank=True)
    return _run("reduce_scatter", group, async_op, _reduce_scatter_single, output,
                tensor.contiguous(), group=group, async_op=async_op)


def all_to_all_equal(output: torch.Tensor, tensor: torch.Tensor,
                     group: ProcessGroup | None) -> None:
    """Split ``tensor`` into equal dim-0 pieces, send piece i to rank i, and gather the
    pieces received (rank j's in place j) into ``output``."""
    if world_size(group) == 1:
        output.copy_(tensor)
        return
    if checking_collectives():
        _check("all_to_all", group, [tensor, output], same_on_every_rank=True)
    with _blocking("all_to_all", group):
        dist.all_to_all_single(output, tensor.contiguous(), group=group)


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
        if checking_collectives():
            _check("broadcast", group, [tensor], same_on_every_rank=True)
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


def _staged_on_host(tensor: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether a message of ``tensor`` goes through host memory (gloo's point-to-point
    transport takes CPU tensors only)."""
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


class _HostStagedRecv:
    """A receive into host memory whose ``wait()`` copies the message to its device tensor."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.host, self.target = work, host, target

    def wait(self) -> bool:
        self.work.wait()
        with torch.no_grad():  # receive buffers can be leaves that require grad
            self.target.copy_(self.host)
        return True


def _check_p2p(op: str, tensor: torch.Tensor) -> None:
    if checking_collectives():
        _check(op, None, [tensor], same_on_every_rank=False)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None) -> None:
    """Blocking point-to-point send to global rank ``dst``, a member of ``group``."""
    group = _peer_group(group, "send")
    _check_p2p("send", tensor)
    if _staged_on_host(tensor, group):
        tensor = tensor.cpu()
    with _blocking(f"send to rank {dst}", group):
        dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> None:
    """Blocking point-to-point receive from global rank ``src``, a member of ``group``."""
    group = _peer_group(group, "recv")
    _check_p2p("recv", tensor)
    host = torch.empty_like(tensor, device="cpu") if _staged_on_host(tensor, group) else tensor
    with _blocking(f"recv from rank {src}", group):
        dist.recv(host, src=src, group=group)
    if host is not tensor:
        with torch.no_grad():  # receive buffers can be leaves that require grad
            tensor.copy_(host)


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None):
    """Non-blocking send to global rank ``dst`` (a member of ``group``); returns the work
    handle to ``wait()`` on."""
    group = _peer_group(group, "isend")
    _check_p2p("isend", tensor)
    if _staged_on_host(tensor, group):
        tensor = tensor.cpu()  # a copy the send owns until it completes
    _issued()
    return dist.isend(tensor, dst=dst, group=group)


def irecv(tensor: torch.Tensor, src: int, group: ProcessGroup | None):
    """Non-blocking receive into ``tensor`` from global rank ``src``; returns the work handle
    (its ``wait()`` leaves the message in ``tensor``)."""
    group = _peer_group(group, "irecv")
    _check_p2p("irecv", tensor)
    _issued()
    if _staged_on_host(tensor, group):
        host = torch.empty_like(tensor, device="cpu")
        return _HostStagedRecv(dist.irecv(host, src=src, group=group), host, tensor)
    return dist.irecv(tensor, src=src, group=group)


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
    for kind, tensor, _ in ops:
        _check_p2p(f"batch_isend_irecv ({kind})", tensor)
    if any(_staged_on_host(tensor, group) for _, tensor, _ in ops):
        # gloo's P2POp batch has no host staging of its own: post them one by one.
        return [isend(t, peer, group) if kind == "send" else irecv(t, peer, group)
                for kind, t, peer in ops]
    functions = {"send": dist.isend, "recv": dist.irecv}
    p2p_ops = [dist.P2POp(functions[kind], tensor, peer, group) for kind, tensor, peer in ops]
    _issued()
    return dist.batch_isend_irecv(p2p_ops)
