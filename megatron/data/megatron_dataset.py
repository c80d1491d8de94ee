"""The base of every dataset the builder makes (Megatron-Core ``MegatronDataset``).

A MegatronDataset is one split of one low-level dataset (an ``IndexedDataset`` or mock data):
the builder opens the low-level dataset with :meth:`MegatronDataset.build_low_level_dataset`,
cuts it with :meth:`MegatronDataset.numel_low_level_dataset` and the split book-ends, and
constructs the subclass on the split's indices. The base names the dataset: its
``unique_description`` (JSON) and that text's md5 name the index cache files exactly as
Megatron-Core names them, so either framework finds the other's caches.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from megatron.data.dataset_config import BlendedMegatronDatasetConfig
from megatron.data.utils import Split


def describe(obj: Any) -> Any:
    """JSON form of a value inside a description: its ``unique_identifiers``, else its class."""
    return getattr(obj, "unique_identifiers", {"class": type(obj).__name__})


class MegatronDataset(abc.ABC, torch.utils.data.Dataset):
    """One split of one low-level dataset.

    Args:
        dataset: the low-level dataset.
        dataset_path: its prefix (bookkeeping, default cache location), None for mock data.
        indices: int32 ids of this split's elements of ``dataset``.
        num_samples: samples requested (None: one epoch).
        index_split: which split.
        config: the dataset config.
    """

    def __init__(self, dataset: Any, dataset_path: str | None, indices: np.ndarray,
                 num_samples: int | None, index_split: Split,
                 config: BlendedMegatronDatasetConfig) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("dataset_path", dataset_path),
             ("num_samples", num_samples), ("index_split", index_split.name)]
            + [(k, getattr(config, k)) for k in self._key_config_attributes()])
        self.unique_description = json.dumps(self.unique_identifiers, indent=4, default=describe)
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8")).hexdigest()

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """Config attributes that change the indices, in description order (subclasses append
        theirs, e.g. BERT's masking parameters)."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    def _cache_dir(self) -> str | None:
        """Where the index caches go: --data-cache-path, else beside the data; None: not cached."""
        if self.config.path_to_cache:
            return self.config.path_to_cache
        if self.config.mock or self.dataset_path is None:
            return None
        return os.path.join(self.dataset_path, "cache", f"{type(self).__name__}_indices")

    @staticmethod
    @abc.abstractmethod
    def numel_low_level_dataset(low_level: Any) -> int:
        """How many elements the split book-ends divide (sequences for GPT, documents for BERT)."""

    @staticmethod
    @abc.abstractmethod
    def build_low_level_dataset(dataset_path: str | None,
                                config: BlendedMegatronDatasetConfig) -> Any:
        """The low-level dataset at ``dataset_path`` (None for mock data).

        Raises:
            ValueError: missing or unusable files.
        """

    @abc.abstractmethod
    def __len__(self) -> int:
        """Samples this split holds."""

    @abc.abstractmethod
    def __getitem__(self, idx: int) -> dict[str, Any]:
        """Sample ``idx`` as named tensors."""
