"""Evaluating a finetuned model (Megatron-LM's ``tasks/eval_utils.py``): every batch of a data
set through the forward-only schedule at any pipeline size, results shared by all stages, and the
accuracy callback of the labelled tasks (GLUE, RACE) with their data sets, each read once.

An evaluation callback runs on every rank (the model is this rank's TP shard and pipeline
stage: the forward has TP collectives and pipeline sends) and returns the same metrics on every
rank: :func:`~tasks.finetune_loaders.evaluation_loader` gives this rank's slice of a data set,
:func:`forward_outputs` runs it (the outputs exist on the last pipeline stage only), and
:func:`share_from_last_stage` reduces a tensor of results over data-parallel ranks and hands it
to every stage.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron.config import MegatronConfig
from megatron.core import comm, device, parallel_state
from megatron.core.log import log_rank_last
from megatron.core.pipeline_parallel import get_forward_backward_func
from tasks.finetune_loaders import evaluation_loader
from tasks.flags import TaskFlags
from tasks.forward_step import bert_forward_step

EvalCallback = Callable[[list[torch.nn.Module], int], dict[str, float]]


@contextlib.contextmanager
def eval_mode(model: Sequence[torch.nn.Module]):
    """No dropout and no gradients inside; the chunks' training mode restored after."""
    modes = [chunk.training for chunk in model]
    for chunk in model:
        chunk.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for chunk, mode in zip(model, modes):
            chunk.train(mode)


# Running a data set ------------------------------------------------------------------------
def forward_outputs(model: Sequence[torch.nn.Module], loader,
                    forward_step: Callable = bert_forward_step) -> list:
    """Every batch of ``loader`` through this rank's model chunk with the forward-only schedule
    (no dropout, no gradients), as Megatron's evaluation does at any pipeline size.

    ``forward_step(data_iterator, model) -> (output, collect)`` where ``collect(output,
    non_loss_data=True)`` returns what to keep (default, :func:`~tasks.forward_step.
    bert_forward_step` without a loss: ``(logits, batch)`` on the device).

    Returns:
        On the last pipeline stage what ``collect`` returned for each batch, in order;
        elsewhere ``[]`` (every stage reads the same batches: each needs the padding mask).
    """
    num_batches = len(loader)
    if num_batches == 0:
        return []
    with eval_mode(model):
        # The shapes travel with the activations (variable_seq_lengths): a partial last batch
        # or a multiple-choice batch [s, b x choices, h] is not [seq, micro-batch, h].
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(loader), model=list(model),
            num_microbatches=num_batches, seq_length=1, micro_batch_size=1,
            forward_only=True, collect_non_loss_data=True, variable_seq_lengths=True)


def share_from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """``values`` (this rank's results on the last pipeline stage, ignored elsewhere) summed over
    the data-parallel ranks of the last stage, then given to every stage (Megatron reduces on
    the last stage and prints from the last rank; here every rank also returns the metrics).
    Returns a tensor on the compute device."""
    values = values.to(device.get_device())
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        values = torch.zeros_like(values)
    comm.all_reduce(values, parallel_state.get_data_parallel_group())
    # Only the last stage holds non-zeros: the sum over the pipeline is its values.
    comm.all_reduce(values, parallel_state.get_pipeline_model_parallel_group())
    return values


# Accuracy (RACE, GLUE) -----------------------------------------------------------------------
def count_correct(model: Sequence[torch.nn.Module], loader,
                  predictions: list | None = None) -> tuple[int, int]:
    """``(correct, total)`` of ``argmax(model(text, padding_mask, types))`` against ``label``
    over this rank's loader, summed over data-parallel ranks (the same on every rank, whatever
    its pipeline stage). With ``predictions`` (a list), on the last pipeline stage this rank's
    ``(softmax, label, uid)`` of every sample are appended to it."""
    correct = torch.zeros(2, dtype=torch.long, device="cpu")  # summed here, shared on device
    for logits, batch in forward_outputs(model, loader):
        predicted = logits.argmax(dim=-1).cpu()
        labels = batch["label"].cpu()
        correct[0] += int((predicted == labels).sum())
        correct[1] += predicted.numel()
        if predictions is not None:
            probs = torch.softmax(logits.float(), dim=-1).cpu().tolist()
            predictions.extend(zip(probs, labels.tolist(), batch["uid"].cpu().tolist()))
    correct = share_from_last_stage(correct)
    return int(correct[0]), int(correct[1])


