"""Fixtures of the checkpoint-tool tests: the GPT-2-tokenized corpus of the training tests (the
framework's log records are tests/conftest.py's ``megatron_log``)."""

from tests.training.conftest import gpt2_corpus  # noqa: F401 - a fixture, shared
