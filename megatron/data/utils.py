"""Split and blend parsing shared by the dataset builders (Megatron-Core semantics)."""

from __future__ import annotations

import enum
import re

import numpy as np


class Split(enum.Enum):
    """The three dataset splits, in --split order."""

    train = 0
    valid = 1
    test = 2


def normalize(weights: list[float]) -> list[float]:
    """Divide by the sum in float64 (the exact operations Megatron-Core uses)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_and_normalize_split(split: str) -> list[float]:
    """``"969, 30, 1"`` (or ``"969/30/1"``) -> ``[0.969, 0.03, 0.001]``; missing parts are 0.

    Raises:
        ValueError: more than three parts, or all zero.
    """
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if len(parts) > len(Split) or not parts or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected up to 3 non-negative weights with a "
                         "positive sum, e.g. '969,30,1'")
    parts += [0.0] * (len(Split) - len(parts))
    return normalize(parts)


def split_matrix(vector: list[float]) -> list[tuple[float, float] | None]:
    """``[0.9, 0.1, 0.0]`` -> ``[(0, 0.9), (0.9, 1.0), None]``: book-ends of each split."""
    edges: list[float] = [0]
    for v in vector:
        edges.append(edges[-1] + v)  # cumulative sums as Python floats, as Megatron-Core
    return [(beg, end) if end > beg else None for beg, end in zip(edges[:-1], edges[1:])]


def split_indices(bookends: tuple[float, float], num_elements: int) -> np.ndarray:
    """int32 ``arange(round(beg*N), round(end*N))`` of one split."""
    beg = int(round(bookends[0] * float(num_elements)))
    end = int(round(bookends[1] * float(num_elements)))
    return np.arange(beg, end, dtype=np.int32)


def get_blend_from_list(blend: list[str] | None,
                        flag: str = "--data-path") -> tuple[list[str], list[float] | None] | None:
    """``["0.3", "a", "0.7", "b"]`` -> ``(["a", "b"], [0.3, 0.7])``; ``["a", "b"]`` -> (.., None).

    Raises:
        ValueError: some but not all weights parse as numbers.
    """
    if not blend:
        return None
    if len(blend) % 2 == 1:
        return [p.strip() for p in blend], None
    raw_weights, prefixes = blend[0::2], blend[1::2]
    weights: list[float | None] = []
    for w in raw_weights:
        try:
            weights.append(float(w))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return [p.strip() for p in blend], None
    if any(w is None for w in weights):
        raise ValueError(f"{flag} {' '.join(blend)}: give either prefixes only, or "
                         "'weight prefix' pairs for every dataset")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{flag}: weights must be non-negative with a positive sum, got {weights}")
    return [p.strip() for p in prefixes], weights  # type: ignore[return-value]
