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
    ckpt_format: Literal["torch", "torch_dist"] = "torch"
    """Checkpoint format: torch (Megatron-LM's legacy per-rank model_optim_rng.pt) or
    torch_dist (Megatron-Core's dist_checkpointing on torch.distributed.checkpoint: global
    tensors under Megatron-Core's keys, loadable at any TP/PP/DP layout)."""
    auto_detect_ckpt_format: bool = False
    """Load a checkpoint in whichever format --load holds (torch or torch_dist); saves use
    --ckpt-format."""
    dist_ckpt_strictness: Literal[
        "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
        "return_unexpected", "return_all", "ignore_all"] = "assume_ok_unexpected"
    """torch_dist loads: what to do about tensors the model asks for that the checkpoint lacks
    ("unexpected": an error unless log_*, return_* or ignore_all, which leave them as they are)
    and tensors of the checkpoint the model does not ask for ("missing": an error with
    raise_all, logged with log_all)."""
    ckpt_fully_parallel_save: bool = True
    """torch_dist saves: replicated tensors (data-parallel copies) are written once, spread
    over the ranks holding them; --no-ckpt-fully-parallel-save has the lowest such rank write
    each."""
    ckpt_fully_parallel_load: bool = False
    """Megatron-Core's exchange of loaded shards between data-parallel ranks (not built: every
    rank reads its own chunks)."""
    ckpt_assume_constant_structure: bool = False
    """Megatron-Core's reuse of the save plan across saves (not built)."""
    async_save: bool = False
    """torch_dist saves: copy the state to host memory at the save call and write it in the
    background while training goes on; the tracker file moves only once every rank's write is
    complete."""
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
