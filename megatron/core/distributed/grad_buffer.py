"""Contiguous gradient buffers and the buckets they are reduced in.

One :class:`GradBuffer` holds the gradients of every parameter of one gradient dtype. Parameters
are laid out in REVERSE order (the last parameter at offset 0), as Megatron-LM does, because
backward produces gradients roughly from the last layer to the first: the buckets at the start of
the buffer become ready first and their reduction can start while backward goes on.

Layout of one buffer (``n_i`` = numel of parameter i, ``P`` = number of parameters)::

    [ param P-1 | param P-2 | ... | pad ][ ... | param 0 | pad ]
    \\________ bucket 0 ________________/\\____ bucket k ______/

Without ``bucket_size`` there is one bucket, and the buffer is exactly Megatron-LM 23.06's: the
parameters back to back, padded at the end to a multiple of the data-parallel size when the
distributed optimizer shards it. With buckets, each bucket is padded to that multiple, so that
every bucket can be reduce-scattered on its own: DP rank ``r`` owns the ``r``-th of the ``d``
equal chunks of every bucket (its *shard*).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core import comm


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclasses.dataclass(frozen=True)
class ParamRange:
    """Where one parameter lives in its buffer: elements ``[start, end)`` of bucket ``bucket``."""

    start: int
    end: int
    bucket: int


class Bucket:
    """A contiguous slice of a grad buffer reduced by one collective.

    Args:
        params: the parameters whose gradients live in this bucket.
        data: the bucket's view of the buffer (numel a multiple of the DP size when sharded).
        offset: element offset of ``data`` in the buffer.
        dp_group: the data-parallel group to reduce over.
        use_distributed_optimizer: reduce-scatter (each rank keeps its shard) instead of
            all-reduce.
        average_over: the gradient is divided by this before the sum (default: the size of
            ``dp_group``); expert parameters, reduced over the expert-data-parallel group, are
            divided by the dense DP size, because each already sums the tokens of its
            expert-parallel group.
    """

    def __init__(self, params: list[torch.nn.Parameter], data: torch.Tensor, offset: int,
                 dp_group: comm.ProcessGroup | None,
                 use_distributed_optimizer: bool, average_over: int | None = None) -> None:
        self.params = params
        self.param_set = set(params)
        self.data = data
        self.offset = offset
        self.dp_group = dp_group
        self.dp_size = comm.world_size(dp_group)
        self.dp_rank = comm.rank(dp_group)
        self.average_over = self.dp_size if average_over is None else average_over
        self.use_distributed_optimizer = use_distributed_optimizer
        self.shard_numel = data.numel() // self.dp_size
        self.reset()

    def reset(self) -> None:
        """Forget readiness and pending collectives (start of a new iteration)."""
        self.params_ready: set[torch.nn.Parameter] = set()
        self.handle = None
        self.started = False
        self._shard_out: torch.Tensor | None = None

    def shard(self) -> torch.Tensor:
        """This DP rank's chunk of the bucket (what the distributed optimizer owns)."""
        return self.data[self.dp_rank * self.shard_numel:(self.dp_rank + 1) * self.shard_numel]

    def start_grad_sync(self, async_op: bool) -> None:
        """Average the bucket over the DP group (all-reduce, or reduce-scatter into the shard)."""
        assert not self.started, "grad sync of this bucket already started"
        self.started = True
        # Divide before summing (as Megatron does): the average is what the optimizer wants, and
        # half-precision sums are less likely to overflow.
        if self.average_over > 1:
            self.data.div_(self.average_over)
        if self.use_distributed_optimizer:
            # A separate output: the collective's input and output must not alias on gloo.
            self._shard_out = torch.empty_like(self.shard())
            self.handle = comm.reduce_scatter_into(self._shard_out, self.data, self.dp_group,
                                                   async_op=async_op)
        else:
            self.handle = comm.all_reduce(self.data, self.dp_group, "sum", async_op=async_op)

    def finish_grad_sync(self) -> None:
        """Wait for the collective (starting it synchronously if nobody did)."""
        if not self.started:
            self.start_grad_sync(async_op=False)
        if self.handle is not None:
            comm.wait(self.handle, "gradient reduction", self.dp_group)
            self.handle = None
        if self._shard_out is not None:
            self.shard().copy_(self._shard_out)
            self._shard_out = None

    def register_grad_ready(self, param: torch.nn.Parameter) -> bool:
        """Mark ``param``'s gradient final; returns True when the whole bucket is ready."""
        self.params_ready.add(param)
        return len(self.params_ready) == len(self.params)


