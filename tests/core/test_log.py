"""megatron.core.log: which rank writes each helper's line."""

from __future__ import annotations

import io
import logging

import pytest

from megatron.core import log
from tests.multiprocess import run_distributed


def _capture(fn):
    """Lines ``fn`` logs through megatron's logger (its own handlers stay in place)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = log.get_logger()
    logger.addHandler(handler)
    saved = logger.level
    logger.setLevel(logging.INFO)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
    return stream.getvalue().splitlines()


def _log_everything():
    log.log_rank_0("to rank zero")
    log.log_rank_last("to the last rank")
    log.log_all_ranks("to every rank")
    log.warn_rank_0("careful")


def _log_on_ranks(rank, world_size):
    return _capture(_log_everything)


def test_helpers_pick_their_rank_on_two_ranks():
    rank0, rank1 = run_distributed(2, _log_on_ranks)
    assert rank0 == ["INFO to rank zero", "INFO [rank 0] to every rank", "WARNING WARNING: careful"]
    assert rank1 == ["INFO to the last rank", "INFO [rank 1] to every rank"]


def test_single_process_is_rank_zero_and_last(monkeypatch):
    """Before torch.distributed starts (tools, single-process runs) one process is both."""
    monkeypatch.setattr(log, "_dist", lambda: None)
    assert _capture(_log_everything) == [
        "INFO to rank zero", "INFO to the last rank", "INFO [rank 0] to every rank",
        "WARNING WARNING: careful"]


@pytest.mark.parametrize("name", ["megatron", "megatron.tools"])
def test_get_logger_is_idempotent(name):
    logger = log.get_logger(name)
    handlers = list(logger.handlers)
    assert log.get_logger(name) is logger and logger.handlers == handlers
