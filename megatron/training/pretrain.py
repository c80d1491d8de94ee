"""``pretrain()``: the entry point scripts build on, in the shape Megatron-LM users know.

    pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func)

* ``model_provider(cfg, pre_process=True, post_process=True) -> torch.nn.Module``
* ``train_valid_test_datasets_provider(cfg, tokenizer, [train, valid, test] num samples)
  -> (train_ds, valid_ds, test_ds)`` (any may be None)
* ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)``; one that also
  takes a keyword ``cfg`` is called with the run's validated config
"""

from __future__ import annotations

import functools
import inspect
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megatron.config import MegatronConfig
from megatron.config.cli import ExtraArgsProvider
from megatron.config.core_configs import ddp_config, optimizer_config
from megatron.core import device, parallel_state
from megatron.core.distributed import DistributedDataParallel, TorchDistributedDataParallel
from megatron.core.log import get_logger, log_rank_0
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.timers import Timers
from megatron.data.samplers import build_pretraining_data_loader
from megatron.training import log_line
from megatron.training.checkpointing import (check_fresh_start, finish_async_save, load_checkpoint,
                                             remove_interrupted_save_files)
from megatron.training.initialize import build_tokenizer_from_config, initialize_megatron
from megatron.training.loop import Trainer, TrainState, evaluate_and_print
from megatron.training.lr_schedule import OptimizerParamScheduler
from megatron.training.microbatches import NumMicroBatchesCalculator
from megatron.training.signals import DistributedSignalHandler


def pretrain(train_valid_test_datasets_provider: Callable, model_provider: Callable,
             forward_step_func: Callable, *, argv: Sequence[str] | None = None,
             extra_args_provider: ExtraArgsProvider | None = None,
             flops_per_sample: Callable[[MegatronConfig], float] | None = None,
             require_data: bool = False) -> TrainState:
    """Initialize, build model/optimizer/data, train, evaluate; returns the final state.

    ``require_data``: the datasets provider reads the --data-path flags (as pretrain_gpt.py's
    and pretrain_bert.py's do), so their absence is refused with the other flag errors, before
    any process group starts; a provider of its own samples leaves it False.

    ``forward_step_func`` is called as ``forward_step_func(data_iterator, model)``; scripts that
    need the config take it as the keyword ``cfg`` (see pretrain_gpt.py: the batch keeps an
    explicit attention mask only where the data flags can make one that is not plain causal).
    """
    # Megatron's _TRAIN_START_TIME: --exit-duration-in-mins counts set-up time too.
    start_time = time.time()
    cfg = initialize_megatron(argv, extra_args_provider, require_train_length=True,
                              require_data=require_data)
    forward_step_func = _bind_config(forward_step_func, cfg)
    timers = Timers(cfg.logging.timing_log_level, cfg.logging.timing_log_option)
    tokenizer = build_tokenizer_from_config(cfg) if cfg.tokenizer.tokenizer_type else None
    model, optimizer, scheduler, state = setup_model_and_optimizer(cfg, model_provider, timers)
    train_iters = compute_train_iters(cfg)
    microbatches = build_microbatch_calculator(cfg)
    train_it, valid_it, test_it = build_data_iterators(
        cfg, tokenizer, train_valid_test_datasets_provider, train_iters, state)
    flops = None
    if flops_per_sample is not None:
        per_sample = flops_per_sample(cfg)
        flops = lambda batch: per_sample * batch  # noqa: E731 - tiny closure
    writer = log_line.make_tensorboard_writer(cfg)
    trainer = Trainer(cfg, forward_step_func, model, optimizer, scheduler, microbatches, timers,
                      state, flops, writer, start_time=start_time)
    exited = False
    if not cfg.training.skip_train and train_it is not None and state.iteration < train_iters:
        log_rank_0(f"training for {train_iters} iterations (starting at {state.iteration})")
        if cfg.training.exit_signal_handler:
            # The handler stays through the final save: a SIGTERM then (a preemption at the
            # very end) must let the save finish, not kill the rank half-way through it.
            with DistributedSignalHandler() as handler:
                exited = trainer.train(train_it, valid_it, train_iters, handler)
                trainer.save()
        else:
            exited = trainer.train(train_it, valid_it, train_iters)
            trainer.save()
    if not exited and cfg.training.eval_iters > 0:
        if valid_it is not None:
            evaluate_and_print("the end of training for val data", forward_step_func, valid_it,
                               model, cfg, microbatches, writer, state, cfg.training.eval_iters)
        if test_it is not None:
            evaluate_and_print("the end of training for test data", forward_step_func, test_it,
                               model, cfg, microbatches, writer, state, cfg.training.eval_iters)
    finish_async_save()
    if writer is not None:
        writer.flush()
        writer.close()
    return state


