"""Rank layout (pure) and real process groups on 8 gloo ranks."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from megatron.core import comm
from megatron.core import parallel_state as ps
from megatron.core.parallel_state import rank_layout
from tests.multiprocess import run_distributed


def test_sixteen_rank_example_matches_megatron():
    layout = rank_layout(16, 2, 4)
    assert layout.data == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.tensor == [[2 * i, 2 * i + 1] for i in range(8)]
    assert layout.pipeline == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.model == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert layout.embedding == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert layout.position_embedding == [[0], [1], [2], [3]]
    assert layout.data_parallel_size == 2


# (world, tp, pp, vpp, split) -> hand-checked groups
HAND_CHECKED = {
    (8, 2, 2, None, None): dict(
        tensor=[[0, 1], [2, 3], [4, 5], [6, 7]],
        data=[[0, 2], [1, 3], [4, 6], [5, 7]],
        pipeline=[[0, 4], [1, 5], [2, 6], [3, 7]],
        model=[[0, 1, 4, 5], [2, 3, 6, 7]],
        embedding=[[0, 4], [1, 5], [2, 6], [3, 7]]),
    (8, 1, 1, None, None): dict(
        tensor=[[r] for r in range(8)], data=[list(range(8))], pipeline=[[r] for r in range(8)],
        model=[[r] for r in range(8)], embedding=[[r] for r in range(8)]),
    (8, 8, 1, None, None): dict(
        tensor=[list(range(8))], data=[[r] for r in range(8)], pipeline=[[r] for r in range(8)],
        model=[list(range(8))], embedding=[[r] for r in range(8)]),
    (8, 1, 8, None, None): dict(
        tensor=[[r] for r in range(8)], data=[[r] for r in range(8)], pipeline=[list(range(8))],
        model=[list(range(8))], embedding=[[0, 7]]),
    (4, 1, 2, None, None): dict(
        tensor=[[0], [1], [2], [3]], data=[[0, 1], [2, 3]], pipeline=[[0, 2], [1, 3]],
        model=[[0, 2], [1, 3]], embedding=[[0, 2], [1, 3]]),
    (8, 2, 4, 2, None): dict(
        tensor=[[0, 1], [2, 3], [4, 5], [6, 7]], data=[[0], [1], [2], [3], [4], [5], [6], [7]],
        pipeline=[[0, 2, 4, 6], [1, 3, 5, 7]], model=[list(range(8))],
        embedding=[[0, 6], [1, 7]]),
    (8, 1, 4, None, 2): dict(
        tensor=[[r] for r in range(8)], data=[[0, 1], [2, 3], [4, 5], [6, 7]],
        pipeline=[[0, 2, 4, 6], [1, 3, 5, 7]], model=[[0, 2, 4, 6], [1, 3, 5, 7]],
        embedding=[[0, 4, 6], [1, 5, 7]], position_embedding=[[0, 4], [1, 5]]),
    (12, 3, 2, None, None): dict(
        tensor=[[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]],
        data=[[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]],
        pipeline=[[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]],
        model=[[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]],
        embedding=[[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]),
    (1, 1, 1, None, None): dict(tensor=[[0]], data=[[0]], pipeline=[[0]], model=[[0]],
                                embedding=[[0]]),
}


@pytest.mark.parametrize("key", list(HAND_CHECKED), ids=str)
def test_layout_hand_checked(key):
    layout = rank_layout(*key)
    for kind, groups in HAND_CHECKED[key].items():
        assert getattr(layout, kind) == groups, kind


@pytest.mark.parametrize("world,tp,pp", [(w, t, p) for w in (1, 2, 4, 6, 8, 12, 16, 24)
                                         for t in (1, 2, 3, 4, 8) for p in (1, 2, 3, 4)
                                         if w % (t * p) == 0])
def test_layout_partitions(world, tp, pp):
    """Every kind of group partitions the world, and the sizes multiply out."""
    layout = rank_layout(world, tp, pp)
    for kind, size in (("tensor", tp), ("pipeline", pp), ("data", world // (tp * pp)),
                       ("model", tp * pp)):
        groups = getattr(layout, kind)
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert all(len(g) == size for g in groups), kind
    # A rank's TP group and DP group intersect only in the rank itself.
    for rank in range(world):
        assert set(layout.group_of("tensor", rank)) & set(layout.group_of("data", rank)) == {rank}


@pytest.mark.parametrize("args,match", [
    ((6, 4, 1), "not divisible"),
    ((8, 2, 3), "not divisible"),
    # Interleaving needs pipelining (Megatron-LM 23.06 asked for PP > 2; two stages run here).
    ((8, 1, 1, 2), "pipeline-model-parallel-size >= 2"),
    ((8, 1, 4, None, 4), "split-rank"),
])
def test_layout_rejects_impossible_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        rank_layout(*args)


def test_cli_prints_layout():
    out = subprocess.run(
        [sys.executable, "-m", "megatron.core.parallel_state", "--world-size", "16",
         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"],
        capture_output=True, text=True, check=True).stdout
    assert "data-parallel groups:           [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]" in out
    assert "pipeline-model-parallel groups: [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]" in out
    assert "model-parallel groups:          [0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]" in out
    assert "embedding groups:               [0,12] [1,13] [2,14] [3,15]" in out
    bad = subprocess.run(
        [sys.executable, "-m", "megatron.core.parallel_state", "--world-size", "6",
         "--tensor-model-parallel-size", "4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--tensor-model-parallel-size" in bad.stderr


def test_cli_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "megatron.core.parallel_state", "--help"],
                         capture_output=True, text=True, check=True).stdout
    text = " ".join(out.split())
    for phrase in ("--world-size N Total number of ranks",
                   "--tensor-model-parallel-size N Ranks each layer is split over",
                   "--pipeline-model-parallel-size N Number of pipeline stages",
                   "--virtual-pipeline-model-parallel-size N Model chunks per pipeline stage",
                   "--pipeline-model-parallel-split-rank R Pipeline stage where the decoder"):
        assert phrase in text, phrase


def test_getters_before_initialization():
    """TP/PP/DP sizes and ranks answer as for one process (gpt_model_from, get_checkpoint_name
    and get_megatron_optimizer rely on that); every other getter raises clearly."""
    assert not ps.model_parallel_is_initialized()
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (1, 0)
    assert (ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank()) == (1, 0)
    assert (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()) == (1, 0)
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    for getter in (ps.get_model_parallel_world_size, ps.get_model_parallel_rank,
                   ps.get_embedding_group_world_size, ps.get_embedding_group_rank,
                   ps.get_position_embedding_group_world_size,
                   ps.get_position_embedding_group_rank, ps.get_tensor_model_parallel_group,
                   ps.get_data_parallel_group, ps.get_embedding_group):
        with pytest.raises(RuntimeError, match="initialize_model_parallel"):
            getter()


def _embedding_sizes_and_ranks(rank, world_size, pp, split):
    ps.initialize_model_parallel(1, pp, pipeline_model_parallel_split_rank=split)
    out = {}
    for kind, size, rank_of, member in (
            ("embedding", ps.get_embedding_group_world_size, ps.get_embedding_group_rank,
             ps.is_rank_in_embedding_group(ignore_virtual=True)),
            ("position_embedding", ps.get_position_embedding_group_world_size,
             ps.get_position_embedding_group_rank, ps.is_rank_in_position_embedding_group())):
        try:
            out[kind] = (size(), rank_of())
        except RuntimeError as err:
            out[kind] = str(err)
        out[kind + "_member"] = member
    return out


@pytest.mark.parametrize("split", [None, 2])
def test_embedding_group_size_and_rank(split):
    """PP=4 (DP=2): the first and last stages (and the split stage) share the word embedding;
    the first stage (and the split stage) hold a position embedding. Other ranks get a clear
    error. Runs on the pooled 8-rank world."""
    layout = rank_layout(8, 1, 4, None, split)
    results = run_distributed(8, _embedding_sizes_and_ranks, 4, split)
    for rank, out in enumerate(results):
        for kind in ("embedding", "position_embedding"):
            ranks = layout.group_of(kind, rank)
            assert out[kind + "_member"] == bool(ranks), (rank, kind)
            if ranks:
                assert out[kind] == (len(ranks), ranks.index(rank)), (rank, kind, out)
            else:
                assert "is in no" in out[kind] and f"rank {rank}" in out[kind], out[kind]
    assert results[0]["embedding"] == (3 if split else 2, 0)
    assert results[6]["embedding"] == ((3, 2) if split else (2, 1))
    assert "is in no embedding group" in results[2]["embedding"]
    assert results[0]["position_embedding"] == ((2, 0) if split else (1, 0))


def _sum_in_each_group(rank, world_size):
    ps.initialize_model_parallel(2, 2)
    sums = {}
    for kind, group in (("tensor", ps.get_tensor_model_parallel_group()),
                        ("pipeline", ps.get_pipeline_model_parallel_group()),
                        ("data", ps.get_data_parallel_group()),
                        ("model", ps.get_model_parallel_group()),
                        ("embedding", ps.get_embedding_group())):
        value = torch.tensor([float(2 ** rank)])
        comm.all_reduce(value, group)
        sums[kind] = int(value.item())
    info = dict(
        tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        pp=(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        dp=(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        first=ps.is_pipeline_first_stage(), last=ps.is_pipeline_last_stage(),
        next=ps.get_pipeline_model_parallel_next_rank(),
        prev=ps.get_pipeline_model_parallel_prev_rank(),
        in_embedding=ps.is_rank_in_embedding_group(),
        embedding=(ps.get_embedding_group_world_size(), ps.get_embedding_group_rank()),
        model=(ps.get_model_parallel_world_size(), ps.get_model_parallel_rank()))
    return sums, info


def test_real_groups_on_eight_ranks():
    layout = rank_layout(8, 2, 2)
    results = run_distributed(8, _sum_in_each_group)
    for rank, (sums, info) in enumerate(results):
        for kind in ("tensor", "pipeline", "data", "model", "embedding"):
            expected = sum(2 ** r for r in layout.group_of(kind, rank))
            assert sums[kind] == expected, (rank, kind)
        assert info["tp"] == (rank % 2, 2)
        assert info["pp"] == (rank // 4, 2)
        assert info["dp"] == ((rank // 2) % 2, 2)
        assert info["first"] == (rank < 4) and info["last"] == (rank >= 4)
        assert info["next"] == (rank + 4) % 8 and info["prev"] == (rank - 4) % 8
        assert info["in_embedding"]
        assert info["embedding"] == (2, rank // 4)
        model_group = layout.group_of("model", rank)
        assert info["model"] == (4, model_group.index(rank))


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    comm.barrier(comm.world_group())  # rank 0 hangs here: the harness must notice


def test_harness_reports_failing_rank():
    with pytest.raises(RuntimeError, match="boom on rank one"):
        run_distributed(2, _raise_on_rank_one, timeout=30)
    # The next call gets a fresh, working world.
    assert run_distributed(2, _sum_world) == [3, 3]


def _sum_world(rank, world_size):
    value = torch.tensor([rank + 1])
    comm.all_reduce(value, comm.world_group())
    return int(value.item())


def _draw_random(rank, world_size):
    """Draws from every RNG a test might use without seeding, and the tracker's streams."""
    import random

    import numpy as np

    from megatron.core.tensor_parallel.random import get_rng_tracker

    return (random.random(), float(np.random.rand()), float(torch.rand(1)),
            sorted(get_rng_tracker().get_states()))


