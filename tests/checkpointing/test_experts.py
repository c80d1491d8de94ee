"""Pure functions of expert-parallel legacy checkpoints: the EP shards of one TP/PP position
merge into one dict with the experts numbered globally in module order, and split back bitwise;
``mp_rank_00_001`` is read as an EP or a PP rank as the checkpoint's args say."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing import CheckpointError, expert_shard_files
from megatron.checkpointing.experts import (expert_of, merge_expert_parallel,
                                            split_expert_parallel)

LAYER = "language_model.encoder.layers.{}.mlp."


def _whole(experts: int = 4) -> dict[str, torch.Tensor]:
    out, value = {}, 0.0
    for layer in range(2):
        out[f"language_model.encoder.layers.{layer}.input_norm.weight"] = torch.tensor([value])
        out[LAYER.format(layer) + "router.weight"] = torch.tensor([value + 0.5])
        for e in range(experts):
            for name in ("dense_h_to_4h.weight", "dense_4h_to_h.weight"):
                value += 1
                out[LAYER.format(layer) + f"local_experts.{e}.{name}"] = torch.tensor([value])
        out[LAYER.format(layer) + "shared_experts.gate_weight"] = torch.tensor([value + 0.25])
    return out


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_split_then_merge_is_the_identity_in_module_order(ep):
    whole = _whole()
    parts = [split_expert_parallel(whole, ep, rank, 4) for rank in range(ep)]
    for part in parts:
        assert {expert_of(k) for k in part} - {None} == set(range(4 // ep))
    merged = merge_expert_parallel(parts)
    assert list(merged) == list(whole)
    assert all(torch.equal(merged[k], whole[k]) for k in whole)


def test_the_local_experts_of_rank_one():
    part = split_expert_parallel(_whole(), 2, 1, 4)
    assert torch.equal(part[LAYER.format(0) + "local_experts.0.dense_4h_to_h.weight"],
                       _whole()[LAYER.format(0) + "local_experts.2.dense_4h_to_h.weight"])


def test_mixed_up_shards_are_refused():
    whole = _whole()
    parts = [split_expert_parallel(whole, 2, rank, 4) for rank in range(2)]
    del parts[1][LAYER.format(0) + "router.weight"]
    with pytest.raises(CheckpointError, match="different dense"):
        merge_expert_parallel(parts, "ckpt")


def _touch(root, name):
    (root / name).mkdir()
    (root / name / "model_optim_rng.pt").write_bytes(b"")


def test_the_third_name_part_is_read_from_the_args(tmp_path):
    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        _touch(tmp_path, name)
    assert set(expert_shard_files(tmp_path, False, True)) == {(0, 0, 0), (0, 0, 1)}
    assert set(expert_shard_files(tmp_path, True, False)) == {(0, 0, 0), (0, 1, 0)}
    _touch(tmp_path, "mp_rank_00_001_001")
    with pytest.raises(CheckpointError, match="mp_rank_00_001_001"):
        expert_shard_files(tmp_path, False, True)
