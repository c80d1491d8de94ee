"""QKV row orders of old checkpoint versions: the conversions take plain
integers (heads, splits), no config; every row lands where docs/FORMATS.md 2d says."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing import (CheckpointError, checkpoint_version,
                                    fix_query_key_value_ordering, qkv_from_current_order,
                                    qkv_to_current_order)

HEADS, HEAD_DIM = 4, 3


def _labelled(order: str, splits: int, cols: int = 0) -> torch.Tensor:
    """Rows labelled ``split * 100 + head * 10 + d``, laid out in ``order`` ("shd" = [splits,
    np, hn], "hds" = [np, hn, splits], "hsd" = [np, splits, hn]); ``cols`` > 0 adds columns."""
    ranges = {"s": range(splits), "h": range(HEADS), "d": range(HEAD_DIM)}
    rows = []
    for a in ranges[order[0]]:
        for b in ranges[order[1]]:
            for c in ranges[order[2]]:
                index = dict(zip(order, (a, b, c)))
                rows.append(index["s"] * 100 + index["h"] * 10 + index["d"])
    t = torch.tensor(rows, dtype=torch.float64)
    return t if cols == 0 else t[:, None] + torch.arange(cols) / 1000


@pytest.mark.parametrize("splits", [3, 2])
@pytest.mark.parametrize("version, order", [(0.0, "shd"), (1.0, "hds")])
@pytest.mark.parametrize("cols", [0, 5])
def test_old_orders_convert_to_per_head_q_k_v(splits, version, order, cols):
    old, current = _labelled(order, splits, cols), _labelled("hsd", splits, cols)
    converted = qkv_to_current_order(old, splits, HEADS, version)
    assert torch.equal(converted, current)
    assert torch.equal(qkv_from_current_order(current, splits, HEADS, version), old)


def test_current_versions_are_unchanged():
    current = _labelled("hsd", 3, 2)
    for version in (2.0, 3.0):
        assert torch.equal(qkv_to_current_order(current, 3, HEADS, version), current)
        assert torch.equal(qkv_from_current_order(current, 3, HEADS, version), current)


def test_bad_versions_and_shapes_are_refused():
    with pytest.raises(CheckpointError, match="checkpoint_version 1.5"):
        qkv_to_current_order(_labelled("hsd", 3), 3, HEADS, 1.5)
    with pytest.raises(ValueError, match="36 QKV rows are not a multiple of 3 x 5 heads"):
        qkv_to_current_order(_labelled("hsd", 3), 3, 5, 0.0)


def test_fix_ordering_walks_every_model_chunk_with_per_shard_heads():
    """Two TP shards of an 8-head model: each holds 4 heads; ``model0``/``model1`` (virtual
    pipeline chunks) are both converted, other tensors are left alone."""
    def chunk():
        return {"language_model": {"encoder": {
            "layers.0.self_attention.query_key_value.weight": _labelled("shd", 3, 2),
            "layers.0.self_attention.query_key_value.bias": _labelled("shd", 3),
            "layers.0.self_attention.dense.weight": _labelled("shd", 3, 2)},
            "decoder": {"layers.0.inter_attention.key_value.weight": _labelled("shd", 2, 2)}}}

    sd = {"model0": chunk(), "model1": chunk(), "checkpoint_version": 0}
    assert checkpoint_version(sd) == 0.0 and checkpoint_version({}) is None
    assert fix_query_key_value_ordering(sd, 0.0, num_attention_heads=8,
                                        tensor_model_parallel_size=2) == 6
    for key in ("model0", "model1"):
        encoder = sd[key]["language_model"]["encoder"]
        assert torch.equal(encoder["layers.0.self_attention.query_key_value.weight"],
                           _labelled("hsd", 3, 2))
        assert torch.equal(encoder["layers.0.self_attention.query_key_value.bias"],
                           _labelled("hsd", 3))
        assert torch.equal(encoder["layers.0.self_attention.dense.weight"], _labelled("shd", 3, 2))
        assert torch.equal(sd[key]["language_model"]["decoder"][
            "layers.0.inter_attention.key_value.weight"], _labelled("hsd", 2, 2))
    assert fix_query_key_value_ordering(sd, 3.0, 8, 2) == 0


def test_fix_ordering_names_the_tensor_and_the_file():
    sd = {"model": {"language_model": {"encoder": {
        "layers.0.self_attention.query_key_value.weight": torch.zeros(36, 2)}}}}
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attention\.query_key_value\.weight "
                                              r"in shard\.pt has 36 rows, not a multiple of 3 x 8"):
        fix_query_key_value_ordering(sd, 1.0, 16, 2, source="shard.pt")
    with pytest.raises(CheckpointError, match="shard.pt has checkpoint_version 1.5"):
        fix_query_key_value_ordering(sd, 1.5, 4, 1, source="shard.pt")
