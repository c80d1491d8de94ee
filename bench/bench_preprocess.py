"""Preprocessing throughput: tools/preprocess_data.py (1 and 2 workers) against a plain-Python
GPT-2 BPE pipeline (Megatron-LM's approach: json.loads + a per-word-cached Python BPE loop +
array writes), on JSON lines built from the shared corpus, in one run.

    python bench/bench_preprocess.py [--size-mib 20] [--baseline-mib 2]

The baseline runs on a --baseline-mib prefix of the same file (it is ~10x slower); rates are
comparable because both are per byte of input. Tool figures: "end to end" is the wall time
of the whole command (interpreter start, imports, tokenizer load, writing, exit); "encoding" is
the tool's own rate from its summary line (Megatron-LM's MB/s counts the same span).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.reference_gpt2 import ReferenceGPT2  # noqa: E402

SHARED = Path(os.environ.get("MEGATRON_SHARED_DATA", REPO.parent / "shared" / "data"))
TOKENIZERS = SHARED / "tokenizers"


def build_corpus(path: Path, size_mib: float, seed: int = 0) -> int:
    """JSON lines of 1-12 consecutive paragraphs of the shared corpus; returns the doc count."""
    paras = []
    for file in sorted((SHARED / "corpus").rglob("*.txt")):
        paras += file.read_text(encoding="utf-8").split("\n\n")
    rng = random.Random(seed)
    size, i, docs = 0, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < size_mib * 2**20:
            n = rng.randint(1, 12)
            line = json.dumps({"text": "\n\n".join(paras[i:i + n])}, ensure_ascii=False) + "\n"
            i = (i + n) % len(paras)
            f.write(line)
            size += len(line.encode())
            docs += 1
    return docs


def baseline(path: Path, limit_bytes: int) -> tuple[int, int, float]:
    """Plain-Python pipeline on the first ``limit_bytes``: (docs, bytes, seconds)."""
    bpe = ReferenceGPT2(str(TOKENIZERS / "gpt2-vocab.json"), str(TOKENIZERS / "gpt2-merges.txt"))
    docs = nbytes = 0
    start = time.perf_counter()
    with open(path, encoding="utf-8") as f, tempfile.TemporaryFile() as out:
        for line in f:
            ids = bpe.encode(json.loads(line)["text"]) + [50256]
            out.write(np.array(ids, dtype=np.uint16).tobytes())
            docs += 1
            nbytes += len(line.encode())
            if nbytes >= limit_bytes:
                break
    return docs, nbytes, time.perf_counter() - start


def run_tool(path: Path, out_dir: Path, workers: int) -> tuple[float, float]:
    """(end-to-end wall seconds, the tool's own encoding MB/s)."""
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(path),
           "--output-prefix", str(out_dir / f"w{workers}"), "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", str(TOKENIZERS / "gpt2-vocab.json"),
           "--merge-file", str(TOKENIZERS / "gpt2-merges.txt"), "--append-eod",
           "--workers", str(workers), "--log-interval", "1000000"]
    start = time.perf_counter()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    rate = float(re.search(r"Done: .*\(([\d.]+) docs/s, ([\d.]+) MB/s\)", done.stderr).group(2))
    return wall, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=float, default=20.0, help="corpus size for the tool")
    parser.add_argument("--baseline-mib", type=float, default=2.0, help="prefix for the baseline")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        docs = build_corpus(corpus, args.size_mib)
        size = corpus.stat().st_size
        print(f"corpus: {docs} documents, {size / 2**20:.1f} MiB of JSON lines, "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        b_docs, b_bytes, b_sec = baseline(corpus, int(args.baseline_mib * 2**20))
        print(f"{'pipeline':44s} {'docs/s':>9s} {'MiB/s':>7s}  {'speed-up':>8s}")
        b_rate = b_bytes / 2**20 / b_sec
        print(f"{'plain-Python BPE, 1 process':44s} {b_docs / b_sec:9.0f} {b_rate:7.2f}  {1:8.1f}")
        for workers in (1, 2):
            wall, enc_rate = run_tool(corpus, tmp, workers)
            e2e = size / 2**20 / wall
            print(f"{f'preprocess_data.py --workers {workers}, end to end':44s} {docs / wall:9.0f} "
                  f"{e2e:7.2f}  {e2e / b_rate:8.1f}")
            print(f"{f'preprocess_data.py --workers {workers}, encoding':44s} "
                  f"{enc_rate * 2**20 / size * docs:9.0f} {enc_rate:7.2f}  {enc_rate / b_rate:8.1f}")
        same = (tmp / "w1_text_document.bin").read_bytes() == (tmp / "w2_text_document.bin").read_bytes()
        print(f"outputs of 1 and 2 workers identical: {same}")


if __name__ == "__main__":
    main()
