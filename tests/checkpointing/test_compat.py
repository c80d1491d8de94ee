"""megatron.checkpointing.compat: what a checkpoint's saved args must share with the run loading
it, compared as the model built from each uses them."""

from __future__ import annotations

import argparse
import types

import pytest

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.compat import check_compatible

ROPE = dict(position_embedding_type="rope", add_position_embedding=False, rotary_base=10000,
            rotary_percent=1.0, rotary_interleaved=False, layernorm_epsilon=1e-5,
            apply_residual_connection_post_layernorm=False)


def _run(**fields) -> types.SimpleNamespace:
    """What check_compatible reads of a run: its flat args."""
    ours = argparse.Namespace(**{**ROPE, **fields})
    return types.SimpleNamespace(to_namespace=lambda: ours)


def _check(tmp_path, saved: dict, **ours) -> None:
    check_compatible(argparse.Namespace(**saved), _run(**ours), tmp_path / "model_optim_rng.pt")


def test_a_rope_checkpoint_keeping_megatrons_add_position_embedding_loads(tmp_path):
    """Megatron-LM leaves add_position_embedding=True in a RoPE model's args and builds no
    learned table: nothing differs."""
    _check(tmp_path, {**ROPE, "add_position_embedding": True, "norm_epsilon": 1e-5,
                      "layernorm_epsilon": None})


def test_a_learned_table_against_none_is_refused(tmp_path):
    saved = {**ROPE, "position_embedding_type": "learned_absolute", "add_position_embedding": True}
    with pytest.raises(CheckpointError, match="--add-position-embedding: checkpoint True, flags "
                                              "False"):
        _check(tmp_path, saved, position_embedding_type="learned_absolute")


@pytest.mark.parametrize("name, theirs, mine, flag", [
    ("rotary_base", 500000, 10000, "--rotary-base"),
    ("apply_residual_connection_post_layernorm", True, False,
     "--apply-residual-connection-post-layernorm")])
def test_rotary_base_and_residual_post_layernorm_are_compared(tmp_path, name, theirs, mine,
                                                              flag):
    with pytest.raises(CheckpointError, match=f"{flag}: checkpoint {theirs}, flags {mine}"):
        _check(tmp_path, {**ROPE, name: theirs}, **{name: mine})


def test_rotary_base_is_not_compared_without_rope(tmp_path):
    learned = dict(position_embedding_type="learned_absolute", add_position_embedding=True)
    _check(tmp_path, {**ROPE, **learned, "rotary_base": 500000}, **learned)


def test_another_norm_epsilon_warns(tmp_path, megatron_log):
    _check(tmp_path, {**ROPE, "layernorm_epsilon": None, "norm_epsilon": 1e-6})
    said = [r.getMessage() for r in megatron_log if "--norm-epsilon 1e-06" in r.getMessage()]
    assert len(said) == 1 and "this run uses 1e-05" in said[0], said
    megatron_log.clear()
    _check(tmp_path, dict(ROPE))
    assert not [r for r in megatron_log if "norm-epsilon" in r.getMessage()]
