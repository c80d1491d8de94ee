"""Rank-aware logging: library code logs through here, never with ``print``.

``log_rank_0`` writes on global rank 0 only (or everywhere before torch.distributed starts);
``log_rank_last`` on the last rank (which holds the loss with pipeline parallelism);
``log_all_ranks`` prefixes the rank.
"""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(message)s"


def get_logger(name: str = "megatron") -> logging.Logger:
    """A logger writing plain lines to stdout (Megatron-LM's log lines go to stdout)."""
    logger = logging.getLogger(name)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def _dist():
    # Without torch loaded no process group can exist; not importing it keeps tools that only
    # log (preprocess_data) fast to start.
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def _world() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else 1


def log_rank_0(message: str, level: int = logging.INFO) -> None:
    """Log on global rank 0 only."""
    if _rank() == 0:
        get_logger().log(level, message)
        _flush()


def log_rank_last(message: str, level: int = logging.INFO) -> None:
    """Log on the last global rank only."""
    if _rank() == _world() - 1:
        get_logger().log(level, message)
        _flush()


def log_all_ranks(message: str, level: int = logging.INFO) -> None:
    """Log on every rank, prefixed with the rank."""
    get_logger().log(level, f"[rank {_rank()}] {message}")
    _flush()


def warn_rank_0(message: str) -> None:
    log_rank_0("WARNING: " + message, logging.WARNING)


def _flush() -> None:
    for handler in get_logger().handlers:
        handler.flush()
