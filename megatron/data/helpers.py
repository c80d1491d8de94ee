"""Index builders: the pybind11 module ``megatron.data.helpers_cpp`` or a numpy fallback.

The C++ module is compiled by ``pip install -e .`` (setup.py), never at run time. Where it is
absent (e.g. a source checkout without a build) every function here falls back to numpy code
that returns *identical* arrays (tests/data/test_helpers.py checks this), with one warning.

Semantics follow Megatron-Core's ``helpers.cpp`` (``../shared/FORMATS.md`` section 2b).
"""

from __future__ import annotations

import numpy as np

from megatron.core.log import warn_rank_0

try:
    from megatron.data import helpers_cpp as _cpp
except ImportError:  # pragma: no cover - depends on the build
    _cpp = None

_warned = False


def cpp_available() -> bool:
    """Whether the compiled helpers are importable."""
    return _cpp is not None


def _use_cpp(use_cpp: bool | None) -> bool:
    global _warned
    if use_cpp is None:
        use_cpp = _cpp is not None
        if not use_cpp and not _warned:
            warn_rank_0("megatron.data.helpers_cpp is not built (run `pip install -e .`); "
                        "using the slower numpy index builders (same results)")
            _warned = True
    if use_cpp and _cpp is None:
        raise RuntimeError("megatron.data.helpers_cpp is not built; run `pip install -e .`")
    return use_cpp


# ---------------------------------------------------------------------------------------------
# Sample index
# ---------------------------------------------------------------------------------------------

def num_samples_of(total_tokens: int, seq_length: int, drop_last: bool, extra: int) -> int:
    """Samples the sample index holds for ``total_tokens`` (Megatron-Core's count)."""
    if drop_last:
        return (total_tokens - extra) // seq_length
    # The reference computes this ceil in single precision; keep it bit-identical.
    return int(np.ceil(np.float32(total_tokens - extra) / np.float32(seq_length)))


def build_sample_idx_numpy(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                           num_epochs: int, tokens_per_epoch: int,
                           drop_last_partial_sequence: bool = True,
                           add_extra_token_to_sequence: int = 1,
                           dtype: type = np.int32) -> np.ndarray:
    """Vectorised sample index: row k locates global token position ``k * seq_length``.

    Sample k covers flattened tokens ``[k*L, k*L + L + extra)``; its closing row is the
    document holding its last token when extra=1 (that token is reused as the next sample's
    first), i.e. the first document whose end is >= ``k*L + L + extra``.

    Returns:
        ``[num_samples + 1, 2]`` array of (index into document_index, offset in document).
    """
    extra = int(add_extra_token_to_sequence)
    num_samples = num_samples_of(num_epochs * tokens_per_epoch, seq_length,
                               drop_last_partial_sequence, extra)
    # [n_docs] end position of each document in the flattened stream
    doc_lengths = np.asarray(sizes)[np.asarray(document_index)].astype(np.int64)
    ends = np.cumsum(doc_lengths)
    starts = ends - doc_lengths
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length  # row k>=1 starts here
    docs = np.searchsorted(ends, positions + (extra - 1), side="right")
    out = np.empty((num_samples + 1, 2), dtype=np.int64)
    out[0] = 0
    past_end = docs >= len(ends)  # only the partial last sample when not dropping it
    docs_safe = np.minimum(docs, len(ends) - 1)
    out[1:, 0] = docs_safe
    out[1:, 1] = positions - starts[docs_safe]
    if past_end.any():
        out[1:, 1][past_end] = doc_lengths[-1] - extra
    return out.astype(dtype)


