"""The paper's communication operators as autograd functions (Megatron-LM, section 3, fig. 3).

* :func:`copy_to_tensor_model_parallel_region` -- *f*: identity forward, all-reduce backward.
* :func:`reduce_from_tensor_model_parallel_region` -- *g*: all-reduce forward, identity backward.
* :func:`scatter_to_tensor_model_parallel_region` -- keep this rank's slice of the last dim;
  backward all-gathers.
* :func:`gather_from_tensor_model_parallel_region` -- all-gather along the last dim; backward
  keeps this rank's slice.

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) splits the first dimension (the
sequence of ``[s, b, h]``) instead; its operators are *g* and *g-bar* of the paper's figure 5:

* :func:`scatter_to_sequence_parallel_region` -- keep this rank's ``s/p`` rows; backward
  all-gathers them.
* :func:`gather_from_sequence_parallel_region` -- all-gather the ``s/p`` rows into ``s`` (before a
  column-parallel linear); backward reduce-scatters (the consumer's input gradient is a partial
  sum on each rank) or, for a replicated consumer, keeps this rank's rows.
* :func:`reduce_scatter_to_sequence_parallel_region` -- sum the partial ``[s, b, h]`` of a
  row-parallel linear and keep this rank's ``s/p`` rows; backward all-gathers.

Every function takes the TP group ``tp_group`` explicitly; ``None`` (this rank alone: no tensor
parallelism) or a group of one makes it a no-op. Inside a compiled layer the collectives are
traced as functional collectives, not graph breaks (:func:`communicate`). The layers' own
temporaries (a row-parallel layer's partial sums, a linear's input gradient) are all-reduced in
place, as Megatron's; the public *f* and *g* copy first unless told the tensor is theirs.
"""

from __future__ import annotations

import torch
from torch.distributed import _functional_collectives as funcol

from megatron.core import comm
from megatron.core.tensor_parallel.utils import (ProcessGroup, divide, split_along_last_dim,
                                                 tp_rank, tp_world_size)


def _reduce(x: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    if tp_world_size(tp_group) == 1:
        return x
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, "sum", tp_group)
    x = x.contiguous()  # in-place collective on a fresh buffer, not on a view of the input
    comm.all_reduce(x, tp_group)
    return x