class GradBuffer:
    """The gradients of ``params`` (all of grad dtype ``dtype``) in one flat tensor.

    Every parameter gets ``param.main_grad``, a view into :attr:`data` shaped like the parameter.

    Args:
        params: parameters in module order (they are laid out in reverse).
        dtype: gradient dtype of the buffer.
        dp_group: the data-parallel group the buckets are reduced over.
        bucket_size: elements per bucket (a bucket closes once it reaches this many);
            ``None`` for one bucket.
        use_distributed_optimizer: pad buckets to a multiple of the DP size and reduce-scatter.
        average_over: see :class:`Bucket`.
    """

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype,
                 dp_group: comm.ProcessGroup | None, bucket_size: int | None,
                 use_distributed_optimizer: bool, average_over: int | None = None) -> None:
        self.params = list(params)
        self.dtype = dtype
        self.dp_group = dp_group
        self.dp_size = comm.world_size(dp_group)
        self.use_distributed_optimizer = use_distributed_optimizer
        pad_to = self.dp_size if use_distributed_optimizer else 1
        self.param_ranges, bucket_bounds, self.numel = compute_layout(
            [p.numel() for p in self.params], bucket_size, pad_to)
        self.numel_unpadded = sum(p.numel() for p in self.params)
        device = self.params[0].device
        self.data = torch.zeros(self.numel, dtype=dtype, device=device)
        self.param_index_map: dict[torch.nn.Parameter, ParamRange] = {}
        for param, prange in zip(self.params, self.param_ranges):
            self.param_index_map[param] = prange
            param.main_grad = self.data[prange.start:prange.end].view(param.shape)
        self.buckets = []
        for index, (start, end) in enumerate(bucket_bounds):
            members = [p for p, r in zip(self.params, self.param_ranges) if r.bucket == index]
            self.buckets.append(Bucket(members, self.data[start:end], start, dp_group,
                                       use_distributed_optimizer, average_over))
        self.param_to_bucket = {p: self.buckets[r.bucket]
                                for p, r in zip(self.params, self.param_ranges)}

    def reset(self) -> None:
        """Zero the gradients and forget pending reductions."""
        self.data.zero_()
        for bucket in self.buckets:
            bucket.reset()


def compute_layout(numels: list[int], bucket_size: int | None,
                   pad_to: int) -> tuple[list[ParamRange], list[tuple[int, int]], int]:
    """Place parameters (given in module order) in reverse order into padded buckets.

    A pure function, so a checkpoint's layout can be recomputed for another DP size.

    Args:
        numels: element counts of the parameters, in module order.
        bucket_size: close a bucket once it holds at least this many elements (None: one bucket).
        pad_to: pad every bucket to a multiple of this (the DP size with the distributed
            optimizer, else 1).

    Returns:
        (per-parameter ranges in module order, bucket bounds ``(start, end)``, buffer numel).
    """
    ranges: list[ParamRange | None] = [None] * len(numels)
    bounds: list[tuple[int, int]] = []
    offset = bucket_start = 0
    for index in reversed(range(len(numels))):
        ranges[index] = ParamRange(offset, offset + numels[index], len(bounds))
        offset += numels[index]
        if bucket_size is not None and offset - bucket_start >= bucket_size and index > 0:
            offset = _round_up(offset, pad_to)
            bounds.append((bucket_start, offset))
            bucket_start = offset
    offset = _round_up(max(offset, 1), pad_to)
    bounds.append((bucket_start, offset))
    return ranges, bounds, offset  # type: ignore[return-value]