def _bind_config(forward_step_func: Callable, cfg: MegatronConfig) -> Callable:
    """``forward_step_func`` with ``cfg=cfg`` bound when it takes that keyword."""
    try:
        takes_cfg = "cfg" in inspect.signature(forward_step_func).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        takes_cfg = False
    return functools.partial(forward_step_func, cfg=cfg) if takes_cfg else forward_step_func


def setup_model_and_optimizer(cfg: MegatronConfig, model_provider: Callable,
                              timers: Timers | None = None):
    """Model, optimizer and LR schedule of a validated run, restored from ``--load``.

    The piece finetuning and evaluation scripts share with :func:`pretrain` (call
    :func:`~megatron.training.initialize.initialize_megatron` first).

    Returns:
        ``(model_chunks, optimizer, scheduler, state)``: the DDP-wrapped chunks of this rank, the
        Megatron optimizer, the scheduler, and a :class:`TrainState` at the loaded iteration
        (0 without ``--load``).

    Raises:
        CheckpointError: an unusable ``--load``, or ``--save`` holding another run's
            checkpoints while nothing is loaded.
    """
    timers = timers or Timers(0, "minmax")
    if cfg.checkpoint.save is not None:
        remove_interrupted_save_files(Path(cfg.checkpoint.save))
    model = build_model(cfg, model_provider)
    optimizer = get_megatron_optimizer(
        optimizer_config(cfg), model,
        dp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        mp_group=parallel_state.get_model_parallel_group(), timers=timers,
        **_expert_groups())
    scheduler = build_scheduler(cfg, optimizer, compute_train_iters(cfg))
    state = TrainState()
    if cfg.checkpoint.load is not None:
        timers("load-checkpoint", log_level=0).start(barrier=True)
        state.iteration, state.consumed_train_samples, state.consumed_valid_samples = \
            load_checkpoint(model, optimizer, scheduler, cfg)
        timers("load-checkpoint").stop(barrier=True)
        state.last_saved_iteration = state.iteration
    else:
        check_fresh_start(cfg)  # --save may hold another run's checkpoints
    return model, optimizer, scheduler, state


def build_microbatch_calculator(cfg: MegatronConfig) -> NumMicroBatchesCalculator:
    """Micro-batches per step for --global-batch-size (with --rampup-batch-size)."""
    t = cfg.training
    return NumMicroBatchesCalculator(t.global_batch_size, t.micro_batch_size,
                                     cfg.data_parallel_size, t.rampup_batch_size)