def build_sample_idx(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                     num_epochs: int, tokens_per_epoch: int,
                     drop_last_partial_sequence: bool = True,
                     add_extra_token_to_sequence: bool | int = True,
                     use_cpp: bool | None = None) -> np.ndarray:
    """Megatron's sample index, int32 when ``max(len(document_index), max(sizes))`` fits, else int64.

    Args:
        sizes: int32 ``[S]`` sequence lengths of the low-level dataset.
        document_index: int32 ``[E * docs]`` shuffled document ids.
        seq_length: tokens per sample (without the extra token).
        num_epochs: epochs covered by document_index.
        tokens_per_epoch: tokens of the split in one epoch.
        drop_last_partial_sequence: drop (True) or keep the final partial sample.
        add_extra_token_to_sequence: samples hold seq_length + 1 tokens.
        use_cpp: force (True) or forbid (False) the C++ builder; None = C++ when built.

    Returns:
        ``[num_samples + 1, 2]`` int32/int64 array.
    """
    extra = 1 if add_extra_token_to_sequence else 0
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    document_index = np.ascontiguousarray(document_index, dtype=np.int32)
    wide = max(document_index.shape[0], int(sizes.max()) if len(sizes) else 0) > np.iinfo(np.int32).max
    if _use_cpp(use_cpp):
        fn = _cpp.build_sample_idx_int64 if wide else _cpp.build_sample_idx_int32
        return fn(sizes, document_index, int(seq_length), int(num_epochs), int(tokens_per_epoch),
                  bool(drop_last_partial_sequence), extra)
    return build_sample_idx_numpy(sizes, document_index, seq_length, num_epochs, tokens_per_epoch,
                                  drop_last_partial_sequence, extra,
                                  np.int64 if wide else np.int32)


# ---------------------------------------------------------------------------------------------
# Blending indices
# ---------------------------------------------------------------------------------------------

def _greedy_picks(weights: np.ndarray, counts: np.ndarray, live: np.ndarray, s0: int,
                  n: int) -> np.ndarray:
    """Cheap guess of the next ``n`` greedy picks: merge each dataset's 'due times'.

    Dataset i is due for its (c+1)-th sample near step c / w_i; sorting those times (stable,
    so lower indices win ties) predicts the greedy order. The caller verifies every guess.
    """
    keys, owners = [], []
    for i in np.flatnonzero(live & (weights > 0)):
        due = counts[i] + np.arange(int(np.ceil(n * weights[i])) + 2, dtype=np.float64)
        keys.append(due / weights[i])
        owners.append(np.full(len(due), i, dtype=np.int64))
    if not keys:
        return np.zeros(n, dtype=np.int64)
    order = np.argsort(np.concatenate(keys), kind="stable")
    guess = np.concatenate(owners)[order][:n]
    if len(guess) < n:
        guess = np.concatenate([guess, np.full(n - len(guess), guess[-1] if len(guess) else 0)])
    return guess


def _verify(weights: np.ndarray, counts: np.ndarray, caps: np.ndarray, s0: int,
            guess: np.ndarray) -> int:
    """Length of the longest prefix of ``guess`` that the exact greedy rule would pick.

    Counts before each step follow from the guess itself; if the argmax of the exact errors
    (same float64 operations as the C++ loop) equals the guess at every step up to k, the
    guess is the true sequence up to k by induction.
    """
    k = len(guess)
    onehot = np.zeros((k, len(weights)), dtype=np.int64)  # [k, num_datasets]
    onehot[np.arange(k), guess] = 1
    before = counts[None, :] + np.cumsum(onehot, axis=0) - onehot  # counts before each step
    x = np.maximum(np.arange(s0, s0 + k, dtype=np.float64), 1.0)[:, None]
    errors = weights[None, :] * x - before.astype(np.float64)
    errors[before >= caps[None, :]] = -np.inf  # exhausted datasets cannot be picked
    ok = errors.argmax(axis=1) == guess  # argmax: first maximum = lowest index on ties
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else k


