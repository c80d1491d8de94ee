"""Model flag combinations refused or warned about in validate(), before any process group,
naming the flag as the user typed it."""

from __future__ import annotations

import warnings

import pytest

from megatron.config import parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 64 --micro-batch-size 2").split()


def _parse(extra: str):
    return parse_args(BASE + extra.split(), world_size=1)


def _refused(capsys, extra: str) -> str:
    with pytest.raises(SystemExit) as exc:
        _parse(extra)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("extra, rotated", [
    ("--position-embedding-type rope --kv-channels 15", 15),
    ("--position-embedding-type rope --kv-channels 50 --rotary-percent 0.5", 25),
    ("--use-rotary-position-embeddings --kv-channels 50 --rotary-percent 0.5", 25)])
def test_an_odd_rotary_dimension_is_refused_naming_the_flags(capsys, extra, rotated):
    err = _refused(capsys, extra)
    assert f"= {rotated} dimensions per head, an odd number" in err, err
    assert "--kv-channels" in err and "--rotary-percent" in err


def test_an_even_rotary_dimension_passes():
    assert _parse("--position-embedding-type rope --kv-channels 50 --rotary-percent 0.52")


def test_rotary_flag_against_an_explicit_learned_table_is_refused(capsys):
    err = _refused(capsys, "--use-rotary-position-embeddings --position-embedding-type "
                           "learned_absolute")
    assert "--use-rotary-position-embeddings and --position-embedding-type learned_absolute " \
           "contradict" in err, err
    assert _parse("--use-rotary-position-embeddings").model.position_embedding_type == "rope"


@pytest.mark.parametrize("extra, said", [
    ("--rotary-interleaved", "--rotary-interleaved is ignored without --position-embedding-type"),
    ("--rotary-percent 0.5", "--rotary-percent is ignored without --position-embedding-type"),
    ("--swiglu --openai-gelu", "--openai-gelu is ignored with --swiglu"),
    ("--num-query-groups 2", "--num-query-groups is ignored without --group-query-attention")])
def test_flags_the_model_ignores_are_warned_about(extra, said):
    with pytest.warns(UserWarning, match=said):
        _parse(extra)


def test_no_warning_where_the_flags_are_read():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _parse("--position-embedding-type rope --rotary-percent 0.5 --rotary-interleaved "
               "--group-query-attention --num-query-groups 2 --swiglu")


@pytest.mark.parametrize("typed", ["--norm-epsilon", "--layernorm-epsilon"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_bad_norm_epsilon_names_the_flag_typed(capsys, typed, value):
    err = _refused(capsys, f"{typed} {value}")
    assert f"{typed} ({float(value)})" in err, err
    other = {"--norm-epsilon": "--layernorm-epsilon", "--layernorm-epsilon": "--norm-epsilon"}
    assert other[typed] not in err
