"""The training loop: one step, evaluation, and the iteration loop with logging and exits."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator

import torch

from megatron.core import comm, device, parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.log import log_rank_0, log_rank_last
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.timers import Timers
from megatron.core.transformer.moe import metrics as moe_metrics
from megatron.training import fault, log_line
from megatron.training.checkpointing import save_checkpoint
from megatron.training.microbatches import NumMicroBatchesCalculator


# The timers of Megatron-LM's training log, in its order (those never started, e.g. the pipeline
# send/recv ones without pipeline parallelism or those above --timing-log-level, are left out).
TIMERS_TO_LOG = [
    "forward-backward", "forward-compute", "backward-compute", "batch-generator",
    "forward-recv", "forward-send", "backward-recv", "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
    "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "grads-all-reduce",
    "grads-reduce-scatter", "params-all-gather", "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-count-zeros",
    "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer"]


@dataclasses.dataclass
class TrainState:
    """What advances as training runs (and is restored from checkpoints)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    last_saved_iteration: int | None = None


@dataclasses.dataclass
class _LogAccumulator:
    losses: dict[str, float] = dataclasses.field(default_factory=dict)
    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    skipped_total: int = 0

    def add(self, losses: dict[str, float], skipped: bool) -> None:
        """Accumulate one iteration. Every iteration with a NaN/inf reported loss is a nan
        iteration, applied or skipped (Megatron-LM 23.06 counted skipped ones only, so a NaN
        step that was applied logged "number of nan iterations: 0"); an applied step's loss
        is averaged in, so the logged loss shows the NaN too."""
        if any(not math.isfinite(v) for v in losses.values()):
            self.nan += 1
        if skipped:
            self.skipped += 1
            self.skipped_total += 1
        else:
            self.advanced += 1
            for key, value in losses.items():
                self.losses[key] = self.losses.get(key, 0.0) + value

    def averages(self) -> dict[str, float]:
        return {k: v / max(1, self.advanced) for k, v in self.losses.items()}

    def reset(self) -> None:
        self.losses, self.advanced, self.skipped, self.nan = {}, 0, 0, 0


def _average_reduced_losses(losses_reduced: list[dict]) -> dict[str, float]:
    if not losses_reduced:
        return {}
    return {key: float(sum(float(d[key]) for d in losses_reduced) / len(losses_reduced))
            for key in losses_reduced[0]}


class _LossRecorder:
    """``forward_step_func`` whose loss functions also record whether this rank's local loss
    (the one backward starts from, before loss scaling) was finite; read only to name the rank
    once a reported loss is NaN/inf (no host sync per micro-batch)."""

    def __init__(self, forward_step_func: Callable) -> None:
        self.forward_step_func = forward_step_func
        self.nonfinite: torch.Tensor | None = None

    def __call__(self, data_iterator, model):
        output, loss_func = self.forward_step_func(data_iterator, model)

        def recording_loss_func(output_tensor, *args, **kwargs):
            result = loss_func(output_tensor, *args, **kwargs)
            if not kwargs.get("non_loss_data"):
                bad = ~torch.isfinite(result[0].detach()).all()
                self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad
            return result

        return output, recording_loss_func


