"""This rank's model for inference (evaluation, zero-shot tasks): built without the optimizer,
gradient buffers or data-parallel wrapper that training needs, weights read from ``--load``.

    check_checkpoint_to_load(flags.checkpoint.load, flags.checkpoint.ckpt_step, random_weights)
    cfg = initialize_from_config(weights_only(flags), parser)
    check_checkpoint_vocabulary(cfg)
    model = load_model_for_inference(cfg, model_provider)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from megatron.config.cli import replace_flags
from megatron.core import device, parallel_state
from megatron.core.log import log_rank_0
from megatron.training.checkpointing import (get_checkpoint_tracker_filename, load_checkpoint,
                                             read_checkpoint_args)

WEIGHTS_ONLY = {"no_load_optim": True, "no_load_rng": True, "exit_on_missing_checkpoint": True}
"""What an inference script sets in its checkpoint flags (``--no-load-optim --no-load-rng
--exit-on-missing-checkpoint``): weights only, and never random weights because the checkpoint
vanished between the check and the load."""


def weights_only(flags, **checkpoint):
    """The parsed ``flags`` of an inference script with :data:`WEIGHTS_ONLY` set (unless it asked
    for ``--random-weights``) and any other ``checkpoint`` fields given (e.g. ``load``)."""
    changes = {} if flags.checkpoint.random_weights else dict(WEIGHTS_ONLY)
    return replace_flags(flags, checkpoint={**changes, **checkpoint})


def check_checkpoint_to_load(load: str | None, ckpt_step: int | None, random_weights: bool,
                             flag: str = "--load", purpose: str = "evaluate") -> None:
    """Before any process group: a checkpoint will be loaded (or random weights were asked for).

    Raises:
        ValueError: naming ``flag``, the path, and what to change.
    """
    if random_weights:
        if load is not None:
            raise ValueError(f"--random-weights and {flag} {load} are mutually exclusive: drop "
                             f"--random-weights to {purpose} the checkpoint")
        return
    if load is None:
        raise ValueError(f"{flag} is required: the checkpoint directory to {purpose} "
                         "(--random-weights uses untrained weights instead)")
    if not os.path.isdir(load):
        raise ValueError(f"{flag} {load}: no such directory")
    tracker = get_checkpoint_tracker_filename(load)
    if ckpt_step is None and not tracker.is_file():
        # load_checkpoint would warn and go on from random weights: output that looks real.
        raise ValueError(f"{flag} {load} holds no checkpoint ({tracker.name} not found): give "
                         "the directory a training run saved to with --save, or "
                         "--random-weights to use untrained weights")


def check_checkpoint_vocabulary(cfg) -> None:
    """The tokenizer's padded vocabulary is the one the checkpoint was trained with.

    Raises:
        ValueError: naming the checkpoint, both sizes and the tokenizer flags to fix.
    """
    load = cfg.checkpoint.load
    if load is None or cfg.padded_vocab_size is None:
        return
    saved = read_checkpoint_args(load, cfg.checkpoint.ckpt_step)
    theirs = getattr(saved, "padded_vocab_size", None) if saved is not None else None
    if theirs is None or theirs == cfg.padded_vocab_size:
        return
    tok = cfg.tokenizer
    given = ", ".join(f"{name} {value}" for name, value in (
        ("--tokenizer-type", tok.tokenizer_type), ("--vocab-file", tok.vocab_file),
        ("--merge-file", tok.merge_file), ("--tokenizer-model", tok.tokenizer_model),
        ("--vocab-size", tok.vocab_size)) if value is not None)
    raise ValueError(
        f"--load {load}: the checkpoint's vocabulary ({theirs} entries, padded; tokenizer "
        f"{getattr(saved, 'tokenizer_type', '?')}, vocab file "
        f"{getattr(saved, 'vocab_file', None)}) differs from this tokenizer's "
        f"({cfg.padded_vocab_size} padded; {given}): pass the tokenizer files the checkpoint "
        "was trained with")


def load_model_for_inference(cfg, model_provider: Callable) -> torch.nn.Module:
    """This rank's stage from ``model_provider(cfg, pre_process=, post_process=)`` on the
    compute device, weights from ``--load`` (unless ``--random-weights``), in eval mode."""
    model = model_provider(cfg, pre_process=parallel_state.is_pipeline_first_stage(),
                           post_process=parallel_state.is_pipeline_last_stage())
    model.to(device.get_device())
    if not cfg.checkpoint.random_weights:
        load_checkpoint([model], None, None, cfg)
    else:
        log_rank_0(" > --random-weights: evaluating untrained weights")
    model.eval()
    return model