def _save_predictions(path: str, named: list[tuple[str, list]]) -> None:
    """Megatron's evaluation-only ``predictions.pt``: ``[(name, (softmaxes, labels, uids))]``
    per data set, every data-parallel rank's samples (ordered by uid), written by the last rank
    (as Megatron's ``is_last_rank()``: the last pipeline stage, which holds the outputs)."""
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return  # no outputs here; the gather below runs over the last stage's DP group only
    dp_group = parallel_state.get_data_parallel_group()
    out = []
    for name, mine in named:
        every = sorted((p for part in comm.all_gather_object(mine, dp_group) for p in part),
                       key=lambda p: p[2])
        out.append((name, ([p[0] for p in every], [p[1] for p in every],
                           [p[2] for p in every])))
    world = comm.world_group()
    if comm.rank(world) == comm.world_size(world) - 1:
        torch.save(out, path)
        log_rank_last(f" > predictions of {len(out)} data set(s) written to {path}")


def accuracy_func_provider(named_datasets: Sequence[tuple[str, Any]], micro_batch_size: int,
                           collate_fn=None, predictions_path: str | None = None) -> EvalCallback:
    """Megatron's ``accuracy_func_provider``: the accuracy of every ``(name, dataset)`` and all
    of them together, logged as Megatron does (``|epoch: e| metrics for NAME: correct / total
    = c / t = p %`` and ``|epoch: e| overall: ...``). With ``predictions_path``, the
    evaluation-only call (epoch -1) also writes Megatron's ``predictions.pt`` there.

    Returns:
        ``callback(model, epoch) -> {"accuracy": overall, "accuracy NAME": ..., ...}``
        (fractions in [0, 1]).
    """
    def callback(model, epoch: int) -> dict[str, float]:
        log_rank_last("calculating metrics ...")
        metrics, correct, total, named = {}, 0, 0, []
        for name, dataset in named_datasets:
            kept = [] if predictions_path is not None and epoch == -1 else None
            c, t = count_correct(model, evaluation_loader(dataset, micro_batch_size, collate_fn),
                                 kept)
            log_rank_last(f" > |epoch: {epoch}| metrics for {name}: correct / total = {c} / {t} "
                          f"= {100.0 * c / max(t, 1):.4f} %")
            metrics[f"accuracy {name}"] = c / max(t, 1)
            correct, total = correct + c, total + t
            if kept is not None:
                named.append((name, kept))
        log_rank_last(f" >> |epoch: {epoch}| overall: correct / total = {correct} / {total} = "
                      f"{100.0 * correct / max(total, 1):.4f} %")
        if named:
            _save_predictions(predictions_path, named)
        return {"accuracy": correct / max(total, 1), **metrics}
    return callback


def predictions_path(cfg: MegatronConfig) -> str | None:
    """Where Megatron's evaluation-only mode writes ``predictions.pt``: in ``--load``."""
    load = cfg.checkpoint.load
    return os.path.join(load, "predictions.pt") if load is not None else None


class LabelledDatasets:
    """A labelled task's datasets for :func:`finetune`: the training set, and each
    ``--valid-data`` path read once, for both the validation loss and the accuracy.

    Args:
        build: ``build(name, paths, tokenizer, seq_length)`` -> the dataset of ``paths``.
        name_of: a ``--valid-data`` path -> its name in the results lines.
    """

    def __init__(self, build: Callable[[str, list[str], Any, int], Any],
                 name_of: Callable[[str], str]) -> None:
        self.build, self.name_of = build, name_of
        self.cache: dict[str, Any] = {}

    def one(self, cfg: MegatronConfig, tokenizer, path: str):
        if path not in self.cache:
            self.cache[path] = self.build(self.name_of(path), [path], tokenizer,
                                          cfg.data.seq_length)
        return self.cache[path]

    def train_valid(self, cfg: MegatronConfig, tokenizer):
        """``finetune``'s ``train_valid_datasets_provider``."""
        ex = cfg.section(TaskFlags)
        train = self.build("training", ex.train_data, tokenizer, cfg.data.seq_length)
        valid = None
        if ex.valid_data:
            valid = torch.utils.data.ConcatDataset(
                [self.one(cfg, tokenizer, path) for path in ex.valid_data])
        return train, valid

    def metrics(self, cfg: MegatronConfig, tokenizer):
        """``finetune``'s ``end_of_epoch_callback_provider``: accuracy per ``--valid-data``."""
        ex = cfg.section(TaskFlags)
        if not ex.valid_data:
            return None  # training only: no accuracy of nothing ranks the epochs
        named = [(self.name_of(path), self.one(cfg, tokenizer, path)) for path in ex.valid_data]
        return accuracy_func_provider(
            named, ex.eval_micro_batch_size or cfg.training.micro_batch_size,
            predictions_path=predictions_path(cfg))