def _blend_numpy(weights: np.ndarray, caps: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact greedy blending: vectorised guess-and-verify windows where the due-time guess
    holds (2 datasets, equal weights, ...), a plain exact loop for stretches where it does not."""
    num = len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    counts = np.zeros(num, dtype=np.int64)
    s, window = 0, 256
    while s < size:
        n = min(window, size - s)
        guess = _greedy_picks(weights, counts, counts < caps, s, n)
        good = _verify(weights, counts, caps, s, guess)
        if good < n:
            # Steps before s+good are right; continue exactly with the loop for a stretch.
            loop_n = min(size - s - good, 4096)
            picks = np.concatenate([guess[:good], _greedy_loop(
                weights, counts + np.bincount(guess[:good], minlength=num), caps, s + good, loop_n)])
            window = 256
        else:
            picks = guess
            # Cap the [window, num_datasets] verification matrices at ~4M entries.
            window = min(max(16, (1 << 22) // max(num, 1)), window * 2)
        dataset_index[s : s + len(picks)] = picks
        counts += np.bincount(picks, minlength=num)
        s += len(picks)
    return dataset_index, _sample_ranks(dataset_index, num)


def _greedy_loop(weights: np.ndarray, counts: np.ndarray, caps: np.ndarray, s0: int,
                 n: int) -> np.ndarray:
    """The exact greedy rule, one step at a time (Python floats = the C++ doubles)."""
    w, c, cap = weights.tolist(), counts.tolist(), caps.tolist()
    out = np.empty(n, dtype=np.int64)
    for k in range(n):
        x = max(float(s0 + k), 1.0)
        best, best_error = -1, 0.0
        for i in range(len(w)):
            if c[i] >= cap[i]:
                continue
            error = w[i] * x - c[i]
            if best < 0 or error > best_error:
                best, best_error = i, error
        out[k] = best
        c[best] += 1
    return out


def _sample_ranks(dataset_index: np.ndarray, num: int) -> np.ndarray:
    """[size] how many earlier samples came from the same dataset (stable counting sort)."""
    order = np.argsort(dataset_index, kind="stable")
    firsts = np.concatenate([[0], np.cumsum(np.bincount(dataset_index, minlength=num))[:-1]])
    ranks = np.empty(len(dataset_index), dtype=np.int64)
    ranks[order] = np.arange(len(dataset_index), dtype=np.int64) - np.repeat(
        firsts, np.bincount(dataset_index, minlength=num))
    return ranks


def _exact_step(weights: np.ndarray, counts: np.ndarray, caps: np.ndarray, s: int) -> int:
    errors = weights * max(float(s), 1.0) - counts.astype(np.float64)
    errors[counts >= caps] = -np.inf
    return int(errors.argmax())


def build_blending_indices(dataset_index: np.ndarray, dataset_sample_index: np.ndarray,
                           weights: np.ndarray | list[float], num_datasets: int, size: int,
                           verbose: bool = False, use_cpp: bool | None = None) -> None:
    """Fill ``dataset_index`` (int16) and ``dataset_sample_index`` (int64) in place, greedily.

    Sample s goes to the dataset with the largest ``w_i * max(s, 1) - count_i`` (ties: lowest i).
    """
    _check_out(dataset_index, dataset_sample_index, size)
    weights = np.ascontiguousarray(weights, dtype=np.float64)[:num_datasets]
    if _use_cpp(use_cpp):
        _cpp.build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets,
                                    size, verbose)
        return
    caps = np.full(num_datasets, np.iinfo(np.int64).max, dtype=np.int64)
    di, dsi = _blend_numpy(weights, caps, size)
    dataset_index[:size], dataset_sample_index[:size] = di, dsi


def build_exhaustive_blending_indices(dataset_index: np.ndarray, dataset_sample_index: np.ndarray,
                                      sizes: np.ndarray | list[int], num_datasets: int,
                                      use_cpp: bool | None = None) -> None:
    """Like :func:`build_blending_indices` with weights ``sizes / sum(sizes)``, taking exactly
    ``sizes[i]`` samples from dataset i (it drops out when exhausted)."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)[:num_datasets]
    total = int(sizes.sum())
    _check_out(dataset_index, dataset_sample_index, total)
    if _use_cpp(use_cpp):
        _cpp.build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes,
                                               num_datasets)
        return
    weights = sizes.astype(np.float64) / float(total)
    di, dsi = _blend_numpy(weights, sizes, total)
    dataset_index[:total], dataset_sample_index[:total] = di, dsi


def _check_out(dataset_index: np.ndarray, dataset_sample_index: np.ndarray, size: int) -> None:
    # In-place outputs: a wrong dtype would make pybind11 write into a temporary copy.
    if dataset_index.dtype != np.int16 or dataset_sample_index.dtype != np.int64:
        raise TypeError("dataset_index must be int16 and dataset_sample_index int64")
    if not (dataset_index.flags.c_contiguous and dataset_sample_index.flags.c_contiguous):
        raise TypeError("blending outputs must be C-contiguous")
    if len(dataset_index) < size or len(dataset_sample_index) < size:
        raise ValueError(f"blending outputs hold {len(dataset_index)} items, need {size}")