def check_finite(losses: dict[str, float], recorder: _LossRecorder, model: list, cfg,
                 iteration: int) -> None:
    """--check-for-nan-in-loss-and-grad (on by default): stop on a NaN/inf reported loss, or on
    NaN/inf local gradients, naming the iteration and the first rank where they appeared.

    The gradients are checked by the DDP wrappers when their config says so
    (``megatron.config.core_configs.ddp_config``: not with --fp16, whose loss scaler owns
    overflowing gradients: the step is skipped); the loss is always checked. Every
    rank joins one small all-reduce and so reaches the same verdict: a rank raising alone
    would leave the others waiting in their next collective.

    Raises:
        FloatingPointError: on every rank, before the optimizer step.
    """
    everyone = comm.world_group()
    rank, world = comm.rank(everyone), comm.world_size(everyone)
    grads_bad = not all(chunk.local_grads_finite() for chunk in model)
    local_loss_bad = recorder.nonfinite is not None and bool(recorder.nonfinite)
    reported_bad = any(not math.isfinite(v) for v in losses.values())
    # MAX over ranks of (world - rank) for the ranks where it is bad: the lowest such rank.
    first = torch.tensor([world - rank if bad else 0 for bad in
                          (reported_bad, local_loss_bad, grads_bad)],
                         dtype=torch.long, device=device.get_device())
    comm.all_reduce(first, everyone, op="max")
    reported_on, loss_on, grads_on = (world - v if v > 0 else None for v in first.tolist())
    if reported_on is None and grads_on is None:
        return
    what = []
    if reported_on is not None:
        shown = ", ".join(f"{key}: {value}" for key, value in losses.items()) or \
            "no loss: not the last pipeline stage"
        what.append(f"a reported loss is NaN/inf (first on rank {reported_on}; here {shown})")
    if loss_on is not None:
        what.append(f"the local loss first went NaN/inf on rank {loss_on}")
    if grads_on is not None:
        when = "after" if cfg.parallel.ddp_impl == "torch" else "before"
        what.append(f"local gradients first went NaN/inf on rank {grads_on} ({when} the "
                    "data-parallel reduction)")
    raise FloatingPointError(
        f"iteration {iteration}: {'; '.join(what)}. Training stopped before the optimizer step "
        "(--no-check-for-nan-in-loss-and-grad trains on and counts the nan iterations in the "
        "log line instead)")


