"""--use-checkpoint-args restores the activation: a GPT or BERT trained with the
exact erf GeLU (--no-bias-gelu-fusion), loaded with --use-checkpoint-args alone, gives the
logits of the run that saved it (not the tanh form of the default flags); loaded with flags
that compute the other form, it loads with a warning naming both.

One process, no process group: the model is built, perturbed (a trained model's stand-in, with
values large enough for the two GeLU forms to differ) and saved by ``save_checkpoint``, then
built again from the checkpoint's args and loaded by ``load_checkpoint``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import pretrain_bert
import pretrain_gpt
from megatron.config.cli import build_parser, parse_flags
from megatron.config.validate import validate
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.initialize import apply_checkpoint_args

ARCHITECTURE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
                "--seq-length", "8", "--max-position-embeddings", "8",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "60",
                "--make-vocab-size-divisible-by", "16"]
RUN = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization"]
FAMILIES = {"GPT": pretrain_gpt.model_provider, "BERT": pretrain_bert.model_provider}


def _config(argv: list[str]):
    flags = parse_flags(build_parser(), argv)
    if flags.checkpoint.use_checkpoint_args:
        apply_checkpoint_args(flags)
    return validate(flags, world_size=1)


def _logits(model: torch.nn.Module, family: str) -> torch.Tensor:
    tokens = torch.arange(16).remainder(60).view(2, 8)
    with torch.no_grad():
        if family == "GPT":
            return model(tokens, torch.arange(8).expand(2, 8))
        return model(tokens, torch.ones_like(tokens), torch.zeros_like(tokens))[0]


def _saved_erf_model(root: Path, family: str) -> torch.Tensor:
    """Save an erf-GeLU model under ``root``; returns its logits."""
    cfg = _config([*ARCHITECTURE, *RUN, "--no-bias-gelu-fusion", "--save", str(root),
                   "--save-interval", "1"])
    torch.manual_seed(5)
    model = FAMILIES[family](cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    save_checkpoint(4, [model], None, None, cfg, consumed_train_samples=4,
                    consumed_valid_samples=0)
    return _logits(model, family)


def _loaded(root: Path, family: str, *flags: str) -> torch.Tensor:
    cfg = _config([*flags, *RUN, "--load", str(root), "--finetune"])
    torch.manual_seed(9)
    model = FAMILIES[family](cfg).eval()
    load_checkpoint([model], None, None, cfg)
    return _logits(model, family)



@pytest.mark.parametrize("family", ["GPT", "BERT"])
def test_erf_gelu_round_trips_through_use_checkpoint_args(tmp_path, family, megatron_log):
    trained = _saved_erf_model(tmp_path / "ckpt", family)
    restored = _loaded(tmp_path / "ckpt", family, "--use-checkpoint-args")
    assert torch.equal(restored, trained)
    assert not [r for r in megatron_log
                if r.levelno >= logging.WARNING and "GeLU" in r.getMessage()]
    # The default flags compute the tanh form: other logits, and a warning saying why.
    tanh = _loaded(tmp_path / "ckpt", family, *ARCHITECTURE)
    assert (tanh - trained).abs().max() > 1e-5
    said = [r.getMessage() for r in megatron_log
            if r.levelno >= logging.WARNING and "GeLU" in r.getMessage()]
    assert len(said) == 1 and "trained with the exact erf GeLU (--no-bias-gelu-fusion)" in \
        said[0], said
