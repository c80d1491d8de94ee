"""``--sequence-parallel``: live with TP > 1, into the model's TransformerConfig;
at TP = 1 switched off with a warning, as Megatron-LM (23.06 and core_v0.13) does; a sequence
that does not split over the TP ranks is refused before any process group starts."""

from __future__ import annotations

import pytest

from megatron.config import parse_args
from megatron.config.core_configs import transformer_config

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 64 --micro-batch-size 2 --sequence-parallel").split()


def test_live_with_tensor_parallelism():
    cfg = parse_args(BASE + ["--tensor-model-parallel-size", "2"], world_size=2)
    assert cfg.parallel.sequence_parallel
    assert transformer_config(cfg).sequence_parallel


def test_disabled_with_a_warning_at_tp1():
    with pytest.warns(UserWarning, match="--sequence-parallel is disabled"):
        cfg = parse_args(BASE, world_size=1)
    assert not cfg.parallel.sequence_parallel
    assert not transformer_config(cfg).sequence_parallel


def test_sequence_must_split_over_tp_ranks(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--tensor-model-parallel-size", "4", "--seq-length", "30"],
                   world_size=4)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--seq-length (30)" in err and "--tensor-model-parallel-size (4)" in err
