"""Shared pytest configuration: the shared directory (data, Megatron-LM references)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("MEGATRON_SHARED", REPO.parent / "shared"))
SHARED_DATA = Path(os.environ.get("MEGATRON_SHARED_DATA", SHARED / "data"))

# Every collective of every process the suite starts (pooled worlds, torchrun jobs) checks what
# NCCL requires and gloo forgives (megatron/core/comm.py): a gloo run fails where an NCCL one would.
os.environ.setdefault("MEGATRON_CHECK_COLLECTIVES", "1")


@pytest.fixture(scope="session", autouse=True)
def children_take_sigint():
    """Processes the tests start get SIGINT's default action even when the suite itself runs
    as a background job of a non-interactive shell (``pytest ... &``, nohup), which starts it
    with SIGINT ignored: an ignored signal stays ignored across exec, so the SIGINT tests'
    trainers would keep running. A handled one is reset to the default at exec."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (real tokenizer files and corpus); tests skip only where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data directory {SHARED_DATA} is absent")
    return SHARED_DATA


@pytest.fixture(scope="session")
def megatron_flags_md() -> Path:
    """``../shared/MEGATRON_FLAGS.md``, Megatron-LM 23.06's flag table; tests skip only where it
    is absent."""
    path = SHARED / "MEGATRON_FLAGS.md"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return path


@pytest.fixture
def megatron_log():
    """Records of the framework's logger at INFO and above (it may not propagate to pytest's
    handlers)."""
    from megatron.core.log import get_logger

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