def _reseed_everything(rank, world_size):
    import random

    import numpy as np

    from megatron.core.tensor_parallel.random import model_parallel_manual_seed

    random.seed(99 + rank)
    np.random.seed(99 + rank)
    model_parallel_manual_seed(99 + rank, rank)  # seeds torch and adds a tracker stream
    return float(torch.rand(1))


def test_harness_resets_rngs_between_calls():
    """A test that seeds (or adds a model-parallel stream) does not leak into the next one."""
    import random

    import numpy as np

    from tests.multiprocess import RESET_SEED

    first = run_distributed(2, _draw_random)
    run_distributed(2, _reseed_everything)
    assert run_distributed(2, _draw_random) == first
    random.seed(RESET_SEED)
    np.random.seed(RESET_SEED)
    expected = (random.random(), float(np.random.rand()),
                float(torch.rand(1, generator=torch.Generator().manual_seed(RESET_SEED))), [])
    assert first == [expected, expected]


def _hang_on_rank_one(rank, world_size):
    import time

    if rank == 1:
        time.sleep(60)  # no exception, no collective: only the timeout can notice
    return rank


def test_harness_reports_hung_rank_and_replaces_world():
    from tests import multiprocess

    assert run_distributed(2, _sum_world) == [3, 3]
    old = multiprocess._WORLDS[2]
    start = time.monotonic()
    with pytest.raises(RuntimeError) as exc:
        run_distributed(2, _hang_on_rank_one, timeout=3)
    elapsed = time.monotonic() - start
    message = str(exc.value)
    assert "ranks [1] did not finish within 3 s: hung" in message, message
    assert "ranks [0] returned and waited" in message, message
    assert elapsed < 15, f"hang reported after {elapsed:.1f} s with a 3 s timeout"
    assert not old.alive(), "the hung world must be killed"
    assert run_distributed(2, _sum_world) == [3, 3]
    assert multiprocess._WORLDS[2] is not old


