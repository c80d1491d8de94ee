"""Finetuning a BERT on a downstream task (Megatron-LM's ``tasks/finetune_utils.py``), built on
the pretraining pieces of :mod:`megatron.training` (model/optimizer set-up, ``Trainer`` with its
step, log line, TensorBoard and checkpoints).

A task supplies four things and calls :func:`finetune`::

    from tasks.finetune_utils import (finetune, classification_model_provider,
                                      accuracy_func_provider)

    def train_valid_datasets_provider(cfg, tokenizer):
        # torch Datasets whose items are dicts of tensors / numpy arrays / ints; the default
        # forward step reads "text" [s], "types" [s], "padding_mask" [s] and "label" ().
        return MyDataset(cfg.section(TaskFlags).train_data, tokenizer, cfg.data.seq_length), None

    def metrics_provider(cfg, tokenizer):
        ex = cfg.section(TaskFlags)
        return accuracy_func_provider(
            [(path, MyDataset([path], tokenizer, cfg.data.seq_length)) for path in ex.valid_data],
            micro_batch_size=ex.eval_micro_batch_size or cfg.training.micro_batch_size)

    def run(argv):                      # registered in tasks/registry.py
        return finetune(train_valid_datasets_provider, classification_model_provider(3),
                        end_of_epoch_callback_provider=metrics_provider, argv=argv,
                        task="MYTASK")

Contract (types):

* ``train_valid_datasets_provider(cfg: MegatronConfig, tokenizer) -> (train: Dataset,
  valid: Dataset | None)``: called only with ``--epochs`` > 0. ``valid`` (optional) gives the
  validation *loss* of Megatron's ``--eval-interval`` line (over ``--eval-iters`` batches).
* ``model_provider(cfg: MegatronConfig, pre_process: bool = True, post_process: bool = True)
  -> torch.nn.Module``: this rank's stage, TP-split, seeded by the caller (see
  :func:`classification_model_provider`, :func:`multiple_choice_model_provider`, and
  :class:`megatron.core.models.bert_heads.BertWithHead` for another head). Its
  ``load_state_dict(sd, strict=False)`` must take a pretrained BERT's model dict (heads it does
  not have dropped, its own new head left as initialized).
* ``forward_step(data_iterator: Iterator[dict], model) -> (output, loss_func)``, the training
  schedule's contract; ``loss_func(output) -> (loss: scalar tensor, {name: tensor[1]})``
  (logged values averaged over data-parallel ranks). Default :func:`cross_entropy_forward_step`:
  cross entropy of the model's logits against ``batch["label"]``, logged as ``lm loss``.
* ``end_of_epoch_callback_provider(cfg: MegatronConfig, tokenizer) -> callback`` with
  ``callback(model: list[torch.nn.Module], epoch: int) -> dict[str, float]``: named metrics,
  the **first** of which (higher = better) ranks the epochs in the final summary. ``epoch`` is
  Megatron's: 0-based, the epoch just finished (or in progress, at an ``--eval-interval``
  point); -1 with ``--epochs 0``. It runs on every rank (the model is this rank's TP shard and
  pipeline stage: every rank must call it, since the forward has TP collectives and pipeline
  sends) and should return the same metrics on every rank. Use :func:`evaluation_loader` for
  this rank's slice of a data set and :func:`forward_outputs` to run it through the
  forward-only schedule (the outputs exist on the last pipeline stage only), then
  :func:`share_from_last_stage` to reduce a tensor of results over data-parallel ranks and
  hand it to every stage.
* ``task_collate_fn``: the loaders' ``collate_fn`` (default: torch's default collation).

Both providers run *before* ``torch.distributed`` starts (every rank reads the data itself), so
a ``ValueError`` they raise (a malformed input file, naming the file and line) ends the run with
a one-line ``tasks/main.py: error: ...`` before any process group exists.

The loop (Megatron's behaviour): ``train_iters = epochs x iterations per epoch``; each epoch a
new order of the training set from ``--seed + epoch``, sharded over data-parallel ranks, the
last partial global batch dropped unless ``--keep-last``; ``--pretrained-checkpoint`` (weights
only) when starting from iteration 0, ``--load`` resumes (mid-epoch: the loader goes on from the
next batch, no batch re-read); the callback at every ``--eval-interval`` and each epoch end; a
checkpoint at each epoch end (and ``--save-interval``); ``--epochs 0`` evaluates only.

Pipeline parallelism (``--pipeline-model-parallel-size``, the 1F1B schedule): the BERT body is
split over the stages as in pretraining, the pooler, the task head and the loss are on the last
stage; the stages send each activation's shape before it (``variable_seq_lengths``), since a
multiple-choice micro-batch is ``[s, b x choices, h]`` and evaluation batches may be partial.
Checkpoints (``--save``, ``--load``, ``--pretrained-checkpoint``) are per stage,
``mp_rank_TT_PPP``. The interleaved schedule (``--num-layers-per-virtual-pipeline-stage``) is
refused, as in Megatron-LM's tasks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from megatron.config import MegatronConfig
from megatron.config.cli import build_parser, parse_args, parse_flags, validate_or_exit
from megatron.config.core_configs import transformer_config
from megatron.core import comm, device, parallel_state
from megatron.core.log import log_rank_0, log_rank_last
from megatron.core.models.builder import build_model_stage
from megatron.core.models.bert_heads import Classification, MultipleChoice
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.timers import Timers
from megatron.training import log_line
from megatron.training.checkpointing import checkpoint_dir, load_checkpoint
from megatron.training.inference import check_checkpoint_to_load
from megatron.training.initialize import (apply_checkpoint_args, build_tokenizer_from_config,
                                          initialize_megatron)
from megatron.training.loop import Trainer, TrainState
from megatron.training.pretrain import (build_microbatch_calculator, build_model,
                                        setup_model_and_optimizer)
from megatron.training.signals import DistributedSignalHandler
from tasks.finetune_loaders import (EpochBatchSampler, evaluation_loader,  # noqa: F401
                                    make_loader)
from tasks.flags import TOOL_SECTIONS, TaskFlags

PROG = "tasks/main.py"

EvalCallback = Callable[[list[torch.nn.Module], int], dict[str, float]]


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One run of the evaluation callback."""

    epoch: int
    """Megatron's 0-based epoch (-1: ``--epochs 0``)."""
    iteration: int
    metrics: dict[str, float]
    at_epoch_end: bool
    checkpoint: str | None
    """The checkpoint of the evaluated weights (``--save``'s, or the one loaded), if any."""


