"""Logging, timing and TensorBoard flags."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron.config.base import spec


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """What the log line and TensorBoard show, and how often."""

    log_interval: int = 100
    """Print a training log line every this many iterations."""
    log_params_norm: bool = False
    """Log the L2 norm of the parameters."""
    log_num_zeros_in_grad: bool = False
    """Log the number of zero gradient entries."""
    log_throughput: bool = False
    """Log model TFLOP/s per GPU on the log line. Accepted; here TFLOP/s and tokens/s are always
    logged."""
    timing_log_level: Literal[0, 1, 2] = 0
    """Timers to log: 0 the iteration only, 1 coarse, 2 fine-grained."""
    barrier_with_L1_time: bool = spec(True, flag="--no-barrier-with-level-1-timing")
    """Do not put a barrier before level-1 timers."""
    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    """Across ranks, log the max, the min and max, or every rank's timer value."""
    tensorboard_dir: str | None = None
    """Write TensorBoard event files here."""
    tensorboard_log_interval: int = 1
    """Write TensorBoard scalars every this many iterations."""
    tensorboard_queue_size: int = 1000
    """Events queued before TensorBoard flushes to disk."""
    log_timers_to_tensorboard: bool = False
    """Write the timers to TensorBoard."""
    log_batch_size_to_tensorboard: bool = False
    """Write the batch size to TensorBoard."""
    log_learning_rate_to_tensorboard: bool = spec(
        True, flag="--no-log-learnig-rate-to-tensorboard")
    """Do not write the learning rate to TensorBoard (Megatron-LM's spelling, typo included)."""
    log_loss_scale_to_tensorboard: bool = spec(True, flag="--no-log-loss-scale-to-tensorboard")
    """Do not write the loss scale to TensorBoard."""
    log_validation_ppl_to_tensorboard: bool = False
    """Write the validation perplexity to TensorBoard."""
    log_memory_to_tensorboard: bool = False
    """Write memory use to TensorBoard."""
    log_world_size_to_tensorboard: bool = False
    """Write the world size to TensorBoard."""
