"""Shared by the kernel tests that need the CPU extension itself (not its fallback)."""

from __future__ import annotations

import importlib

import pytest

from megatron.core.fusions import kernels

CPU_EXTENSION = kernels.EXTENSIONS["cpu"]


@pytest.fixture(scope="module")
def cpu_extension_built():
    """The CPU extension imports (the install step builds it: a missing one is a broken
    install, so this fails rather than skips), with the loader's cache cleared."""
    try:
        importlib.import_module(CPU_EXTENSION)
    except ImportError as exc:
        pytest.fail(f"{CPU_EXTENSION} is not built ({exc}); run scripts/bootstrap.sh")
    kernels.reset()
