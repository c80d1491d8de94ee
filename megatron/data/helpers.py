"""Index builders: the pybind11 module ``megatron.data.helpers_cpp`` or a numpy fallback.

The C++ module is compiled by ``pip install -e .`` (setup.py), never at run time. Where it is
absent (e.g. a source checkout without a build) every function here falls back to numpy code
that returns *identical* arrays (tests/data/test_helpers.py checks this), with one warning.

Semantics follow Megatron-Core's ``helpers.cpp`` (``docs/FORMATS.md`` sections 2b, 2c).
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
# BERT samples mapping
# ---------------------------------------------------------------------------------------------

LONG_SENTENCE_LEN = 512
"""A document of several sentences holding a longer sentence is skipped (Megatron's rule)."""

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def mt19937_stream(seed: int) -> np.random.MT19937:
    """numpy's MT19937 in the state ``std::mt19937(seed)`` starts from (``init_genrand``);
    ``random_raw`` then yields the same 32-bit numbers as the C++ engine."""
    key = [seed & _MASK32]
    for i in range(1, 624):
        prev = key[-1]
        key.append((1812433253 * (prev ^ (prev >> 30)) + i) & _MASK32)
    engine = np.random.MT19937()
    engine.state = {"bit_generator": "MT19937",
                    "state": {"key": np.array(key, dtype=np.uint32), "pos": 624}}
    return engine


def mt19937_64_numbers(seed: int, count: int) -> np.ndarray:
    """The first ``count`` outputs of ``std::mt19937_64(seed)`` (uint64; numpy has no
    64-bit Mersenne Twister). The 312-word twist runs in three vectorised pieces: words
    below 156 read untwisted words ahead, the others words twisted just before."""
    n, m = 312, 156
    upper, lower = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)
    matrix = np.uint64(0xB5026F5AA96619E9)
    state = [seed & _MASK64]
    for i in range(1, n):
        prev = state[-1]
        state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
    mt = np.array(state, dtype=np.uint64)
    one = np.uint64(1)

    def twist(i0: int, i1: int) -> None:
        i = np.arange(i0, i1)
        y = (mt[i] & upper) | (mt[(i + 1) % n] & lower)
        mt[i] = mt[(i + m) % n] ^ (y >> one) ^ np.where(y & one, matrix, np.uint64(0))

    out = []
    for _ in range(-(-count // n)):
        twist(0, n - m)
        twist(n - m, n - 1)
        twist(n - 1, n)
        y = mt.copy()
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        out.append(y)
    return np.concatenate(out)[:count] if out else np.zeros(0, dtype=np.uint64)


class _Draws:
    """32-bit numbers of ``std::mt19937(seed)``, handed out one at a time from blocks."""

    def __init__(self, seed: int) -> None:
        self._engine = mt19937_stream(seed)
        self._block: list[int] = []
        self._next = 0

    def __call__(self) -> int:
        if self._next == len(self._block):
            self._block = self._engine.random_raw(4096).tolist()
            self._next = 0
        self._next += 1
        return self._block[self._next - 1]


def _eligible_documents(docs: np.ndarray, sizes: np.ndarray, min_num_sent: int) -> np.ndarray:
    """Ids of the documents packed into samples: >= min_num_sent sentences, and no sentence
    over LONG_SENTENCE_LEN unless the document is a single sentence."""
    docs = np.asarray(docs, dtype=np.int64)
    counts = np.diff(docs)
    long_sent = np.zeros(len(counts), dtype=bool)
    nonempty = np.flatnonzero(counts > 0)
    if len(nonempty):
        longest = np.maximum.reduceat(np.asarray(sizes)[docs[0]:docs[-1]],
                                      docs[nonempty] - docs[0])
        long_sent[nonempty] = longest > LONG_SENTENCE_LEN
    return np.flatnonzero((counts >= min_num_sent) & ~(long_sent & (counts > 1)))


def build_mapping_numpy(docs: np.ndarray, sizes: np.ndarray, num_epochs: int,
                        max_num_samples: int, max_seq_length: int, short_seq_prob: float,
                        seed: int, min_num_sent: int) -> np.ndarray:
    """The samples mapping in Python: what the C++ ``build_mapping`` returns, row for row."""
    ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    draw = _Draws(seed)

    def target() -> int:
        if ratio == 0:
            return max_seq_length
        r = draw()
        return 2 + r % (max_seq_length - 1) if r % ratio == 0 else max_seq_length

    docs = np.asarray(docs, dtype=np.int64)
    eligible = _eligible_documents(docs, sizes, min_num_sent).tolist()
    bounds = docs.tolist()
    lengths = np.asarray(sizes).tolist() if len(eligible) else []
    rows: list[tuple[int, int, int]] = []
    for epoch in range(num_epochs):
        if len(rows) >= max_num_samples or (epoch > 0 and not rows):
            break
        for doc in eligible:
            first, last = bounds[doc], bounds[doc + 1]
            start, length, num_sent, goal = first, 0, 0, target()
            for s in range(first, last):
                length += lengths[s]
                num_sent += 1
                remaining = last - s - 1
                full = length >= goal and remaining > 1 and num_sent >= min_num_sent
                if full or remaining == 0:
                    rows.append((start, s + 1, goal))
                    start, length, num_sent, goal = s + 1, 0, 0, target()
    dtype = np.uint64 if len(sizes) > np.iinfo(np.uint32).max else np.uint32
    mapping = np.array(rows, dtype=dtype).reshape(-1, 3)
    return mapping[_fisher_yates_order(len(mapping), seed + 1)]


def _fisher_yates_order(count: int, seed: int) -> np.ndarray:
    """The row order of the C++ Fisher-Yates shuffle with ``std::mt19937_64(seed)``."""
    order = list(range(count))
    if count < 2:
        return np.array(order, dtype=np.int64)
    numbers = mt19937_64_numbers(seed, count - 1)
    i = np.arange(count - 1, 0, -1, dtype=np.uint64)
    picks = (numbers % (i + np.uint64(1))).tolist()
    for i_, j in zip(range(count - 1, 0, -1), picks):
        order[i_], order[j] = order[j], order[i_]
    return np.array(order, dtype=np.int64)


def build_mapping(docs: np.ndarray, sizes: np.ndarray, num_epochs: int, max_num_samples: int,
                  max_seq_length: int, short_seq_prob: float, seed: int, verbose: bool = False,
                  min_num_sent: int = 2, use_cpp: bool | None = None) -> np.ndarray:
    """Megatron-Core's BERT samples mapping: rows (first sentence, end sentence exclusive,
    target length), already shuffled; uint32 (uint64 past 2^32 sentences).

    Per epoch (one generator for all epochs), per document with >= ``min_num_sent``
    sentences and, if it has several, none over 512 tokens: sentences are packed until
    the target length is reached with more than one sentence left, or the document ends.
    The target is ``max_seq_length``, or with probability ``short_seq_prob`` a random
    length in [2, max_seq_length]. Whole epochs are built until ``max_num_samples`` is
    reached (an epoch that yields nothing ends the build: there is nothing to pack).

    Args:
        docs: int64 document boundaries of the split, sentence ids global in the dataset
            (``document_indices`` of the split's documents plus the closing one).
        sizes: int32 sentence lengths of the whole dataset.
        num_epochs: most epochs to build.
        max_num_samples: stop at the first epoch start with this many samples.
        max_seq_length: target length (the sequence length less [CLS] and two [SEP]).
        short_seq_prob: probability of a shorter target.
        seed: of the packing generator (``std::mt19937``); the shuffle uses seed + 1.
        verbose: unused (Megatron's signature).
        min_num_sent: 2 with the sentence-order head, else 1.
        use_cpp: force (True) or forbid (False) the C++ builder; None = C++ when built.
    """
    docs = np.ascontiguousarray(docs, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    max_num_samples = min(int(max_num_samples), np.iinfo(np.uint64).max)
    if _use_cpp(use_cpp):
        return _cpp.build_mapping(docs, sizes, int(num_epochs), max_num_samples,
                                  int(max_seq_length), float(short_seq_prob), int(seed),
                                  bool(verbose), int(min_num_sent))
    return build_mapping_numpy(docs, sizes, int(num_epochs), max_num_samples,
                               int(max_seq_length), float(short_seq_prob), int(seed),
                               int(min_num_sent))


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
