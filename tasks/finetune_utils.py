"""Finetuning a BERT on a downstream task (Megatron-LM's ``tasks/finetune_utils.py``), built on
the pretraining pieces of :mod:`megatron.training` (model/optimizer set-up, ``Trainer`` with its
step, log line, TensorBoard and checkpoints).

A task supplies four things and calls :func:`finetune`::

    from tasks.eval_utils import accuracy_func_provider
    from tasks.finetune_utils import finetune, classification_model_provider

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
  (logged values averaged over data-parallel ranks). Default
  :data:`tasks.forward_step.cross_entropy_forward_step`: cross entropy of the model's logits
  against ``batch["label"]``, logged as ``lm loss``.
* ``end_of_epoch_callback_provider(cfg: MegatronConfig, tokenizer) -> callback`` with
  ``callback(model: list[torch.nn.Module], epoch: int) -> dict[str, float]``: named metrics,
  the **first** of which (higher = better) ranks the epochs in the final summary. ``epoch`` is
  Megatron's: 0-based, the epoch just finished (or in progress, at an ``--eval-interval``
  point); -1 with ``--epochs 0``. It runs on every rank and should return the same metrics on
  every rank: :mod:`tasks.eval_utils` has the pieces (and the accuracy callback).
* ``task_collate_fn``: the loaders' ``collate_fn`` (default: torch's default collation).
* ``check_flags(flags: MegatronConfig)``: the task's own flag checks (raise ``ValueError``), run
  first on the flags as parsed.

The command line is parsed once (:func:`tasks.registry.parse_task_flags`); the run's config
(``--train-iters`` = epochs x iterations per epoch) and the pretrained weights' config
(``--finetune --no-load-rng``) are derived from it with ``dataclasses.replace``
(:func:`megatron.config.cli.replace_flags`).

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

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence

import torch

from megatron.config import MegatronConfig
from megatron.config.cli import replace_flags
from megatron.config.core_configs import transformer_config
from megatron.config.validate import ToolChecks, refuse_context_parallel
from megatron.core import parallel_state
from megatron.core.log import log_rank_0, log_rank_last
from megatron.core.models.bert_heads import Classification, MultipleChoice
from megatron.core.models.builder import build_model_stage
from megatron.core.timers import Timers
from megatron.training import log_line
from megatron.training.checkpointing import checkpoint_dir, load_checkpoint
from megatron.training.inference import check_checkpoint_to_load
from megatron.training.initialize import (build_tokenizer_from_config, initialize_from_config,
                                          validated_config)
from megatron.training.loop import Trainer, TrainState
from megatron.training.pretrain import (build_microbatch_calculator, build_model,
                                        setup_model_and_optimizer)
from megatron.training.signals import DistributedSignalHandler
from tasks.finetune_loaders import EpochBatchSampler, make_loader
from tasks.flags import TaskFlags
from tasks.forward_step import cross_entropy_forward_step
from tasks.registry import PROG, parse_task_flags

PRETRAINED_WEIGHTS = {"finetune": True, "no_load_rng": True}
"""The checkpoint flags of ``--pretrained-checkpoint``'s load (``--finetune --no-load-rng``):
its weights only, no iteration, optimizer or RNG state."""


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


# The loop ------------------------------------------------------------------------------------
def finetune(train_valid_datasets_provider: Callable, model_provider: Callable,
             forward_step: Callable = cross_entropy_forward_step,
             end_of_epoch_callback_provider: Callable | None = None,
             task_collate_fn: Callable | None = None, *, argv: Sequence[str],
             task: str = "finetuning", check_flags: Callable | None = None) -> FinetuneResult:
    """Finetune (or with ``--epochs 0`` evaluate) a model on ``argv``'s flags; see the module
    docstring for the providers' types. ``task`` names the task in error messages.

    Returns:
        A :class:`FinetuneResult` (every rank).

    Raises:
        SystemExit: bad flags or data (one line naming the flag/file), before any process group.
        CheckpointError: an unusable ``--load`` or ``--pretrained-checkpoint``.
    """
    flags, parser = parse_task_flags(argv)
    given = [] if check_flags is None else [check_flags]
    checks = ToolChecks(given=[*given, functools.partial(check_finetune_flags, task=task),
                               refuse_context_parallel("finetuning")],
                        validated=[check_finetune_config])
    setup_cfg = validated_config(flags, parser, tool_checks=checks)
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
        weights_cfg = validated_config(replace_flags(flags, checkpoint=PRETRAINED_WEIGHTS), parser)
    run_flags = flags
    if ex.epochs > 0:
        run_flags = replace_flags(flags, training={"train_iters": ex.epochs * iterations_per_epoch})
    cfg = initialize_from_config(run_flags, parser, require_train_length=ex.epochs > 0)
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
