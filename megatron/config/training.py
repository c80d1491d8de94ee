"""Training length, batch sizes, recomputation, exit conditions and validation flags."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron.config.base import spec


@dataclasses.dataclass(kw_only=True)
class TrainingConfig:
    """Batch arithmetic, how long to train, evaluation cadence and how to stop."""

    micro_batch_size: int | None = None
    """Samples per forward/backward pass on one data-parallel rank."""
    batch_size: int | None = None
    """Deprecated: use --micro-batch-size."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks; defaults to micro batch x DP.
    Larger values accumulate gradients over global / (micro x DP) micro-batches."""
    rampup_batch_size: list[str] | None = spec(None, nargs="*")
    """Batch-size ramp-up: <start batch size> <increment> <ramp-up samples>, e.g. 16 16 5859375."""
    recompute_activations: bool = False
    """Recompute activations (selective: the attention core) instead of storing them."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation: full (whole layers) or selective (attention core only)."""
    distribute_saved_activations: bool = False
    """Split the saved input of recomputed layers over TP ranks."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With full recomputation: uniform (chunks of --recompute-num-layers) or block (the first
    --recompute-num-layers layers of each stage)."""
    recompute_num_layers: int = 1
    """Layers per recomputation chunk (uniform) or recomputed layers per stage (block)."""
    checkpoint_activations: bool = False
    """Deprecated: use --recompute-activations or --recompute-granularity."""
    train_iters: int | None = None
    """Total iterations to train (alternative to --train-samples)."""
    train_samples: int | None = None
    """Total samples to train (alternative to --train-iters)."""
    exit_interval: int | None = None
    """Exit when the iteration number is a multiple of this value."""
    exit_duration_in_mins: int | None = None
    """Exit after this many minutes of training (saving a checkpoint first)."""
    exit_signal_handler: bool = False
    """On SIGTERM: finish the iteration, save a checkpoint and exit."""
    eval_iters: int = 100
    """Iterations per validation / test evaluation."""
    eval_interval: int = 1000
    """Evaluate on the validation set every this many iterations."""
    skip_train: bool = False
    """Skip training: only evaluate (validation and test) the loaded checkpoint."""
    check_for_nan_in_loss_and_grad: bool = True
    """Do not stop training on a NaN/inf loss or gradient (later Megatron-LM's switch; the check
    names the iteration and the rank; with --fp16 overflowing gradients only skip the step, as
    loss scaling expects)."""
