"""Seeding offsets of initialize.set_random_seed on a real TP=2 x PP=2 x DP=2 world.

Megatron-LM: python/numpy/torch get ``seed + 100 * pp_rank`` (``+ 10 * dp_rank`` with
--data-parallel-random-init); the model-parallel RNG tracker's stream gets
``seed + 100 * pp_rank (+ 10 * dp_rank) + 2718 + tp_rank``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megatron.core import parallel_state as ps
from tests.multiprocess import run_distributed

SEED = 1234


def _draws():
    """One value from python, numpy and torch, and one from the model-parallel stream."""
    from megatron.core.tensor_parallel.random import get_rng_tracker

    values = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    with get_rng_tracker().fork():
        tracker = float(torch.rand(1))
    return values + (tracker,)


def _expected(seed: int, tp_rank: int):
    rng = random.Random(seed)
    return (rng.random(), float(np.random.RandomState(seed).rand()),
            float(torch.rand(1, generator=torch.Generator().manual_seed(seed))),
            float(torch.rand(1, generator=torch.Generator().manual_seed(seed + 2718 + tp_rank))))


def _seed_on_rank(rank, world_size, data_parallel_random_init):
    from megatron.training.initialize import set_random_seed

    ps.initialize_model_parallel(2, 2)
    set_random_seed(SEED, data_parallel_random_init)
    ranks = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
             ps.get_data_parallel_rank())
    return ranks, _draws()


@pytest.mark.parametrize("data_parallel_random_init", [False, True])
def test_seed_offsets_on_eight_ranks(data_parallel_random_init):
    results = run_distributed(8, _seed_on_rank, data_parallel_random_init)
    for rank, ((tp, pp, dp), draws) in enumerate(results):
        # TP fastest, then DP, then PP (16-rank example in parallel_state's docstring).
        assert (tp, pp, dp) == (rank % 2, rank // 4, (rank // 2) % 2)
        seed = SEED + 100 * pp + (10 * dp if data_parallel_random_init else 0)
        assert draws == _expected(seed, tp), (rank, tp, pp, dp)
    by_rank = [draws for _, draws in results]
    # Same default stream on TP peers (replicated activations draw identical dropout masks) ...
    assert by_rank[0][:3] == by_rank[1][:3]
    # ... but their model-parallel streams differ.
    assert by_rank[0][3] != by_rank[1][3]
    # Pipeline stages always differ; DP replicas only with --data-parallel-random-init.
    assert by_rank[0][:3] != by_rank[4][:3]
    assert (by_rank[0] != by_rank[2]) == data_parallel_random_init