@dataclasses.dataclass
class FinetuneResult:
    """What :func:`finetune` returns (on every rank)."""

    state: TrainState
    iterations_per_epoch: int
    evaluations: list[Evaluation]
    best: Evaluation | None
    """The epoch-end evaluation with the highest first metric (``--epochs 0``: the one)."""
    model: list[torch.nn.Module] = dataclasses.field(default_factory=list)
    """This rank's model chunks as trained (or evaluated): e.g. to write predictions."""
    exited_early: bool = False


# The default forward step ------------------------------------------------------------------
def batch_to_device(batch: dict) -> dict[str, torch.Tensor]:
    """A collated batch on the compute device; ``padding_mask`` as long (1 = real token)."""
    dev = device.get_device()
    return {key: torch.as_tensor(value, device="cpu").to(dev, non_blocking=True)
            for key, value in batch.items()}


def cross_entropy_loss_func(labels: torch.Tensor, logits: torch.Tensor):
    """Cross entropy (fp32) of ``logits [b, k]`` against ``labels [b]``; reported as Megatron's
    finetuning does (``lm loss``, averaged over data-parallel ranks)."""
    loss = F.cross_entropy(logits.contiguous().float(), labels.long())
    reported = loss.detach().clone().view(1)
    comm.all_reduce(reported, parallel_state.get_data_parallel_group(), op="avg")
    return loss, {"lm loss": reported}


def cross_entropy_forward_step(data_iterator: Iterator[dict], model):
    """Megatron's ``_cross_entropy_forward_step``: ``model(text, padding_mask, types)`` ->
    logits, cross entropy against ``label``."""
    batch = batch_to_device(next(data_iterator))
    logits = model(batch["text"].long(), batch["padding_mask"].long(),
                   tokentype_ids=batch["types"].long())
    return logits, functools.partial(cross_entropy_loss_func, batch["label"])


