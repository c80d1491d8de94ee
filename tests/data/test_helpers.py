"""The C++ index builders and the numpy fallback give identical arrays."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.data import helpers

needs_cpp = pytest.mark.skipif(not helpers.cpp_available(),
                               reason="megatron.data.helpers_cpp not built (pip install -e .)")


def _both(fn, *args):
    return fn(*args, use_cpp=True), fn(*args, use_cpp=False)


@needs_cpp
@pytest.mark.parametrize("seed", range(12))
def test_sample_idx_cpp_equals_numpy(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 300, 300).astype(np.int32)
    sizes[:3] += 2
    docs = np.arange(int(rng.integers(3, 300)), dtype=np.int32)
    epochs = int(rng.integers(1, 4))
    doc_index = np.tile(docs, epochs)
    rng.shuffle(doc_index)
    tokens = int(sizes[docs].sum())
    seq = int(rng.integers(2, 200))
    for drop_last in (True, False):
        for extra in (1, 0):
            a, b = _both(helpers.build_sample_idx, sizes, doc_index, seq, epochs, tokens,
                         drop_last, extra)
            assert a.dtype == b.dtype == np.int32 and a.shape == b.shape
            np.testing.assert_array_equal(a, b)


@needs_cpp
@pytest.mark.parametrize("seed", range(12))
def test_blending_cpp_equals_numpy(seed):
    rng = np.random.default_rng(100 + seed)
    k = int(rng.integers(1, 9))
    weights = rng.random(k) ** 2 + 1e-3
    weights /= weights.sum()
    size = int(rng.integers(1, 20000))
    outs = []
    for use_cpp in (True, False):
        di, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers.build_blending_indices(di, dsi, weights, k, size, use_cpp=use_cpp)
        outs.append((di, dsi))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])

    sizes = rng.integers(0, 2000, k)
    sizes[0] += 1
    total = int(sizes.sum())
    outs = []
    for use_cpp in (True, False):
        di, dsi = np.zeros(total, np.int16), np.zeros(total, np.int64)
        helpers.build_exhaustive_blending_indices(di, dsi, sizes, k, use_cpp=use_cpp)
        outs.append((di, dsi))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    assert np.bincount(outs[0][0], minlength=k).tolist() == sizes.tolist()


def test_blending_reference_rule_numpy():
    """Greedy rule written out plainly: argmax of w*max(s,1) - count, ties to the lowest index."""
    w = np.array([0.25, 0.25, 0.5])
    di, dsi = np.zeros(40, np.int16), np.zeros(40, np.int64)
    helpers.build_blending_indices(di, dsi, w, 3, 40, use_cpp=False)
    counts = [0, 0, 0]
    for s in range(40):
        errors = [w[i] * max(s, 1) - counts[i] for i in range(3)]
        best = errors.index(max(errors))
        assert di[s] == best and dsi[s] == counts[best]
        counts[best] += 1