def _split_last(x: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    size = tp_world_size(tp_group)
    if size == 1:
        return x
    return split_along_last_dim(x, size)[tp_rank(tp_group)].contiguous()


def _gather_last(x: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    size = tp_world_size(tp_group)
    if size == 1:
        return x
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(x.contiguous(), x.dim() - 1, tp_group)
    parts = comm.all_gather_list(x.contiguous(), tp_group)
    return torch.cat(parts, dim=-1).contiguous()


def _split_first(x: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    size = tp_world_size(tp_group)
    if size == 1:
        return x
    rows = divide(x.size(0), size)
    start = tp_rank(tp_group) * rows
    return x[start:start + rows].contiguous()  # [s/p, ...]


def _gather_first(x: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    size = tp_world_size(tp_group)
    if size == 1:
        return x
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(x.contiguous(), 0, tp_group)  # [s, ...]
    out = torch.empty((x.size(0) * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into(out, x.contiguous(), tp_group)
    return out  # [s, ...]


def _reduce_scatter_first(x: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    size = tp_world_size(tp_group)
    if size == 1:
        return x
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, tp_group)  # [s/p, ...]
    out = torch.empty((divide(x.size(0), size), *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_into(out, x.contiguous(), tp_group)
    return out  # [s/p, ...]


def communicate(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``. Eagerly its collectives go through :mod:`megatron.core.comm`
    (NCCL-rule checks, watchdog bookkeeping); inside a compiled layer (``--compile-layers``)
    the Function is traced, its collectives as torch's functional collectives, so a layer at
    TP > 1 stays one graph (as torchtitan traces them)."""
    return function.apply(*args)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp_group, grad_in_place):
        ctx.tp_group, ctx.grad_in_place = tp_group, grad_in_place
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad if ctx.grad_in_place else grad.clone()
        return _reduce(grad, ctx.tp_group), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp_group, in_place):
        return _reduce(x if in_place else x.clone(), tp_group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return _split_last(x, tp_group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.tp_group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return _gather_last(x, tp_group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.tp_group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return _split_first(x, tp_group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.tp_group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp_group, grad_is_partial):
        ctx.tp_group, ctx.grad_is_partial = tp_group, grad_is_partial
        return _gather_first(x, tp_group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter_first(grad, ctx.tp_group), None, None
        return _split_first(grad, ctx.tp_group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return _reduce_scatter_first(x, tp_group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.tp_group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, tp_group: ProcessGroup | None, *,
                                         grad_in_place: bool = False) -> torch.Tensor:
    """*f*: identity forward; the backward all-reduces the gradient over ``tp_group``.

    Args:
        grad_in_place: the consumer hands back a gradient nobody else reads (a linear layer's
            input gradient): it is all-reduced in place, as Megatron's, not in a copy.
    """
    if tp_world_size(tp_group) == 1:
        return x
    return communicate(_CopyToRegion, x, tp_group, grad_in_place)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, tp_group: ProcessGroup | None,
                                             *, in_place: bool = False) -> torch.Tensor:
    """*g*: all-reduce (sum) over ``tp_group`` forward; identity backward.

    Args:
        in_place: ``x`` is a temporary nobody else reads (a row-parallel layer's partial sums):
            it is all-reduced in place and returned, as Megatron's, not in a copy.
    """
    if tp_world_size(tp_group) == 1:
        return x
    return communicate(_ReduceFromRegion, x, tp_group, in_place)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor,
                                            tp_group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers."""
    if tp_world_size(tp_group) == 1:
        return x
    return communicate(_ScatterToRegion, x, tp_group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor,
                                             tp_group: ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dimension over ``tp_group``; backward keeps this rank's slice."""
    if tp_world_size(tp_group) == 1:
        return x
    return communicate(_GatherFromRegion, x, tp_group)


def scatter_to_sequence_parallel_region(x: torch.Tensor,
                                        tp_group: ProcessGroup | None) -> torch.Tensor:
    """``[s, ...]`` replicated on every rank -> this rank's ``[s/p, ...]`` rows; backward
    all-gathers the rows' gradients."""
    if tp_world_size(tp_group) == 1:
        return x
    return communicate(_ScatterToSequenceRegion, x, tp_group)


def gather_from_sequence_parallel_region(x: torch.Tensor, tp_group: ProcessGroup | None,
                                         grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather ``[s/p, ...]`` into ``[s, ...]`` (rank order along the sequence).

    Args:
        grad_is_partial: the gradient arriving in backward is this rank's partial sum (the
            consumer is split over TP ranks, a column-parallel linear): reduce-scatter it.
            False for a consumer replicated on every rank (BERT's pooler and heads), whose
            gradient is already the whole one: keep this rank's rows.
    """
    if tp_world_size(tp_group) == 1:
        return x
    return communicate(_GatherFromSequenceRegion, x, tp_group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor,
                                               tp_group: ProcessGroup | None) -> torch.Tensor:
    """Sum the partial ``[s, ...]`` over ``tp_group`` and keep this rank's ``[s/p, ...]``;
    backward all-gathers."""
    if tp_world_size(tp_group) == 1:
        return x
    return communicate(_ReduceScatterToSequenceRegion, x, tp_group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ep_group, output_splits, input_splits):
        ctx.group, ctx.splits = ep_group, (output_splits, input_splits)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x, ep_group, output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        comm.all_to_all_single(back, grad.contiguous(), ctx.group, input_splits, output_splits)
        return back, None, None, None


def all_to_all(x: torch.Tensor, ep_group: ProcessGroup | None, output_splits: list[int],
               input_splits: list[int]) -> torch.Tensor:
    """Exchange dim-0 row blocks over ``ep_group`` (``input_splits[r]`` rows to rank r,
    ``output_splits[r]`` rows from it); backward sends the gradients back the same way. Expert
    parallelism's token exchange."""
    if tp_world_size(ep_group) == 1:
        return x
    return communicate(_AllToAll, x, ep_group, output_splits, input_splits)