def _collect_forward_step(data_iterator: Iterator[dict], model):
    """The evaluation forward step: the model's output and, on the last stage, ``(output,
    batch)`` collected by the schedule as non-loss data."""
    batch = batch_to_device(next(data_iterator))
    output = model(batch["text"].long(), batch["padding_mask"].long(),
                   tokentype_ids=batch["types"].long())

    def collect(output_tensor, non_loss_data: bool = False):
        del non_loss_data  # only called with it: evaluation computes no loss
        return output_tensor.detach(), batch

    return output, collect


def forward_outputs(model: Sequence[torch.nn.Module], loader,
                    forward_step: Callable = _collect_forward_step) -> list:
    """Every batch of ``loader`` through this rank's model chunk with the forward-only schedule
    (no dropout, no gradients), as Megatron's evaluation does at any pipeline size.

    ``forward_step(data_iterator, model) -> (output, collect)`` where ``collect(output,
    non_loss_data=True)`` returns what to keep (default: ``(logits, batch)`` on the device).

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


# Models ------------------------------------------------------------------------------------
def finetune_transformer_config(cfg: MegatronConfig):
    """BERT's transformer config for a finetuning model: two token types (Megatron-LM's
    ``Classification``/``MultipleChoice`` always have them) and no LM output layer."""
    return dataclasses.replace(transformer_config(cfg), num_tokentypes=2,
                               untie_embeddings_and_output_weights=False)


def classification_model_provider(num_classes: int) -> Callable[..., torch.nn.Module]:
    """Model provider of a BERT :class:`~megatron.core.models.bert_heads.Classification`."""
    def provider(cfg, pre_process: bool = True, post_process: bool = True):
        return build_model_stage(Classification, finetune_transformer_config(cfg),
                                 pre_process=pre_process, post_process=post_process,
                                 num_classes=num_classes)
    return provider


def multiple_choice_model_provider() -> Callable[..., torch.nn.Module]:
    """Model provider of a BERT :class:`~megatron.core.models.bert_heads.MultipleChoice`."""
    def provider(cfg, pre_process: bool = True, post_process: bool = True):
        return build_model_stage(MultipleChoice, finetune_transformer_config(cfg),
                                 pre_process=pre_process, post_process=post_process)
    return provider


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


# Flags ---------------------------------------------------------------------------------------
def check_finetune_flags(flags: MegatronConfig, task: str) -> None:
    """The finetuning flags as given, before validation and before any process group.

    Raises:
        ValueError: naming the flag, the value and the fix.
    """
    ex, t, ck = flags.section(TaskFlags), flags.training, flags.checkpoint
    if ex.epochs is None:
        raise ValueError(f"--task {task} needs --epochs: the number of passes over --train-data "
                         "(0 evaluates --load or --pretrained-checkpoint on --valid-data)")
    if ex.epochs < 0:
        raise ValueError(f"--epochs must be >= 0, got {ex.epochs}")
    if t.train_iters is not None or t.train_samples is not None:
        given = "--train-iters" if t.train_iters is not None else "--train-samples"
        raise ValueError(f"{given} with --task {task}: finetuning runs --epochs passes over "
                         f"--train-data (the iterations follow from its size); drop {given}")
    if flags.parallel.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError(f"--task {task} with --num-layers-per-virtual-pipeline-stage "
                         f"{flags.parallel.num_layers_per_virtual_pipeline_stage}: the interleaved "
                         "pipeline schedule is not supported for downstream tasks (as in "
                         "Megatron-LM); drop it: the plain 1F1B schedule runs at any "
                         "--pipeline-model-parallel-size")
    if ex.eval_micro_batch_size is not None and ex.eval_micro_batch_size < 1:
        raise ValueError(f"--eval-micro-batch-size must be >= 1, got {ex.eval_micro_batch_size}")
    if ex.epochs > 0 and not ex.train_data:
        raise ValueError(f"--task {task} needs --train-data (or --epochs 0 to evaluate only)")
    for flag, paths in (("--train-data", ex.train_data if ex.epochs > 0 else None),
                        ("--valid-data", ex.valid_data)):
        for path in paths or ():
            if not os.path.exists(path):
                raise ValueError(f"{flag} {path}: no such file or directory")
    if ex.epochs == 0 and not ex.valid_data:
        raise ValueError(f"--task {task} --epochs 0 evaluates on --valid-data: give it")
    if ex.pretrained_checkpoint is not None:
        check_checkpoint_to_load(ex.pretrained_checkpoint, None, False,
                                 flag="--pretrained-checkpoint", purpose="finetune from")
    if ex.epochs == 0 and ex.pretrained_checkpoint is None:
        check_checkpoint_to_load(ck.load, ck.ckpt_step, ck.random_weights, purpose="evaluate")


def check_finetune_config(cfg: MegatronConfig) -> None:
    """Checks that need validated values (data-parallel size), still before process groups.

    Raises:
        ValueError: ``--keep-last`` with gradient accumulation.
    """
    ex, t = cfg.section(TaskFlags), cfg.training
    if ex.keep_last and _microbatches_per_step(cfg) != 1:
        raise ValueError(
            f"--keep-last with gradient accumulation (--global-batch-size {t.global_batch_size}"
            f" = {_microbatches_per_step(cfg)} micro-batches of --micro-batch-size "
            f"{t.micro_batch_size} x {cfg.data_parallel_size} data-parallel ranks): the last "
            "partial batch cannot be split into whole micro-batches; drop --keep-last or set "
            "--global-batch-size to micro-batch size x data-parallel size")
    if t.rampup_batch_size is not None:
        raise ValueError("--rampup-batch-size with finetuning: every epoch uses one global "
                         "batch size; drop --rampup-batch-size")


def _microbatches_per_step(cfg: MegatronConfig) -> int:
    t = cfg.training
    return t.global_batch_size // (t.micro_batch_size * cfg.data_parallel_size)


def _or_exit(check, *args):
    try:
        return check(*args)
    except ValueError as err:
        raise SystemExit(f"{PROG}: error: {err}") from None


def _validated(argv: Sequence[str]) -> MegatronConfig:
    """``argv`` parsed and validated as :func:`initialize_megatron` does, starting nothing."""
    parser = build_parser(prog=PROG, tool_sections=TOOL_SECTIONS)
    flags = parse_flags(parser, argv, TOOL_SECTIONS)
    if flags.checkpoint.use_checkpoint_args:
        apply_checkpoint_args(flags)
    return validate_or_exit(flags, parser=parser)


# The loop ------------------------------------------------------------------------------------
def finetune(train_valid_datasets_provider: Callable, model_provider: Callable,
             forward_step: Callable = cross_entropy_forward_step,
             end_of_epoch_callback_provider: Callable | None = None,
             task_collate_fn: Callable | None = None, *, argv: Sequence[str],
             task: str = "finetuning") -> FinetuneResult:
    """Finetune (or with ``--epochs 0`` evaluate) a model on ``argv``'s flags; see the module
    docstring for the providers' types. ``task`` names the task in error messages.

    Returns:
        A :class:`FinetuneResult` (every rank).

    Raises:
        SystemExit: bad flags or data (one line naming the flag/file), before any process group.
        CheckpointError: an unusable ``--load`` or ``--pretrained-checkpoint``.
    """
    argv = list(argv)
    flags = parse_args(argv, validate_config=False, prog=PROG, tool_sections=TOOL_SECTIONS)
    _or_exit(check_finetune_flags, flags, task)
    setup_cfg = _validated(argv)
    _or_exit(check_finetune_config, setup_cfg)
    ex = setup_cfg.section(TaskFlags)
    tokenizer = build_tokenizer_from_config(setup_cfg)
    train_ds = valid_ds = None
    iterations_per_epoch = 0
    if ex.epochs > 0:
        train_ds, valid_ds = _or_exit(train_valid_datasets_provider, setup_cfg, tokenizer)
        iterations_per_epoch = _or_exit(_iterations_per_epoch, setup_cfg, len(train_ds))
    callback = None
    if end_of_epoch_callback_provider is not None:
        callback = _or_exit(end_of_epoch_callback_provider, setup_cfg, tokenizer)
    weights_cfg = None
    if ex.pretrained_checkpoint is not None:
        weights_cfg = _validated(argv + ["--finetune", "--no-load-rng"])
    train_iters = ex.epochs * iterations_per_epoch
    run_argv = argv + (["--train-iters", str(train_iters)] if ex.epochs > 0 else [])
    cfg = initialize_megatron(run_argv, require_train_length=ex.epochs > 0,
                              tool_sections=TOOL_SECTIONS)
    if ex.epochs == 0:
        return _evaluate_only(cfg, weights_cfg, model_provider, callback)
    run = _FinetuneRun(cfg, model_provider, forward_step, callback, task_collate_fn,
                       iterations_per_epoch)
    return run.train(train_ds, valid_ds, weights_cfg)


def _iterations_per_epoch(cfg: MegatronConfig, num_samples: int) -> int:
    # Counted with the run's data-parallel size: each step takes mbs x dp x micro-batches.
    sampler = _train_sampler(cfg, num_samples, 0, 0, cfg.data_parallel_size)
    iterations = sampler.iterations()
    if iterations == 0:
        raise ValueError(f"--train-data holds {num_samples} samples, fewer than one global batch "
                         f"(--global-batch-size {cfg.training.global_batch_size}): lower it or "
                         "pass --keep-last")
    return iterations


def _train_sampler(cfg, num_samples: int, epoch: int, start_iteration: int, dp_size: int,
                   dp_rank: int = 0) -> EpochBatchSampler:
    t = cfg.training
    return EpochBatchSampler(
        num_samples, t.micro_batch_size, dp_rank, dp_size,
        num_microbatches=_microbatches_per_step(cfg),
        seed=cfg.model.seed, epoch=epoch, drop_last=not cfg.section(TaskFlags).keep_last,
        start_iteration=start_iteration)


def _load_pretrained(model: list, weights_cfg: MegatronConfig, path: str) -> None:
    """Megatron's ``--pretrained-checkpoint``: its weights only (``weights_cfg`` carries
    ``--finetune --no-load-rng``: no iteration, optimizer or RNG state); a pretrained BERT's own
    heads are dropped and the new head keeps its initialization (the model's non-strict load)."""
    log_rank_0(f" > loading the pretrained checkpoint {path} (weights only)")
    load_checkpoint(model, None, None, weights_cfg, load_dir=path, strict=False)


def _evaluate_only(cfg: MegatronConfig, weights_cfg: MegatronConfig | None, model_provider,
                   callback) -> FinetuneResult:
    """``--epochs 0``: the callback on the ``--load`` weights, or (as Megatron: when nothing
    was loaded) the ``--pretrained-checkpoint``'s; Megatron's evaluation-only mode."""
    ex, state = cfg.section(TaskFlags), TrainState()
    model = build_model(cfg, model_provider)
    source = None
    if cfg.checkpoint.load is not None:
        state.iteration = load_checkpoint(model, None, None, cfg)[0]
        source = str(checkpoint_dir(cfg.checkpoint.load, state.iteration))
    if state.iteration == 0 and ex.pretrained_checkpoint is not None:
        _load_pretrained(model, weights_cfg, ex.pretrained_checkpoint)
        source = ex.pretrained_checkpoint
    log_rank_0("evaluation only mode, setting epoch to -1")
    evaluations = []
    if callback is not None:
        evaluations.append(Evaluation(-1, state.iteration, callback(model, -1), True, source))
    best = evaluations[0] if evaluations else None
    _log_summary(best)
    return FinetuneResult(state, 0, evaluations, best, model)


def _log_summary(best: Evaluation | None) -> None:
    if best is None:
        log_rank_0("done: no evaluation ran (no --valid-data, or nothing left to train)")
        return
    name, value = next(iter(best.metrics.items()))
    where = f"the end of epoch {best.epoch + 1}" if best.epoch >= 0 else "evaluation only"
    saved = f", checkpoint {best.checkpoint}" if best.checkpoint else ", not saved (no --save)"
    log_rank_last(f" >> best {name}: {value:.4f} at {where} (iteration {best.iteration}){saved}")


class _FinetuneRun:
    """The epochs of one finetuning run over the pretraining Trainer (step, log line,
    TensorBoard, --save-interval, exit conditions)."""

    def __init__(self, cfg: MegatronConfig, model_provider, forward_step, callback,
                 collate_fn, iterations_per_epoch: int) -> None:
        self.cfg, self.callback, self.collate_fn = cfg, callback, collate_fn
        self.forward_step = forward_step
        self.per_epoch = iterations_per_epoch
        self.epochs = cfg.section(TaskFlags).epochs
        self.timers = Timers(cfg.logging.timing_log_level, cfg.logging.timing_log_option)
        self.model, self.optimizer, self.scheduler, self.state = \
            setup_model_and_optimizer(cfg, model_provider, self.timers)
        self.writer = log_line.make_tensorboard_writer(cfg)
        self.evaluations: list[Evaluation] = []

    def train(self, train_ds, valid_ds, weights_cfg: MegatronConfig | None) -> FinetuneResult:
        cfg, s = self.cfg, self.state
        ex = cfg.section(TaskFlags)
        if s.iteration == 0 and ex.pretrained_checkpoint is not None:
            _load_pretrained(self.model, weights_cfg, ex.pretrained_checkpoint)
            # The optimizer's fp32 main params still hold the initial weights.
            self.optimizer.reload_model_params()
        # Pipelined: the stages send each activation's shape first (multiple-choice batches are
        # [s, b x choices, h]; --keep-last's last batch is smaller).
        trainer = Trainer(cfg, self.forward_step, self.model, self.optimizer, self.scheduler,
                          build_microbatch_calculator(cfg), self.timers, s, writer=self.writer,
                          variable_seq_lengths=cfg.parallel.pipeline_model_parallel_size > 1)
        valid_it = self._valid_iterator(valid_ds)
        log_rank_0(f"finetuning for {self.epochs} epochs of {self.per_epoch} iterations "
                   f"(starting at iteration {s.iteration})")
        if cfg.training.exit_signal_handler:
            with DistributedSignalHandler() as handler:
                exited = self._epochs(trainer, train_ds, valid_it, handler)
        else:
            exited = self._epochs(trainer, train_ds, valid_it, None)
        ends = [e for e in self.evaluations if e.at_epoch_end]
        best = max(ends, key=lambda e: next(iter(e.metrics.values())), default=None)
        if not exited:
            _log_summary(best)
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        return FinetuneResult(s, self.per_epoch, self.evaluations, best, self.model, exited)

    def _epochs(self, trainer: Trainer, train_ds, valid_it, handler) -> bool:
        """Train the remaining epochs; True if an exit condition stopped the run."""
        s, eval_interval = self.state, self.cfg.training.eval_interval
        start_epoch, start_iteration = divmod(s.iteration, self.per_epoch)
        for epoch in range(start_epoch, self.epochs):
            log_rank_0(f"working on epoch {epoch + 1} ...")
            train_it = iter(self._train_loader(train_ds, epoch, start_iteration))
            start_iteration = 0
            epoch_end = (epoch + 1) * self.per_epoch
            while s.iteration < epoch_end:
                stop = epoch_end
                if eval_interval:
                    stop = min(epoch_end, (s.iteration // eval_interval + 1) * eval_interval)
                if trainer.train(train_it, valid_it, self.epochs * self.per_epoch, handler,
                                 stop_at=stop):
                    return True
                if stop < epoch_end:
                    self._evaluate(epoch, at_epoch_end=False)
            trainer.save()
            self._evaluate(epoch, at_epoch_end=True)
        return False

    def _evaluate(self, epoch: int, at_epoch_end: bool) -> None:
        if self.callback is None:
            return
        s, save = self.state, self.cfg.checkpoint.save
        metrics = self.callback(self.model, epoch)
        saved = save is not None and s.last_saved_iteration == s.iteration
        self.evaluations.append(Evaluation(epoch, s.iteration, dict(metrics), at_epoch_end,
                                           str(checkpoint_dir(save, s.iteration)) if saved
                                           else None))
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(f"{name} validation", value, s.iteration)

    def _train_loader(self, train_ds, epoch: int, start_iteration: int):
        sampler = _train_sampler(self.cfg, len(train_ds), epoch, start_iteration,
                                 parallel_state.get_data_parallel_world_size(),
                                 parallel_state.get_data_parallel_rank())
        return make_loader(train_ds, sampler, self.collate_fn, self.cfg.data.num_workers)

    def _valid_iterator(self, valid_ds):
        """Megatron's validation-loss stream at --eval-interval: this rank's share of
        ``valid_ds`` in order, cycled."""
        t = self.cfg.training
        if valid_ds is None or len(valid_ds) == 0 or t.eval_iters == 0:
            return None
        sampler = EpochBatchSampler(
            len(valid_ds), t.micro_batch_size, parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(), shuffle=False,
            num_microbatches=_microbatches_per_step(self.cfg))
        if sampler.iterations() == 0:
            return None
        loader = make_loader(valid_ds, sampler, self.collate_fn, 0)

        def cycle():
            while True:
                yield from loader
        return cycle()
