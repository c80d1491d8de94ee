"""The one error type of the checkpoint package (a ``ValueError``: the user's file or flags)."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, unsafe, or does not match the flags."""


def corrupt_file_error(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"corrupt or truncated checkpoint file {path}: {why}")
