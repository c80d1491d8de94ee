"""The config every Megatron dataset shares (Megatron-Core ``BlendedMegatronDatasetConfig``).

The data layer owns its typed configs: this base holds what the builder and every dataset
need (seed, sequence length, blends, split, cache directory); each dataset kind subclasses it
with its own fields (``GPTDatasetConfig``: masks; a BERT config: masking). The caller fills
them from its flags (``megatron/config/datasets.py``); nothing here reads the CLI config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.data.utils import parse_and_normalize_split, split_matrix

Blend = tuple[list[str], list[float] | None]
"""Dataset prefixes and their weights (None: unweighted, each used whole)."""


@dataclasses.dataclass(kw_only=True)
class BlendedMegatronDatasetConfig:
    """What :class:`~megatron.data.builder.BlendedMegatronDatasetBuilder` and every
    :class:`~megatron.data.megatron_dataset.MegatronDataset` need.

    Without ``blend`` and ``blend_per_split`` the config describes mock data (``mock`` is set
    and the split is Megatron-Core's even ``"1,1,1"``).

    Raises:
        ValueError: a sequence length below 2, ``blend`` together with ``blend_per_split``,
            or a missing/invalid ``split`` for ``blend``.
    """

    random_seed: int
    """Seed of the index shuffles (--seed)."""
    sequence_length: int
    """Tokens per sample (--seq-length)."""
    tokenizer: Any = None
    """The tokenizer (its ``unique_identifiers``, if any, go into the cache descriptions)."""
    blend: Blend | None = None
    """Prefixes split by ``split`` into train/valid/test (--data-path)."""
    blend_per_split: list[Blend | None] | None = None
    """One blend per split, used whole (--train/valid/test-data-path)."""
    split: str | None = None
    """Train/valid/test proportions of ``blend``, e.g. ``"969,30,1"`` (--split)."""
    path_to_cache: str | None = None
    """Directory of the index caches (--data-cache-path); None: beside the data."""
    mmap_bin_files: bool = True
    """Read the .bin files through mmap (--no-mmap-bin-files)."""
    mock: bool = False
    """Synthetic data instead of files (set when no blend is given)."""
    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built per blended component, so the blend never runs short."""
    split_matrix: list[tuple[float, float] | None] | None = dataclasses.field(init=False,
                                                                              default=None)
    """Book-ends of each split of ``blend``, derived from ``split``."""

    def __post_init__(self) -> None:
        if self.sequence_length is None or self.sequence_length < 2:
            raise ValueError(f"--seq-length must be >= 2, got {self.sequence_length}")
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise ValueError("--data-path cannot be combined with --train/valid/test-data-path")
            self.split = None
            return
        if self.blend is None:
            self.mock = True
            self.split = "1,1,1"  # Megatron-Core's arbitrary even split for mock data
        if self.split is None:
            raise ValueError("--split is required with --data-path")
        self.split_matrix = split_matrix(parse_and_normalize_split(self.split))
