"""--use-checkpoint-args restores the norm epsilon under either name: ``layernorm_epsilon``
(Megatron-LM 23.06, ours) or ``norm_epsilon`` (core_v0.13, which saves no other)."""

from __future__ import annotations

import argparse

import pytest

from megatron.checkpointing import checkpoint_name, save_file
from megatron.config.cli import build_parser, parse_flags
from megatron.training.initialize import apply_checkpoint_args


@pytest.mark.parametrize("name", ["norm_epsilon", "layernorm_epsilon"])
def test_the_saved_norm_epsilon_is_restored(tmp_path, name):
    args = argparse.Namespace(num_layers=1, hidden_size=16, num_attention_heads=2,
                              max_position_embeddings=8, seq_length=8, **{name: 1e-6})
    save_file({"args": args, "iteration": 1, "model": {}},
              checkpoint_name(tmp_path, 1, tensor_rank=0, pipeline_rank=0))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    flags = parse_flags(build_parser(), ["--load", str(tmp_path), "--use-checkpoint-args"])
    apply_checkpoint_args(flags)
    assert flags.model.layernorm_epsilon == 1e-6