def _expert_grids(rank, world_size):
    """(grid built, ETP group, EP size, expert-DP group) for three folded layouts."""
    out = []
    for tp, etp, ep in ((2, 2, 1), (2, 1, 1), (1, 2, 2), (4, 2, 2)):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp)
        out.append((ps.has_expert_grid(),
                    comm.world_size(ps.get_expert_tensor_parallel_group()),
                    ps.get_expert_tensor_parallel_rank(),
                    ps.get_expert_model_parallel_world_size(),
                    comm.world_size(ps.get_expert_data_parallel_group())))
    ps.destroy_model_parallel()
    return out


def test_the_expert_grid_is_built_whenever_ep_or_etp_differ_from_the_dense_grid():
    """EP = 1 with ETP != TP folds a grid too (Megatron-Core's parallel folding); at EP = 1
    and ETP = TP the experts use the dense groups."""
    results = run_distributed(4, _expert_grids)
    for rank, got in enumerate(results):
        assert got == [(False, 2, rank % 2, 1, 2),  # TP=2: the dense TP and DP groups
                       (True, 1, 0, 1, 4),  # ETP=1 at EP=1: the experts' DP over all ranks
                       (True, 2, rank % 2, 2, 1),  # ETP=2 > TP=1
                       (True, 2, rank % 2, 2, 1)], (rank, got)  # ETP=2 < TP=4
