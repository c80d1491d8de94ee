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


# The torch format's files on the expert grid, against the two grids' rank orders -------------
_GRIDS = [(tp, etp, ep, cp, dp_cp, pp)
          for tp, etp, ep in [(1, 1, 2), (2, 2, 2), (2, 1, 2), (4, 2, 2), (4, 1, 4), (2, 1, 3),
                              (4, 2, 3), (3, 2, 2), (1, 2, 2), (2, 1, 1), (2, 4, 1)]
          for cp, dp_cp in [(1, 1), (1, 2), (2, 2)] for pp in (1, 2)]


def _world(tp, etp, ep, cp, dp_cp, pp) -> int:
    """A world both grids tile, ``dp_cp`` times the smallest."""
    import math
    return math.lcm(tp * cp * pp, etp * ep * pp) * dp_cp


@pytest.mark.parametrize("tp,etp,ep,cp,dp_cp,pp", _GRIDS)
def test_writer_files_follow_the_dense_and_expert_grids(tp, etp, ep, cp, dp_cp, pp):
    """The writers (expert-data-parallel rank 0) of in-stage rank r name their files by the
    dense grid's TP rank r % TP and the expert grid's EP rank r // ETP and hold its ETP slice
    r % ETP; where the torch format holds the layout, each rank finds its experts' slice in
    the file :func:`expert_file_ranks` names, and every TP rank's dense slice in the file of its
    data-parallel rank 0 (:func:`dense_expert_rank`), and the names are unique."""
    from megatron.checkpointing.experts import (dense_expert_rank, expert_file_ranks,
                                                torch_format_layout_error)
    from megatron.core.expert_layout import expert_rank_layout
    from megatron.core.parallel_state import rank_layout

    world = _world(tp, etp, ep, cp, dp_cp, pp)
    dense = rank_layout(world, tp, pp, context_parallel_size=cp)
    expert = expert_rank_layout(world, etp, ep, pp)

    def index(groups, rank):
        return next(g.index(rank) for g in groups if rank in g)

    stage = world // pp
    files = {}  # (pp rank, TP rank in the name, EP rank) -> (dense TP slice, ETP slice, EP)
    for rank in range(world):
        if index(expert.expert_data, rank) != 0:
            continue
        r = rank % stage
        t, e, et = (index(dense.tensor, rank), index(expert.expert_model, rank),
                    index(expert.expert_tensor, rank))
        assert r < etp * ep and (t, e, et) == (r % tp, r // etp, r % etp)
        files.setdefault((rank // stage, t, e), []).append((t, et, e))
    why = torch_format_layout_error(tp, etp, ep)
    unique = all(len(v) == 1 for v in files.values())
    every_tp = {t for _, t, _ in files} == set(range(tp))
    assert (why is None) == (unique and every_tp), (why, files)
    if why is not None:
        return
    for rank in range(world):
        p = rank // stage
        t, e, et = (index(dense.tensor, rank), index(expert.expert_model, rank),
                    index(expert.expert_tensor, rank))
        name_tp, name_ep = expert_file_ranks(tp, et, etp, e)
        assert files[(p, name_tp, name_ep)] == [(name_tp, et, e)]
        if index(dense.data, rank) == 0 and (cp == 1 or index(dense.context, rank) == 0):
            assert (p, t, dense_expert_rank(t, tp, etp)) in files
        assert files[(p, t, dense_expert_rank(t, tp, etp))][0][0] == t
