"""Forward/backward schedules over the micro-batches of one global batch.

Contract (Megatron's): ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)``
and ``loss_func(output_tensor) -> (loss, {name: value reduced over data-parallel ranks})``. The
schedule divides each micro-batch's loss by the number of micro-batches (so gradients accumulate to
the mean), scales it with ``grad_scale_func`` (the fp16 loss scale) before backward, and returns
the list of reduced-loss dicts, one per micro-batch. Given ``timers``, it times Megatron-LM's
level-2 ``forward-compute``, ``backward-compute`` and ``batch-generator`` (each ``next()`` on the
data iterator).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from megatron.core import parallel_state
from megatron.core.timers import Timers, timed

ForwardStepFunc = Callable


def get_forward_backward_func() -> Callable:
    """The schedule for the current parallel layout (the one place schedules are chosen)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("pipeline-parallel schedules are not implemented yet: "
                                  "use --pipeline-model-parallel-size 1")
    return forward_backward_no_pipelining


class _TimedIterator:
    """``next()`` of the wrapped iterator timed as ``batch-generator``."""

    def __init__(self, iterator: Iterator, timers: Timers) -> None:
        self.iterator, self.timers = iterator, timers

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self):
        with timed(self.timers, "batch-generator", 2):
            return next(self.iterator)


def _forward_step(forward_step_func: ForwardStepFunc, data_iterator, model,
                  num_microbatches: int, store: list, collect_non_loss_data: bool,
                  timers: Timers | None = None) -> torch.Tensor:
    with timed(timers, "forward-compute", 2):  # the loss function included, as Megatron's
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        if collect_non_loss_data:
            store.append(loss_func(output_tensor, non_loss_data=True))
            return output_tensor
        loss, reduced = loss_func(output_tensor)
        store.append(reduced)
        return loss / num_microbatches


def _backward_step(loss: torch.Tensor, grad_scale_func: Callable | None,
                   timers: Timers | None = None) -> None:
    with timed(timers, "backward-compute", 2):
        if grad_scale_func is not None:
            loss = grad_scale_func(loss)
        torch.autograd.backward(loss)


def forward_backward_no_pipelining(*, forward_step_func: ForwardStepFunc,
                                   data_iterator: Iterator | list[Iterator],
                                   model: torch.nn.Module | list[torch.nn.Module],
                                   num_microbatches: int, seq_length: int | None = None,
                                   micro_batch_size: int | None = None,
                                   forward_only: bool = False,
                                   collect_non_loss_data: bool = False,
                                   grad_scale_func: Callable | None = None,
                                   timers: Timers | None = None) -> list:
    """Run every micro-batch forward then backward on one model chunk.

    Gradient reduction across data-parallel ranks is suppressed (``model.no_sync()``) for all but
    the last micro-batch, so an overlapping DDP reduces each bucket once per step.

    Returns:
        One entry per micro-batch: the loss function's reduced-loss dict.
    """
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("non-pipelined schedule runs exactly one model chunk")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if timers is not None and not timers.active(2):
        timers = None  # nothing to record: no per-micro-batch timing work
    if timers is not None and data_iterator is not None:
        data_iterator = _TimedIterator(data_iterator, timers)
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    store: list = []
    grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_context:
        with no_sync():
            for _ in range(num_microbatches - 1):
                loss = _forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                     store, collect_non_loss_data, timers)
                if not forward_only:
                    _backward_step(loss, grad_scale_func, timers)
        loss = _forward_step(forward_step_func, data_iterator, model, num_microbatches, store,
                             collect_non_loss_data, timers)
        if not forward_only:
            _backward_step(loss, grad_scale_func, timers)
    return store
