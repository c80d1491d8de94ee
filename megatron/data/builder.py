"""Train/valid/test datasets of any dataset kind (Megatron-Core ``BlendedMegatronDatasetBuilder``).

The config says where the data comes from, in one of three ways: mock data; ``blend`` (prefixes
cut into train/valid/test by the ``split`` book-ends); or ``blend_per_split`` (prefixes per
split, each used whole). Several prefixes in a split become a :class:`BlendedDataset` over one
component dataset per prefix. The builder knows no dataset kind: it only calls the
:class:`MegatronDataset` subclass it is given (``build_low_level_dataset``,
``numel_low_level_dataset``, the constructor).

Every rank builds its datasets; index files are built by rank 0 and loaded by the others
(see :mod:`megatron.data.index_cache`).
"""

from __future__ import annotations

import math
from typing import Any

from megatron.data.blended_dataset import BlendedDataset
from megatron.data.dataset_config import Blend, BlendedMegatronDatasetConfig
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.megatron_dataset import MegatronDataset
from megatron.data.utils import Split, normalize, split_indices

Bookends = tuple[float, float]
SplitDataset = MegatronDataset | BlendedDataset


def samples_for_target(target: int, weight: float) -> int:
    """``ceil(target * w)``: the samples a blended split takes from one component."""
    return int(math.ceil(target * weight))


def samples_for_blend(target: int, weight: float, surplus: float) -> int:
    """Samples built per blended component: ``ceil(ceil(target * w) * (1 + surplus))``."""
    return int(math.ceil(math.ceil(target * weight) * (1 + surplus)))


def _check_prefixes(prefixes: list[str], flag: str) -> None:
    """Every prefix has its .bin/.idx (before any rank starts an index build)."""
    missing = [p for p in prefixes if not IndexedDataset.exists(p)]
    if missing:
        raise ValueError(f"{flag}: no dataset {missing[0]}.bin/.idx (give the prefix without "
                         "the extension)")


class BlendedMegatronDatasetBuilder:
    """Builds the [train, valid, test] datasets of ``cls`` that ``config`` describes.

    Args:
        cls: the dataset kind (a :class:`MegatronDataset` subclass).
        sizes: samples wanted per split (None: every sample of the split once).
        config: where the data comes from and how it is split.
    """

    def __init__(self, cls: type[MegatronDataset], sizes: list[int | None],
                 config: BlendedMegatronDatasetConfig) -> None:
        self.cls = cls
        self.sizes = list(sizes)
        self.config = config
        self._low_level: dict[str | None, Any] = {}

    def _low_level_dataset(self, prefix: str | None):
        """Each prefix's low-level dataset, opened (and its index checked) once per build, as
        Megatron-Core does, however many splits of a blend cut it."""
        if prefix not in self._low_level:
            self._low_level[prefix] = self.cls.build_low_level_dataset(prefix, self.config)
        return self._low_level[prefix]

    def build(self) -> list[SplitDataset | None]:
        """The train, valid and test datasets; None for a split with no data.

        Raises:
            ValueError: a missing prefix (naming its flag), a weighted blend without a sample
                count, or a component too small for its share of the blend.
        """
        if self.config.mock:
            return self._splits_of_prefix(None, self.config.split_matrix, self.sizes)
        if self.config.blend is not None:
            return self._build_blend(self.config.blend)
        return [None if blend is None else self._build_split_blend(split, blend)
                for split, blend in zip(Split, self.config.blend_per_split)]

    def _build_blend(self, blend: Blend) -> list[SplitDataset | None]:
        """--data-path: every split cut from the same prefixes by the --split book-ends."""
        prefixes, weights = blend
        if weights is not None:
            weights = normalize(weights)
        _check_prefixes(prefixes, "--data-path")
        matrix = self.config.split_matrix
        if len(prefixes) == 1 and weights is None:
            return self._splits_of_prefix(prefixes[0], matrix, self.sizes)
        return [None if matrix[i] is None else
                self._blend_split(prefixes, weights, matrix, self.sizes, split)
                for i, split in enumerate(Split)]

    def _build_split_blend(self, split: Split, blend: Blend) -> SplitDataset:
        """--{split}-data-path: all of each prefix goes to ``split``."""
        prefixes, weights = blend
        _check_prefixes(prefixes, f"--{split.name}-data-path")
        weights = normalize(weights) if weights is not None else None
        matrix: list[Bookends | None] = [None] * len(Split)
        matrix[split.value] = (0.0, 1.0)
        sizes: list[int | None] = [0] * len(Split)
        sizes[split.value] = self.sizes[split.value]
        if len(prefixes) == 1:
            return self._splits_of_prefix(prefixes[0], matrix, sizes)[split.value]
        return self._blend_split(prefixes, weights, matrix, sizes, split)

    def _splits_of_prefix(self, prefix: str | None, matrix: list[Bookends | None],
                          sizes: list[int | None]) -> list[MegatronDataset | None]:
        """Every split of one low-level dataset (None where no book-ends)."""
        low = self._low_level_dataset(prefix)
        n = self.cls.numel_low_level_dataset(low)
        return [None if matrix[i] is None else
                self.cls(low, prefix, split_indices(matrix[i], n), sizes[i], split, self.config)
                for i, split in enumerate(Split)]

    def _component(self, prefix: str, bookends: Bookends, num_samples: int | None,
                   split: Split) -> MegatronDataset:
        """One split of one component of a blend."""
        low = self._low_level_dataset(prefix)
        indices = split_indices(bookends, self.cls.numel_low_level_dataset(low))
        return self.cls(low, prefix, indices, num_samples, split, self.config)

    def _blend_split(self, prefixes: list[str], weights: list[float] | None,
                     matrix: list[Bookends | None], sizes: list[int | None],
                     split: Split) -> BlendedDataset:
        """One split of a multi-prefix blend (weights already normalised, or None).

        Weighted: each component gets its share plus the surplus, the blend exactly
        ``sum_i ceil(target * w_i)``. Unweighted: every component whole, in proportion to
        its length, capped at the requested count.
        """
        bookends, target = matrix[split.value], sizes[split.value]
        if weights is not None:
            if target is None:
                raise ValueError("weighted blends need a sample count per split")
            surplus = self.config.mid_level_dataset_surplus
            parts = [self._component(p, bookends, samples_for_blend(target, w, surplus), split)
                     for p, w in zip(prefixes, weights)]
            targets = [samples_for_target(target, w) for w in weights]
            return BlendedDataset(parts, weights, sum(targets), self.config)
        parts = [self._component(p, bookends, None, split) for p in prefixes]
        lengths = [len(p) for p in parts]
        size = None if target is None else min(target, sum(lengths))
        return BlendedDataset(parts, lengths, size, self.config)
