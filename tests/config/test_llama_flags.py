"""Llama-style model flags: parsed into the model's TransformerConfig, Megatron-LM
core_v0.13's derived values, and every invalid combination refused before any process group
starts, naming the flags."""

from __future__ import annotations

import pytest

from megatron.config import parse_args
from megatron.config.core_configs import transformer_config

BASE = ("--num-layers 2 --hidden-size 96 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 64 --micro-batch-size 2").split()


def _parse(extra: str, world_size: int = 1):
    return parse_args(BASE + extra.split(), world_size=world_size)


def _refused(capsys, extra: str, world_size: int = 1) -> str:
    with pytest.raises(SystemExit) as exc:
        _parse(extra, world_size)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_llama_flags_reach_the_transformer_config():
    cfg = _parse("--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --ffn-hidden-size 256 "
                 "--position-embedding-type rope --rotary-percent 0.5 --rotary-base 500000 "
                 "--rotary-interleaved --group-query-attention --num-query-groups 4 "
                 "--tensor-model-parallel-size 2 --disable-bias-linear --add-qkv-bias "
                 "--qk-layernorm", world_size=2)
    tc = transformer_config(cfg)
    assert (tc.normalization, tc.layernorm_epsilon) == ("RMSNorm", 1e-6)
    assert tc.swiglu and tc.ffn_hidden_size == 256
    assert (tc.position_embedding_type, tc.rotary_percent, tc.rotary_base,
            tc.rotary_interleaved) == ("rope", 0.5, 500000, True)
    assert not tc.add_position_embedding  # no learned table with RoPE
    assert tc.num_query_groups == 4 and not tc.add_bias_linear and tc.add_qkv_bias
    assert tc.qk_layernorm and not transformer_config(_parse("")).qk_layernorm


def test_older_spellings():
    cfg = _parse("--use-rotary-position-embeddings --layernorm-epsilon 1e-6")
    tc = transformer_config(cfg)
    assert tc.position_embedding_type == "rope" and not tc.add_position_embedding
    assert tc.layernorm_epsilon == 1e-6


def test_defaults_are_megatrons():
    tc = transformer_config(_parse(""))
    assert tc.normalization == "LayerNorm" and tc.position_embedding_type == "learned_absolute"
    assert tc.add_position_embedding and tc.num_query_groups == 8  # MHA without GQA
    # --num-query-groups alone is ignored, as Megatron-LM ignores it (with a warning here).
    with pytest.warns(UserWarning, match="--num-query-groups is ignored"):
        assert transformer_config(_parse("--num-query-groups 2")).num_query_groups == 8


def test_swiglu_default_ffn_size():
    # Megatron-LM: int((4 h * 2 / 3) / 64) * 64 = int(256 / 64) * 64 for h = 96.
    assert transformer_config(_parse("--swiglu")).ffn_hidden_size == 256


def test_gqa_groups_must_split_over_tp(capsys):
    err = _refused(capsys, "--group-query-attention --num-query-groups 1 "
                           "--tensor-model-parallel-size 2", world_size=2)
    assert "--num-query-groups (1)" in err and "--tensor-model-parallel-size (2)" in err


def test_gqa_groups_must_divide_heads(capsys):
    err = _refused(capsys, "--group-query-attention --num-query-groups 3")
    assert "--num-attention-heads (8)" in err and "--num-query-groups (3)" in err


@pytest.mark.parametrize("value", ["0", "1.5", "-0.5"])
def test_rotary_percent_range(capsys, value):
    err = _refused(capsys, f"--position-embedding-type rope --rotary-percent {value}")
    assert "--rotary-percent" in err and "(0, 1]" in err


def test_swiglu_and_squared_relu_exclusive(capsys):
    err = _refused(capsys, "--swiglu --squared-relu")
    assert "--swiglu" in err and "--squared-relu" in err


def test_swiglu_ffn_not_split_over_tp(capsys):
    err = _refused(capsys, "--swiglu --ffn-hidden-size 100 --tensor-model-parallel-size 8 "
                           "--num-attention-heads 8", world_size=8)
    assert "--ffn-hidden-size (100)" in err and "--tensor-model-parallel-size (8)" in err


def test_swiglu_default_ffn_of_zero(capsys):
    err = _refused(capsys, "--swiglu --hidden-size 16 --num-attention-heads 2")
    assert "--swiglu" in err and "--ffn-hidden-size" in err


def test_rope_and_none_contradict(capsys):
    err = _refused(capsys, "--use-rotary-position-embeddings --position-embedding-type none")
    assert "--use-rotary-position-embeddings" in err and "--position-embedding-type" in err


def test_rotary_needs_a_pair_of_dims(capsys):
    err = _refused(capsys, "--position-embedding-type rope --rotary-percent 0.1")  # 12 * 0.1
    assert "--rotary-percent (0.1)" in err and "--kv-channels (12)" in err


def test_qk_layernorm_full_projection_reaches_the_config_at_tp1_only(capsys):
    tc = transformer_config(_parse("--qk-layernorm --qk-layernorm-full-projection"))
    assert tc.qk_layernorm and tc.qk_layernorm_full_projection
    err = _refused(capsys, "--qk-layernorm-full-projection")
    assert "--qk-layernorm-full-projection without --qk-layernorm" in err
    err = _refused(capsys, "--qk-layernorm --qk-layernorm-full-projection "
                           "--tensor-model-parallel-size 2", world_size=2)
    assert "--qk-layernorm-full-projection with --tensor-model-parallel-size 2" in err
