"""Checkpoint saving and loading flags."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Where checkpoints go, how often, and what a load restores."""

    save: str | None = None
    """Directory to save checkpoints to."""
    save_interval: int | None = None
    """Save a checkpoint every this many iterations."""
    no_save_optim: bool | None = None
    """Do not save the optimizer state."""
    no_save_rng: bool | None = None
    """Do not save the RNG states."""
    load: str | None = None
    """Directory to load a checkpoint from."""
    no_load_optim: bool | None = None
    """Do not load the optimizer state."""
    no_load_rng: bool | None = None
    """Do not load the RNG states."""
    finetune: bool = False
    """Load the model weights only: iteration, optimizer, scheduler and RNG start afresh."""
    perform_initialization: bool = dataclasses.field(
        default=True, metadata={"flag": "--no-initialization"})
    """Skip weight initialization (the weights come from a checkpoint)."""
    use_checkpoint_args: bool = False
    """Take the model architecture flags from the checkpoint."""
    exit_on_missing_checkpoint: bool = False
    """Exit if --load is given but holds no checkpoint."""
    ckpt_step: int | None = None
    """Load this iteration instead of the latest."""
    ckpt_format: Literal["torch"] = "torch"
    """Checkpoint format: torch (Megatron-LM's legacy per-rank model_optim_rng.pt)."""
    allow_overwrite_checkpoints: bool = False
    """Train from random weights although --save already holds checkpoints (no --load, or a
    --load that holds none): the new run's saves overwrite them and move their tracker back.
    Without it that start is refused, as a mistyped --load would destroy the run's lineage
    (not a Megatron-LM flag)."""
    verify_checkpoint_checksums: bool = True
    """Load checkpoint files without checking them against the sha256s the iteration
    directory's checksums.sha256 records (by default a file that differs from its checksum is
    refused; files written by Megatron-LM have none and have their zip CRC32s checked instead;
    not a Megatron-LM flag)."""
    random_weights: bool = False
    """Evaluate (--skip-train) or generate from untrained, randomly initialized weights on
    purpose; without it, evaluation and generation refuse to start when no checkpoint is loaded
    (not a Megatron-LM flag)."""
    allow_resume_without_checkpoint_args: bool = False
    """Resume training from a checkpoint that holds no args (so no consumed-sample counts):
    the data order restarts from the first sample. Without it that resume is refused;
    --finetune needs no such flag (not a Megatron-LM flag)."""