def train_step(forward_step_func: Callable, data_iterator: Iterator, model: list, optimizer,
               scheduler, cfg, microbatches: NumMicroBatchesCalculator, timers: Timers, *,
               iteration: int, variable_seq_lengths: bool = False
               ) -> tuple[dict[str, float], bool, float | None, int | None]:
    """One optimizer step over a global batch (``iteration``: its number, for error messages;
    ``variable_seq_lengths``: pipeline stages send each activation's shape before it, for
    micro-batches whose shape is not ``[seq-length, micro-batch-size, h]``, e.g. finetuning's
    multiple-choice batches and kept last partial batch).

    Returns:
        (mean loss dict over micro-batches, skipped, grad norm, number of zeros in grad)

    Raises:
        FloatingPointError: see :func:`check_finite`.
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    check = cfg.training.check_for_nan_in_loss_and_grad
    if check:
        forward_step_func = _LossRecorder(forward_step_func)
    timers("forward-backward", log_level=1).start(barrier=cfg.logging.barrier_with_L1_time)
    losses_reduced = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=microbatches.get(), seq_length=cfg.data.seq_length,
        micro_batch_size=cfg.training.micro_batch_size, forward_only=False,
        grad_scale_func=optimizer.scale_loss, timers=timers,
        variable_seq_lengths=variable_seq_lengths)
    timers("forward-backward").stop()
    # Megatron-LM names the DP reduction after its collective.
    reduce_timer = "grads-reduce-scatter" if cfg.parallel.use_distributed_optimizer \
        else "grads-all-reduce"
    timers(reduce_timer, log_level=1).start(barrier=cfg.logging.barrier_with_L1_time)
    finalize_model_grads(model)
    timers(reduce_timer).stop()
    losses = _average_reduced_losses(losses_reduced)
    if cfg.model.num_experts is not None:
        moe_losses = _moe_aux_losses(cfg, microbatches.get())
        if losses:  # the last pipeline stage reports
            losses.update(moe_losses)
    if check:
        check_finite(losses, forward_step_func, model, cfg, iteration)
    timers("optimizer", log_level=1).start(barrier=cfg.logging.barrier_with_L1_time)
    update_successful, grad_norm, num_zeros = optimizer.step()
    timers("optimizer").stop()
    if update_successful:
        increment = microbatches.get() * cfg.training.micro_batch_size * cfg.data_parallel_size
        scheduler.step(increment=increment)
    if cfg.parallel.empty_unused_memory_level >= 1:
        device.empty_cache()
    return losses, not update_successful, grad_norm, num_zeros


def _moe_aux_losses(cfg, num_microbatches: int) -> dict[str, float]:
    """This iteration's MoE auxiliary losses (Megatron's names, unscaled: each over its
    coefficient), the mean over the MoE layers and, with --moe-per-layer-logging, each layer's
    as ``moe/<name>_layer_<i>`` (TensorBoard only); a collective over TP, PP, CP and DP (every rank calls it)."""
    m = cfg.model
    names = []
    if m.moe_aux_loss_coeff > 0 and m.moe_router_load_balancing_type in (
            "aux_loss", "seq_aux_loss", "global_aux_loss"):
        names.append({"aux_loss": "load_balancing_loss",
                      "seq_aux_loss": "seq_load_balancing_loss",
                      "global_aux_loss": "global_load_balancing_loss"}[
                          m.moe_router_load_balancing_type])
    if m.moe_z_loss_coeff is not None:
        names.append("z_loss")
    groups = {}
    if parallel_state.model_parallel_is_initialized():
        groups = dict(tp_group=parallel_state.get_tensor_model_parallel_group(),
                      pp_group=parallel_state.get_pipeline_model_parallel_group(),
                      dp_group=parallel_state.get_data_parallel_group(),
                      cp_group=parallel_state.get_context_parallel_group())
    per_layer = moe_metrics.reduce_per_layer(num_microbatches, names, m.num_layers, **groups)
    moe_metrics.zero()
    freq = m.moe_layer_freq
    moe_layers = [i for i in range(m.num_layers)
                  if (i % freq == 0 if isinstance(freq, int) else freq[i])]
    out = {}
    for name, values in per_layer.items():
        out[name] = float(values[moe_layers].sum()) / len(moe_layers)
        if m.moe_per_layer_logging:
            # Megatron-Core's per-layer TensorBoard tags (not printed in the log line).
            out.update({f"{log_line.PER_LAYER_PREFIX}{name}_layer_{i}": float(values[i])
                        for i in moe_layers})
    return out


def evaluate(forward_step_func: Callable, data_iterator: Iterator, model: list, cfg,
             microbatches: NumMicroBatchesCalculator, eval_iters: int,
             variable_seq_lengths: bool = False) -> dict[str, float]:
    """Mean loss over ``eval_iters`` global batches, without gradients (``variable_seq_lengths``:
    as :func:`train_step`)."""
    for chunk in model:
        chunk.eval()
    totals: dict[str, float] = {}
    for _ in range(eval_iters):
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=microbatches.get(), seq_length=cfg.data.seq_length,
            micro_batch_size=cfg.training.micro_batch_size, forward_only=True,
            variable_seq_lengths=variable_seq_lengths)
        for key, value in _average_reduced_losses(reduced).items():
            totals[key] = totals.get(key, 0.0) + value
    for chunk in model:
        chunk.train()
    return {k: v / max(1, eval_iters) for k, v in totals.items()}


def evaluate_and_print(prefix: str, forward_step_func, data_iterator, model, cfg, microbatches,
                       writer, state: TrainState, eval_iters: int,
                       variable_seq_lengths: bool = False) -> dict[str, float]:
    losses = evaluate(forward_step_func, data_iterator, model, cfg, microbatches, eval_iters,
                      variable_seq_lengths)
    log_line.log_validation(prefix, losses, writer, state.iteration, state.consumed_train_samples,
                            cfg.logging.log_validation_ppl_to_tensorboard)
    return losses


class Trainer:
    """Runs the iteration loop: steps, logging, evaluation, checkpoints and exits."""

    def __init__(self, cfg, forward_step_func: Callable, model: list, optimizer, scheduler,
                 microbatches: NumMicroBatchesCalculator, timers: Timers, state: TrainState,
                 flops_per_sample: Callable[[int], float] | None = None, writer=None,
                 start_time: float | None = None, variable_seq_lengths: bool = False) -> None:
        """``start_time`` (``time.time()``) starts the ``--exit-duration-in-mins`` clock:
        pretrain() passes the time it was called, so set-up counts as Megatron's
        ``_TRAIN_START_TIME`` does; None means now. ``variable_seq_lengths``: see
        :func:`train_step` (finetuning's pipelined runs)."""
        self.cfg = cfg
        self.forward_step_func = forward_step_func
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.microbatches = microbatches
        self.timers = timers
        self.state = state
        self.flops_per_batch = flops_per_sample
        self.writer = writer
        self.acc = _LogAccumulator()
        self.start_time = time.time() if start_time is None else start_time
        self.variable_seq_lengths = variable_seq_lengths

    def save(self) -> None:
        s = self.state
        if self.cfg.checkpoint.save is None or s.last_saved_iteration == s.iteration:
            return
        self.timers("save-checkpoint", log_level=0).start(barrier=True)
        with fault.hang_watch(armed=False):  # writing shards: no collectives for a long while
            save_checkpoint(s.iteration, self.model, self.optimizer, self.scheduler, self.cfg,
                            s.consumed_train_samples, s.consumed_valid_samples,
                            s.floating_point_operations_so_far)
        self.timers("save-checkpoint").stop(barrier=True)
        s.last_saved_iteration = s.iteration

    def train(self, train_iterator, valid_iterator, train_iters: int, signal_handler=None,
              stop_at: int | None = None) -> bool:
        """Train until ``train_iters`` (or until ``stop_at``, for a run trained in stretches
        such as finetuning's epochs: the log line still counts to ``train_iters``); returns True
        if an exit condition stopped it early."""
        for chunk in self.model:
            chunk.train()
        self.timers("interval-time", log_level=0).start(barrier=True)
        try:
            with fault.hang_watch():  # --watchdog-timeout-seconds: stuck outside collectives
                return self._train_loop(train_iterator, valid_iterator, train_iters,
                                        signal_handler, stop_at or train_iters)
        finally:
            interval = self.timers("interval-time")
            if interval.started:
                interval.stop()

    def _train_loop(self, train_iterator, valid_iterator, train_iters: int,
                    signal_handler, stop_at: int) -> bool:
        cfg, s = self.cfg, self.state
        while s.iteration < stop_at:
            self.microbatches.update(s.consumed_train_samples)
            losses, skipped, grad_norm, num_zeros = train_step(
                self.forward_step_func, train_iterator, self.model, self.optimizer,
                self.scheduler, cfg, self.microbatches, self.timers, iteration=s.iteration + 1,
                variable_seq_lengths=self.variable_seq_lengths)
            s.iteration += 1
            batch = self.microbatches.get() * cfg.training.micro_batch_size * cfg.data_parallel_size
            s.consumed_train_samples += batch
            if self.flops_per_batch is not None:
                s.floating_point_operations_so_far += self.flops_per_batch(batch)
            self.acc.add(losses, skipped)
            self._maybe_log(losses, grad_norm, num_zeros, batch, train_iters)
            if cfg.training.eval_interval and s.iteration % cfg.training.eval_interval == 0 \
                    and valid_iterator is not None and cfg.training.eval_iters > 0:
                with self._interval_timer_paused():
                    evaluate_and_print(f"iteration {s.iteration}", self.forward_step_func,
                                       valid_iterator, self.model, cfg, self.microbatches,
                                       self.writer, s, cfg.training.eval_iters,
                                       self.variable_seq_lengths)
                s.consumed_valid_samples += cfg.training.eval_iters * batch
            if self._should_exit(signal_handler):
                return True
            if cfg.checkpoint.save and cfg.checkpoint.save_interval and \
                    s.iteration % cfg.checkpoint.save_interval == 0:
                with self._interval_timer_paused():
                    self.save()
        return False

    @contextlib.contextmanager
    def _interval_timer_paused(self):
        """Evaluation and checkpoint saves stay out of the logged time per iteration and
        tokens/s (as later Megatron-LM releases do): they report training speed only."""
        self.timers("interval-time").stop()
        with fault.hang_watch(armed=False):  # long stretches without collectives by design
            yield  # an exception propagates at once: no barrier a failed rank's peers never reach
        self.timers("interval-time", log_level=0).start(barrier=True)

    def _should_exit(self, signal_handler) -> bool:
        """Megatron's three independent exit checks, in its order: signal, duration, interval.

        The first that fires saves a checkpoint and stops; one being set never disables the
        others (every rank reaches the same decision: the first two are reduced over ranks).
        """
        cfg, s = self.cfg, self.state
        reason = None
        if signal_handler is not None and signal_handler.signals_received():
            reason = "exiting program after receiving SIGTERM"
        if reason is None and cfg.training.exit_duration_in_mins:
            minutes = torch.tensor([(time.time() - self.start_time) / 60.0],
                                   device=device.get_device())
            comm.all_reduce(minutes, comm.world_group(), op="max")
            if minutes.item() > cfg.training.exit_duration_in_mins:
                reason = f"exiting program after {minutes.item():.1f} minutes"
        if reason is None and cfg.training.exit_interval \
                and s.iteration % cfg.training.exit_interval == 0:
            reason = f"exiting program at iteration {s.iteration}"
        if reason is None:
            return False
        self.save()
        comm.barrier(comm.world_group())
        log_rank_0(reason)
        return True

    def _maybe_log(self, losses, grad_norm, num_zeros, batch, train_iters) -> None:
        cfg, s = self.cfg, self.state
        lr = self._learning_rate()
        loss_scale = float(self.optimizer.get_loss_scale())
        params_norm = _params_norm(self.model) if cfg.logging.log_params_norm else None
        if self.writer is not None and s.iteration % cfg.logging.tensorboard_log_interval == 0:
            log_line.write_training_scalars(
                self.writer, cfg, iteration=s.iteration, consumed_samples=s.consumed_train_samples,
                learning_rate=lr, batch_size=batch, losses=losses, loss_scale=loss_scale,
                grad_norm=grad_norm, num_zeros=num_zeros, params_norm=params_norm,
                tokens_per_sec=None, tflops=None, world_size=cfg.world_size)
        if s.iteration % cfg.logging.log_interval != 0:
            return
        # Megatron divides by the iterations run since the last log line (advanced + skipped),
        # fewer than --log-interval on the first line after a resume from a non-multiple.
        iters = max(1, self.acc.advanced + self.acc.skipped)
        elapsed = self.timers("interval-time").elapsed(reset=True) / iters
        tokens_per_sec = batch * cfg.data.seq_length / elapsed if elapsed > 0 else 0.0
        tflops = None
        if self.flops_per_batch is not None and elapsed > 0:
            tflops = self.flops_per_batch(batch) / elapsed / cfg.world_size / 1e12
        line = log_line.training_log_string(
            iteration=s.iteration, train_iters=train_iters,
            consumed_samples=s.consumed_train_samples, elapsed_ms=elapsed * 1000.0,
            learning_rate=lr, batch_size=batch, losses=self.acc.averages(),
            loss_scale=loss_scale, grad_norm=grad_norm, num_zeros=num_zeros,
            params_norm=params_norm, skipped=self.acc.skipped, nan=self.acc.nan,
            tokens_per_sec=tokens_per_sec, tflops=tflops)
        log_rank_last(line)
        # Reducing the timers is a collective: every rank does it once, here, whether or not it
        # holds the writer; the TensorBoard scalars and the timer line are both made from it.
        timer_values = self.timers.elapsed_ms(TIMERS_TO_LOG, normalizer=iters)
        if self.writer is not None:
            self.writer.add_scalar("iteration-time", elapsed, s.iteration)
            self.writer.add_scalar("tokens-per-second", tokens_per_sec, s.iteration)
            if tflops is not None:
                self.writer.add_scalar("throughput", tflops, s.iteration)
            if cfg.logging.log_timers_to_tensorboard:
                self.timers.write_values(timer_values, self.writer, s.iteration)
        timer_line = self.timers.format_values(timer_values)
        if timer_line:
            log_rank_0(timer_line)
        self.acc.reset()

    def _learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer.param_groups else 0.0


def _params_norm(model: list) -> float:
    """L2 norm of the parameters over the model-parallel group, each counted once: a replicated
    one on TP rank 0 only, and the last stage's copy of a tied word embedding (``shared``) not
    at all (stage 0 counts the embedding), as Megatron's ``calc_params_l2_norm``.
    With expert parallelism the experts (``allreduce`` False) are summed over the expert
    model-parallel group (ETP x EP x PP) instead, since each EP rank holds other experts, and
    a replicated one on expert TP rank 0 only."""
    dense = torch.zeros(1, dtype=torch.float64, device=device.get_device())
    expert = torch.zeros(1, dtype=torch.float64, device=device.get_device())
    expert_parallel = parallel_state.has_expert_grid()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    expert_tp_rank = parallel_state.get_expert_tensor_parallel_rank()
    for chunk in model:
        for param in chunk.parameters():
            is_expert = expert_parallel and not getattr(param, "allreduce", True)
            duplicated = not getattr(param, "tensor_model_parallel", False)
            if (duplicated and (expert_tp_rank if is_expert else tp_rank) != 0) or \
                    getattr(param, "shared", False):
                continue
            (expert if is_expert else dense).add_(param.detach().double().norm() ** 2)
    comm.all_reduce(dense, parallel_state.get_model_parallel_group())
    if expert_parallel:
        comm.all_reduce(expert,
                        parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return float((dense + expert).sqrt())
