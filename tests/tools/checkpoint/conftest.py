"""Fixtures of the checkpoint-tool tests: the GPT-2-tokenized corpus of the training tests."""

from tests.training.conftest import gpt2_corpus  # noqa: F401 - a fixture, shared
