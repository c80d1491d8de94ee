"""Fixtures of the fuzzer's tests: the GPT-2-tokenized corpus slice of the end-to-end tests."""

from __future__ import annotations

import dataclasses

import pytest

from tests.training import e2e


@pytest.fixture(scope="session")
def fuzz_data(shared_data, tmp_path_factory) -> dict[str, str]:
    """The corpus as the fuzzer's dict (prefix, vocab_file, merge_file, cache_dir)."""
    corpus = e2e.build_gpt2_corpus(shared_data, tmp_path_factory.mktemp("fuzz_corpus"))
    return dataclasses.asdict(corpus)
