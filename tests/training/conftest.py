"""Fixtures of the end-to-end training tests: a small GPT-2-tokenized slice of the shared corpus."""

from __future__ import annotations

import pytest

from tests.training import e2e


@pytest.fixture(scope="session")
def gpt2_corpus(shared_data, tmp_path_factory) -> e2e.Corpus:
    """~300 KB of tinyshakespeare, tokenized once per session by tools/preprocess_data.py with
    the real GPT-2 BPE files (paragraph runs as documents, end-of-document tokens appended)."""
    return e2e.build_gpt2_corpus(shared_data, tmp_path_factory.mktemp("gpt2_corpus"))
