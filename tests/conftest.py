"""Shared pytest configuration: the shared data directory and thread limits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("MEGATRON_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (real tokenizer files and corpus); tests skip only where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data directory {SHARED_DATA} is absent")
    return SHARED_DATA
