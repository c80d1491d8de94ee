"""Dataset read throughput (GPTDataset vs a plain seek/read baseline) and index build time
(C++ helpers vs the numpy fallback), measured in the same run.

Usage: PYTHONPATH=. .venv/bin/python bench/bench_dataset.py [--samples 3000] [--seq-length 1024]
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time
import types

import numpy as np

from megatron.data import helpers
from megatron.data.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTLowLevelDataset, build_gpt_indices
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.utils import Split

EOD = 256
CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "corpus")


def make_dataset(prefix: str) -> None:
    """Bytes-as-tokens dataset of the shared corpus, one document per paragraph."""
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for path in sorted(glob.glob(os.path.join(CORPUS, "**", "*.txt"), recursive=True)):
        with open(path, "rb") as f:
            for para in f.read().split(b"\n\n"):
                b.add_document(np.append(np.frombuffer(para, np.uint8).astype(np.uint16), EOD),
                               [len(para) + 1])
    b.finalize(prefix + ".idx")


def baseline_read(prefix: str, ds: GPTDataset, n: int) -> float:
    """Plain Python: same samples, pieces read with file.seek/read, no masks. Returns samples/s."""
    low = IndexedDataset(prefix)
    ptrs, sizes = low.pointers.tolist(), low.sizes.tolist()
    doc_index, sample_index = ds.document_index.tolist(), ds.sample_index.tolist()
    shuffle = ds.shuffle_index.tolist()
    t0 = time.perf_counter()
    with open(prefix + ".bin", "rb") as f:
        for i in range(n):
            j = shuffle[i]
            (d0, o0), (d1, o1) = sample_index[j], sample_index[j + 1]
            parts = []
            for d in range(d0, d1 + 1):
                doc = doc_index[d]
                beg = o0 if d == d0 else 0
                end = o1 + 1 if d == d1 else sizes[doc]
                f.seek(ptrs[doc] + 2 * beg)
                parts.append(np.frombuffer(f.read(2 * (end - beg)), dtype=np.uint16))
            np.concatenate(parts).astype(np.int64)
    return n / (time.perf_counter() - t0)


def dataset_read(ds: GPTDataset, n: int) -> float:
    ds[0]
    t0 = time.perf_counter()
    for i in range(n):
        ds[i]
    return n / (time.perf_counter() - t0)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--seq-length", type=int, default=1024)
    args = p.parse_args()
    tok = types.SimpleNamespace(eod=EOD, vocab_size=257)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "corpus")
        make_dataset(prefix)
        low = IndexedDataset(prefix)
        rows = []
        for mask in (False, True):
            cfg = GPTDatasetConfig(random_seed=1234, sequence_length=args.seq_length, tokenizer=tok,
                                   blend=([prefix], None), split="1,0,0",
                                   path_to_cache=os.path.join(tmp, "cache"), create_attention_mask=mask)
            ds = GPTDataset(low, prefix, np.arange(len(low), dtype=np.int32), args.samples,
                            Split.train, cfg)
            n = min(args.samples, len(ds))
            rows.append((f"GPTDataset.__getitem__ (attention mask {'on' if mask else 'off'})",
                         dataset_read(ds, n)))
        rows.append(("plain Python seek/read baseline (tokens only)", baseline_read(prefix, ds, n)))
        print(f"\nread throughput, seq_length {args.seq_length}, {n} samples, "
              f"{int(low.sizes.sum())} tokens, {len(low)} documents")
        for name, rate in rows:
            print(f"| {name} | {rate:,.0f} samples/s |")

    mock = MockGPTLowLevelDataset(tok)
    docs = np.arange(len(mock), dtype=np.int32)
    print("\nindex build time (100k mock documents, 205M tokens, seq 1024)")
    for num_samples in (200_000, 2_000_000):
        t = {c: timed(lambda c=c: build_gpt_indices(mock.sequence_lengths, docs, num_samples, 1024,
                                                     1234, use_cpp=c)) for c in (True, False)}
        print(f"| GPT indices, {num_samples:,} samples | C++ {t[True]:.3f} s | numpy {t[False]:.3f} s |")
    for k, n in ((2, 2_000_000), (3, 2_000_000)):
        w = np.arange(1, k + 1, dtype=np.float64)
        w /= w.sum()
        t = {}
        for c in (True, False):
            di, dsi = np.zeros(n, np.int16), np.zeros(n, np.int64)
            t[c] = timed(lambda: helpers.build_blending_indices(di, dsi, w, k, n, use_cpp=c))
        print(f"| blending, {k} datasets, {n:,} samples | C++ {t[True]:.3f} s | numpy {t[False]:.3f} s |")


if __name__ == "__main__":
    main()
