"""Fixtures of the end-to-end training tests: a small GPT-2-tokenized slice of the shared corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.training import e2e

_SLICE_BYTES = 300_000


@pytest.fixture(scope="session")
def gpt2_corpus(shared_data, tmp_path_factory) -> e2e.Corpus:
    """~300 KB of tinyshakespeare, tokenized once per session by tools/preprocess_data.py with
    the real GPT-2 BPE files (paragraph runs as documents, end-of-document tokens appended)."""
    from tools import preprocess_data

    tok = shared_data / "tokenizers"
    vocab, merges = tok / "gpt2-vocab.json", tok / "gpt2-merges.txt"
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    paragraphs = text[:_SLICE_BYTES].split("\n\n")
    docs = ["\n\n".join(paragraphs[i:i + 8]) for i in range(0, len(paragraphs), 8)]
    out = tmp_path_factory.mktemp("gpt2_corpus")
    src = out / "shakespeare.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prefix = out / "shakespeare"
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(prefix),
                               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                               "--merge-file", str(merges), "--append-eod", "--workers", "1"])
    assert rc == 0, f"preprocess_data exited {rc}"
    data_prefix = Path(f"{prefix}_text_document")
    assert data_prefix.with_suffix(".bin").is_file() and data_prefix.with_suffix(".idx").is_file()
    return e2e.Corpus(prefix=str(data_prefix), vocab_file=str(vocab), merge_file=str(merges),
                      cache_dir=str(out / "index-cache"))
