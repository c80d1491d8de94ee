"""The forward step of every BERT task, for training and for evaluation (Megatron-LM's
``process_batch`` and ``_cross_entropy_forward_step`` of ``tasks/finetune_utils.py``).

:func:`bert_forward_step` moves the next batch to the device and runs ``model(text,
padding_mask, types)``. What follows the forward is the task's: given a ``loss_func(batch,
output) -> (loss, {"lm loss": ...})`` it returns the training schedule's loss function (GLUE and
RACE: :func:`cross_entropy_loss`; SQuAD: the span loss of :mod:`tasks.squad.model`); without
one, the forward-only schedule collects ``(output, batch)`` (evaluation). Every task reports
its loss through :func:`reported_loss`, the one data-parallel average of the logged value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from megatron.core import comm, device, parallel_state
from megatron.core.tensor_parallel.utils import ProcessGroup

TaskLossFunc = Callable[[dict, torch.Tensor], tuple]
"""``loss_func(batch, output) -> (loss, {"lm loss": tensor[1]})``."""


def batch_to_device(batch: dict) -> dict[str, torch.Tensor]:
    """A collated batch on the compute device; ``padding_mask`` as long (1 = real token)."""
    dev = device.get_device()
    return {key: torch.as_tensor(value, device="cpu").to(dev, non_blocking=True)
            for key, value in batch.items()}


def reported_loss(loss: torch.Tensor, dp_group: ProcessGroup | None) -> dict[str, torch.Tensor]:
    """The loss as Megatron's finetuning logs it: ``lm loss``, averaged over ``dp_group``."""
    reported = loss.detach().clone().view(1)
    comm.all_reduce(reported, dp_group, op="avg")
    return {"lm loss": reported}


def cross_entropy_loss(batch: dict, logits: torch.Tensor):
    """Cross entropy (fp32) of ``logits [b, k]`` against ``batch["label"] [b]``."""
    loss = F.cross_entropy(logits.contiguous().float(), batch["label"].long())
    return loss, reported_loss(loss, parallel_state.get_data_parallel_group())


def _collect(batch: dict, output: torch.Tensor, non_loss_data: bool = False):
    del non_loss_data  # only called with it: evaluation computes no loss
    return output.detach(), batch


def bert_forward_step(data_iterator: Iterator[dict], model,
                      loss_func: TaskLossFunc | None = None):
    """The schedule's forward step: ``model(text, padding_mask, types)`` on the next batch, then
    ``loss_func(batch, output)`` (training) or, without it, ``(output, batch)`` kept as the
    forward-only schedule's non-loss data on the last stage (evaluation)."""
    batch = batch_to_device(next(data_iterator))
    output = model(batch["text"].long(), batch["padding_mask"].long(),
                   tokentype_ids=batch["types"].long())
    if loss_func is None:
        return output, functools.partial(_collect, batch)
    return output, functools.partial(loss_func, batch)


cross_entropy_forward_step = functools.partial(bert_forward_step, loss_func=cross_entropy_loss)
"""Megatron's ``_cross_entropy_forward_step`` (GLUE, RACE): the default of ``finetune``."""
