"""A plain, slow restatement of Megatron-Core v0.13's BERT samples, to check the dataset against.

Written from the algorithm as ``docs/FORMATS.md`` section 2c and Megatron-Core's
``helpers.cpp`` / ``masked_dataset.py`` / ``bert_dataset.py`` describe it, step by step and
without any of the production code's shortcuts: pure-Python Mersenne Twisters (32 and 64 bit),
the two-pass mapping loop, nested n-gram lists shuffled as lists, ``RandomState.choice`` for n.
"""

from __future__ import annotations

import numpy as np


class MT19937:
    """``std::mt19937`` in pure Python."""

    def __init__(self, seed: int) -> None:
        self.mt = [seed & 0xFFFFFFFF]
        for i in range(1, 624):
            self.mt.append((1812433253 * (self.mt[-1] ^ (self.mt[-1] >> 30)) + i) & 0xFFFFFFFF)
        self.index = 624

    def __call__(self) -> int:
        if self.index == 624:
            for i in range(624):
                y = (self.mt[i] & 0x80000000) | (self.mt[(i + 1) % 624] & 0x7FFFFFFF)
                self.mt[i] = self.mt[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


class MT19937_64:
    """``std::mt19937_64`` in pure Python."""

    def __init__(self, seed: int) -> None:
        mask = (1 << 64) - 1
        self.mt = [seed & mask]
        for i in range(1, 312):
            self.mt.append((6364136223846793005 * (self.mt[-1] ^ (self.mt[-1] >> 62)) + i) & mask)
        self.index = 312

    def __call__(self) -> int:
        mask = (1 << 64) - 1
        if self.index == 312:
            for i in range(312):
                y = (self.mt[i] & 0xFFFFFFFF80000000) | (self.mt[(i + 1) % 312] & 0x7FFFFFFF)
                self.mt[i] = (self.mt[(i + 156) % 312] ^ (y >> 1)
                              ^ (0xB5026F5AA96619E9 if y & 1 else 0))
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000 & mask
        y ^= (y << 37) & 0xFFF7EEE000000000 & mask
        return y ^ (y >> 43)


def reference_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                      seed, min_num_sent):
    """helpers.cpp ``build_mapping``: two passes with a reseeded generator, then the shuffle."""
    ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0

    def target(gen):
        if ratio == 0:
            return max_seq_length
        r = gen()
        if r % ratio == 0:
            return 2 + r % (max_seq_length - 1)
        return max_seq_length

    maps = None
    for second in (False, True):
        gen = MT19937(seed)
        rows = []
        for epoch in range(num_epochs):
            if len(rows) >= max_num_samples:
                break
            if epoch > 0 and not rows:  # (an empty epoch repeats forever in Megatron-Core)
                break
            for doc in range(len(docs) - 1):
                first, last = int(docs[doc]), int(docs[doc + 1])
                remain = last - first
                long_sentence = remain > 1 and any(int(sizes[s]) > 512 for s in range(first, last))
                if remain < min_num_sent or long_sentence:
                    continue
                seq_len, num_sent, start = 0, 0, first
                goal = target(gen)
                for s in range(first, last):
                    seq_len += int(sizes[s])
                    num_sent += 1
                    remain -= 1
                    if (seq_len >= goal and remain > 1 and num_sent >= min_num_sent) or remain == 0:
                        rows.append([start, s + 1, goal])
                        start = s + 1
                        goal = target(gen)
                        seq_len, num_sent = 0, 0
        if second:
            maps = rows
    gen64 = MT19937_64(seed + 1)
    for i in range(len(maps) - 1, 0, -1):
        j = gen64() % (i + 1)
        maps[i], maps[j] = maps[j], maps[i]
    return np.array(maps, dtype=np.uint32).reshape(-1, 3)


def reference_sample(sentences, target, idx, seed, seq_length, tok, binary_head,
                     mask_prob=0.15, max_ngram=3):
    """bert_dataset.py ``__getitem__`` + masked_dataset.py masking, for one mapping row."""
    rng = np.random.RandomState(seed=(seed + idx) % 2**32)
    pivot, is_random = len(sentences), False
    if binary_head:
        pivot = 1
        if len(sentences) >= 3:
            pivot = rng.randint(low=1, high=len(sentences))
        is_random = rng.random() < 0.5
    a = [t for s in sentences[:pivot] for t in s]
    b = [t for s in sentences[pivot:] for t in s]
    if is_random:
        a, b = b, a
    truncated = len(a) + len(b) > target
    while len(a) + len(b) > target:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            del longer[-1]
    tokens = [tok.cls] + a + [tok.sep]
    types = [0] * (len(a) + 2)
    if b:
        tokens += b + [tok.sep]
        types += [1] * (len(b) + 1)

    # Masking: candidates, budget, n-gram lists, two shuffles.
    candidates = []
    for i, t in enumerate(tokens):
        if t in (tok.cls, tok.sep):
            continue
        if tok.inv_vocab[t].startswith("##") and candidates:
            candidates[-1].append(i)
        else:
            candidates.append([i])
    budget = min(mask_prob * target, max(1, int(round(len(tokens) * mask_prob))))
    nvals = np.arange(max_ngram, dtype=np.int64) + 1
    nprobs = 1.0 / nvals
    nprobs = nprobs / nprobs.sum(keepdims=True)
    ngrams = [[candidates[i:i + n] for n in nvals] for i in range(len(candidates))]
    rng.shuffle(ngrams)
    masked = list(tokens)
    chosen = []
    covered = set()
    for grams in ngrams:
        if len(chosen) >= budget:
            break
        p = nprobs[:len(grams)] / nprobs[:len(grams)].sum(keepdims=True)
        n = rng.choice(nvals[:len(grams)], p=p)
        while True:
            span = sum(grams[n - 1], [])
            n -= 1
            if budget >= len(chosen) + len(span):
                skip = False
                break
            if n == 0:
                skip = True
                break
        if skip or any(i in covered for i in span):
            continue
        for i in span:
            covered.add(i)
            if rng.random() < 0.8:
                masked[i] = tok.mask
            elif rng.random() >= 0.5:
                lookup = list(tok.inv_vocab.keys())
                masked[i] = lookup[rng.randint(0, len(lookup))]
            chosen.append((i, tokens[i]))
    chosen.sort()

    pads = seq_length - len(masked)
    labels = np.full(seq_length, -1, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.int64)
    for i, original in chosen:
        labels[i] = original
        loss_mask[i] = 1
    return {"text": np.array(masked + [tok.pad] * pads, dtype=np.int64),
            "types": np.array(types + [0] * pads, dtype=np.int64),
            "labels": labels, "is_random": int(is_random),
            "padding_mask": np.array([1] * len(masked) + [0] * pads, dtype=np.int64),
            "loss_mask": loss_mask, "truncated": int(truncated)}