def build_model(cfg: MegatronConfig, model_provider: Callable) -> list[torch.nn.Module]:
    """The model chunk(s) of this rank on the compute device, each wrapped for data parallelism:
    one chunk, or with virtual pipeline stages one per virtual stage (Megatron's ``build_model``:
    chunk ``k`` is built with the virtual rank set to ``k``, so that its layer offset and its
    ``pre_process``/``post_process`` are those of virtual stage ``k``)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    modules = []
    for k in range(vpp or 1):
        if vpp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(k)
        modules.append(model_provider(cfg, pre_process=parallel_state.is_pipeline_first_stage(),
                                      post_process=parallel_state.is_pipeline_last_stage()))
    if vpp is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    num_params = 0
    for module in modules:
        module.to(device.get_device())
        num_params += sum(p.numel() for p in module.parameters())
    if parallel_state.get_data_parallel_rank() == 0:
        # As Megatron: one line per (TP, PP) shard, each stage counting its own parameters.
        get_logger().info(f" > number of parameters on (tensor, pipeline) model parallel rank "
                          f"({parallel_state.get_tensor_model_parallel_rank()}, "
                          f"{parallel_state.get_pipeline_model_parallel_rank()}): {num_params}")
    return [_wrap_for_data_parallel(cfg, module) for module in modules]


def _expert_groups() -> dict[str, object]:
    """The optimizer's expert groups on the expert grid (none without it, at EP 1 and ETP =
    TP: the experts are reduced and counted as dense parameters, the same groups)."""
    if not parallel_state.has_expert_grid():
        return {}
    return {"expert_dp_group": parallel_state.get_expert_data_parallel_group(),
            "expert_mp_group": parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
            "expert_tensor_parallel_rank": parallel_state.get_expert_tensor_parallel_rank()}


def _wrap_for_data_parallel(cfg: MegatronConfig, module: torch.nn.Module) -> torch.nn.Module:
    # Context-parallel ranks computed the gradients of different tokens of the same samples:
    # they are reduced over DP x CP (the loss is scaled by CP, see pretrain_gpt.loss_func).
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    config = ddp_config(cfg)
    if cfg.parallel.ddp_impl == "torch":
        return TorchDistributedDataParallel(
            module, dp_group=dp_group, check_for_nan_in_grad=config.check_for_nan_in_grad)
    wrapped = DistributedDataParallel(module, config, dp_group=dp_group,
                                      **{k: v for k, v in _expert_groups().items()
                                         if k == "expert_dp_group"})
    if cfg.model.data_parallel_random_init:
        wrapped.broadcast_params()  # PyTorch's DDP (above) broadcasts at construction
    return wrapped


def compute_train_iters(cfg: MegatronConfig) -> int:
    """--train-iters, or the iterations --train-samples needs, as Megatron's update_train_iters.

    With ``--rampup-batch-size start incr samples``: one iteration per ramp-up batch while the
    consumed samples are at most ``samples``, then ``(train_samples - consumed) // gbs`` full
    batches (a final partial batch is dropped, so 1000 samples with ramp-up ``8 8 300`` and
    gbs 32 are 24 ramp-up iterations to 320 samples, then 21: 45). Where ``--train-samples``
    ends inside the ramp-up, Megatron's formula goes negative; here the ramp-up batches that fit
    whole in ``--train-samples`` are counted instead.
    """
    t = cfg.training
    if t.train_iters is not None:
        return t.train_iters
    if t.train_samples is None:
        return 0
    if t.rampup_batch_size is None:
        return t.train_samples // t.global_batch_size
    calc = NumMicroBatchesCalculator(t.global_batch_size, t.micro_batch_size,
                                     cfg.data_parallel_size, t.rampup_batch_size)
    rampup_samples = int(t.rampup_batch_size[2])
    iterations, consumed = 0, 0
    while consumed <= rampup_samples:
        calc.update(consumed)
        if consumed + calc.current_global_batch_size > t.train_samples:
            return iterations
        consumed += calc.current_global_batch_size
        iterations += 1
    return iterations + (t.train_samples - consumed) // t.global_batch_size


def build_scheduler(cfg: MegatronConfig, optimizer, train_iters: int) -> OptimizerParamScheduler:
    """Megatron's schedule lengths, counted in samples."""
    t, o = cfg.training, cfg.optimizer
    # --lr may be left out only with --skip-train (validation checks it): no step is taken.
    max_lr = o.lr if o.lr is not None else o.min_lr
    gbs = t.global_batch_size
    if t.train_samples is None:
        decay_steps = (o.lr_decay_iters if o.lr_decay_iters is not None else train_iters) * gbs
        wd_incr_steps = train_iters * gbs
        warmup_steps = o.lr_warmup_fraction * decay_steps if o.lr_warmup_fraction is not None \
            else o.lr_warmup_iters * gbs
    else:
        decay_steps = o.lr_decay_samples if o.lr_decay_samples is not None else t.train_samples
        wd_incr_steps = t.train_samples
        warmup_steps = o.lr_warmup_fraction * decay_steps if o.lr_warmup_fraction is not None \
            else o.lr_warmup_samples
    return OptimizerParamScheduler(
        optimizer, max_lr=max_lr, min_lr=o.min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(decay_steps, 1), lr_decay_style=o.lr_decay_style,
        start_wd=o.start_weight_decay, end_wd=o.end_weight_decay,
        wd_incr_steps=max(wd_incr_steps, 1), wd_incr_style=o.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=o.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=o.override_opt_param_scheduler)


def build_data_iterators(cfg: MegatronConfig, tokenizer, provider: Callable, train_iters: int,
                         state: TrainState):
    """Datasets sized as Megatron does, then resumable loaders and iterators: ``(train, valid,
    test)``, each an iterator (or None), or with virtual pipeline stages a list of one iterator
    per model chunk."""
    t = cfg.training
    gbs = t.global_batch_size
    eval_runs = (train_iters // t.eval_interval + 1) if t.eval_interval else 1
    num_samples = [t.train_samples if t.train_samples is not None else train_iters * gbs,
                   eval_runs * t.eval_iters * gbs, t.eval_iters * gbs]
    train_ds, valid_ds, test_ds = provider(cfg, tokenizer, num_samples)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()

    def loader(ds, consumed):
        if ds is None or len(ds) == 0:
            return None
        return build_pretraining_data_loader(
            ds, consumed, cfg.data.dataloader_type, t.micro_batch_size, dp_rank, dp_size,
            cfg.data.num_workers)

    def iterators():
        train_loader = loader(train_ds, state.consumed_train_samples)
        valid_loader = loader(valid_ds, state.consumed_valid_samples)
        test_loader = loader(test_ds, 0)
        train_it = iter(train_loader) if train_loader is not None else None
        # Evaluation may need more batches than one pass holds: cycle over the loader.
        valid_it = _cycle(valid_loader) if valid_loader is not None else None
        test_it = _cycle(test_loader) if test_loader is not None else None
        return train_it, valid_it, test_it

    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return iterators()
    # The interleaved schedule reads micro-batch i once per model chunk, each chunk from its own
    # iterator (Megatron builds one set per chunk): every chunk's stream stays on the same batch.
    per_chunk = [iterators() for _ in range(vpp)]
    return tuple(None if chunk_its[0] is None else list(chunk_its)
                 for chunk_its in zip(*per_chunk))


def _cycle(loader):
    for _ in itertools.count():
        yield from loader
