"""Fixtures of the checkpoint-tool tests: the GPT-2-tokenized corpus of the training tests, and
the framework's log records."""

import logging

import pytest

from megatron.core.log import get_logger
from tests.training.conftest import gpt2_corpus  # noqa: F401 - a fixture, shared


@pytest.fixture
def megatron_log():
    """Records of the framework's logger (it may not propagate to pytest's handlers)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = get_logger()
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
