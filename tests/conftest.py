"""Shared pytest configuration: the shared directory (data, Megatron-LM references)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("MEGATRON_SHARED", REPO.parent / "shared"))
SHARED_DATA = Path(os.environ.get("MEGATRON_SHARED_DATA", SHARED / "data"))


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
