"""Functions that run eagerly when called inside a region ``torch.compile`` traces.

``torch.compiler.disable`` marks such a function (a graph break), but calling it imports
TorchDynamo, which costs every process that never compiles (every rank of every run without
``--compile-layers``, every tool) about two seconds at start-up. So the functions are
registered here at import and marked only when something is about to be compiled
(:func:`mark_all`, called by the layers built with ``compile_layers``).
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_REGISTERED: list[Callable] = []
_EAGER: dict[Callable, Callable] = {}


def eager_region(function: F) -> F:
    """``function``; inside a traced region, its eager form (a graph break)."""
    _REGISTERED.append(function)

    @functools.wraps(function)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            eager = _EAGER.get(function)
            if eager is None:
                raise RuntimeError(
                    f"{function.__qualname__} is traced by torch.compile before "
                    "megatron.core.eager_regions.mark_all() ran (call it before compiling)")
            return eager(*args, **kwargs)
        return function(*args, **kwargs)

    return call  # type: ignore[return-value]


def mark_all() -> None:
    """Mark every registered function as eager for TorchDynamo (imports it; idempotent)."""
    for function in _REGISTERED:
        if function not in _EAGER:
            _EAGER[function] = torch.compiler.disable(function)
