"""Index cache across ranks: rank 0 builds, the others wait and load the same arrays."""

from __future__ import annotations

import os
import time

import numpy as np

from megatron.data.index_cache import cached_arrays
from tests.multiprocess import run_distributed


def _build_on_every_rank(rank, world_size, cache_dir):
    built = []

    def build():
        # Slow, so that a rank not waiting for rank 0 finds no files yet and builds too.
        time.sleep(0.5)
        built.append(rank)
        return {"a": np.arange(1000, dtype=np.int64) * 3, "b": np.full(7, rank, dtype=np.int32)}

    arrays = cached_arrays(cache_dir, "abc-GPTDataset-train", "{}", ["a", "b"], build)
    return len(built), np.asarray(arrays["a"]).tolist(), np.asarray(arrays["b"]).tolist()


def test_rank_0_builds_and_the_others_load(tmp_path):
    cache_dir = str(tmp_path / "cache")
    results = run_distributed(4, _build_on_every_rank, cache_dir)
    assert [builds for builds, _, _ in results] == [1, 0, 0, 0]
    for _, a, b in results:
        assert a == list(range(0, 3000, 3))
        assert b == [0] * 7  # rank 0's arrays everywhere
    assert sorted(os.listdir(cache_dir)) == ["abc-GPTDataset-train-a.npy",
                                             "abc-GPTDataset-train-b.npy",
                                             "abc-GPTDataset-train-description.txt"]
    # A second run finds the files: nobody builds.
    again = run_distributed(4, _build_on_every_rank, cache_dir)
    assert [builds for builds, _, _ in again] == [0, 0, 0, 0]
