"""Megatron's training and validation log lines, and the TensorBoard scalars beside them.

Users' log parsers read these lines, so the field names, order and number formats follow
Megatron-LM; new fields (tokens per second, model TFLOP/s) are appended as extra ``| key: value``
cells, which parsers that split on ``|`` skip.
"""

from __future__ import annotations

import math

from megatron.core import device
from megatron.core.log import log_rank_last

PER_LAYER_PREFIX = "moe/"
"""Losses under this prefix (``--moe-per-layer-logging``'s ``moe/<name>_layer_<i>``, Megatron's
tags) go to TensorBoard only, as Megatron-Core's MoE tracker writes them: not in the log line,
no "vs samples" twin."""


def make_tensorboard_writer(cfg):
    """A SummaryWriter on the last rank (which holds the loss), else None."""
    import torch.distributed as dist

    if cfg.logging.tensorboard_dir is None:
        return None
    if dist.is_initialized() and dist.get_rank() != dist.get_world_size() - 1:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=cfg.logging.tensorboard_dir,
                         max_queue=cfg.logging.tensorboard_queue_size)


def training_log_string(*, iteration: int, train_iters: int, consumed_samples: int,
                        elapsed_ms: float, learning_rate: float, batch_size: int,
                        losses: dict[str, float], loss_scale: float, grad_norm: float | None,
                        num_zeros: float | None, params_norm: float | None,
                        skipped: int, nan: int, tokens_per_sec: float,
                        tflops: float | None) -> str:
    """One training log line: Megatron-LM's cells in Megatron-LM's order, then ours.

    Megatron's cells come first and in its order (iteration, consumed samples, elapsed time,
    learning rate, global batch size, losses, loss scale, grad norm, num zeros, params norm,
    skipped and nan iterations) so that parsers matching the line with one regex keep working;
    tokens per second and model TFLOP/s per GPU follow as extra cells.
    """
    s = f" iteration {iteration:8d}/{train_iters:8d} |"
    s += f" consumed samples: {consumed_samples:12d} |"
    s += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    s += f" learning rate: {learning_rate:.3E} |"
    s += f" global batch size: {batch_size:5d} |"
    for key, value in losses.items():
        if key.startswith(PER_LAYER_PREFIX):
            continue
        # Megatron prints losses > 0 only (a loss never logged stays 0), which hid a NaN loss:
        # a NaN/inf one is shown ("lm loss: NAN").
        if value > 0.0 or not math.isfinite(value):
            s += f" {key}: {value:.6E} |"
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        s += f" num zeros: {num_zeros:.1f} |"
    if params_norm is not None:
        s += f" params norm: {params_norm:.3f} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {nan:3d} |"
    s += f" tokens per second: {tokens_per_sec:.1f} |"
    if tflops is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    return s


def validation_log_string(prefix: str, losses: dict[str, float]) -> str:
    """Megatron-LM's validation line: ``{key} value: {:.6E} | {key} PPL: {:.6E} |`` per loss
    (the perplexity is ``exp(min(20, loss))``, as Megatron caps it)."""
    s = f" validation loss at {prefix} | "
    for key, value in losses.items():
        s += f"{key} value: {value:.6E} | {key} PPL: {_ppl(value):.6E} | "
    return s


def _ppl(loss: float) -> float:
    return math.exp(min(20.0, loss))


def log_validation(prefix: str, losses: dict[str, float], writer, iteration: int,
                   consumed_samples: int, log_ppl: bool) -> None:
    """Megatron's boxed validation line with loss and perplexity; TensorBoard scalars."""
    s = validation_log_string(prefix, losses)
    for key, value in losses.items() if writer is not None else ():
        writer.add_scalar(f"{key} validation", value, iteration)
        writer.add_scalar(f"{key} validation vs samples", value, consumed_samples)
        if log_ppl:
            writer.add_scalar(f"{key} validation ppl", _ppl(value), iteration)
            writer.add_scalar(f"{key} validation ppl vs samples", _ppl(value), consumed_samples)
    bar = "-" * (len(s) + 1)
    log_rank_last(bar)
    log_rank_last(s)
    log_rank_last(bar)


def write_training_scalars(writer, cfg, *, iteration: int, consumed_samples: int,
                           learning_rate: float, batch_size: int, losses: dict[str, float],
                           loss_scale: float, grad_norm: float | None, num_zeros: float | None,
                           params_norm: float | None, tokens_per_sec: float | None,
                           tflops: float | None, world_size: int) -> None:
    """TensorBoard scalars with Megatron-LM's tag names."""
    lg = cfg.logging
    if lg.log_learning_rate_to_tensorboard:
        writer.add_scalar("learning-rate", learning_rate, iteration)
        writer.add_scalar("learning-rate vs samples", learning_rate, consumed_samples)
    if lg.log_batch_size_to_tensorboard:
        writer.add_scalar("batch-size", batch_size, iteration)
        writer.add_scalar("batch-size vs samples", batch_size, consumed_samples)
    for key, value in losses.items():
        writer.add_scalar(key, value, iteration)
        if not key.startswith(PER_LAYER_PREFIX):
            writer.add_scalar(f"{key} vs samples", value, consumed_samples)
    if lg.log_loss_scale_to_tensorboard:
        writer.add_scalar("loss-scale", loss_scale, iteration)
        writer.add_scalar("loss-scale vs samples", loss_scale, consumed_samples)
    if lg.log_world_size_to_tensorboard:
        writer.add_scalar("world-size", world_size, iteration)
    for tag, value in (("grad-norm", grad_norm), ("num-zeros", num_zeros),
                       ("params-norm", params_norm), ("tokens-per-second", tokens_per_sec),
                       ("throughput", tflops)):
        if value is not None:
            writer.add_scalar(tag, value, iteration)
            writer.add_scalar(f"{tag} vs samples", value, consumed_samples)
    if lg.log_memory_to_tensorboard:
        for tag, value in _memory_scalars().items():
            writer.add_scalar(tag, value, iteration)


def _memory_scalars() -> dict[str, float]:
    stats = device.memory_stats()
    if stats:
        return stats
    # On the CPU, report this process's resident set size.
    try:
        import resource

        return {"mem-max-rss-MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    except ImportError:  # pragma: no cover - non-POSIX
        return {}
