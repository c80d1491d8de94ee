"""Blending of several datasets by weight, and the train/valid/test split builder.

``--data-path 0.3 a 0.7 b``: weights are normalised; each component split is built with
``ceil(ceil(target * w_i) * 1.005)`` samples; :class:`BlendedDataset` then draws
``sum_i ceil(target * w_i)`` samples with Megatron-Core's greedy rule (each sample goes to the
component lagging its weight the most), so per-component counts follow the weights to within
one sample. Indices are cached like the GPT ones (``{md5}-BlendedDataset-{split}-...``).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from megatron.core.log import log_rank_0, warn_rank_0
from megatron.data import helpers
from megatron.data.index_cache import cached_arrays
from megatron.data.utils import Split, normalize, split_indices


class BlendedDataset(torch.utils.data.Dataset):
    """Samples drawn from ``datasets`` in proportion to ``weights``.

    Args:
        datasets: component datasets of one split (all the same class).
        weights: blend weights (normalised here), or exact integer sample counts when size is None.
        size: number of samples; None = exhaust every component exactly ``weights[i]`` times.
        config: the dataset config (``path_to_cache``).

    Raises:
        ValueError: a component is asked for more samples than it holds.
    """

    def __init__(self, datasets: list[Any], weights: list[float] | list[int], size: int | None,
                 config: Any) -> None:
        if len(datasets) != len(weights) or not datasets or len(datasets) >= 32767:
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets, {len(weights)} weights")
        if len(datasets) == 1:
            warn_rank_0("building a BlendedDataset for a single dataset")
        if size is not None:
            weights = normalize(weights)
        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config
        ids = OrderedDict([("class", type(self).__name__),
                           ("datasets", [d.unique_identifiers for d in datasets]),
                           ("split", self.split.name), ("weights", self.weights),
                           ("size", self.size)])
        self.unique_description = json.dumps(ids, indent=4,
                                             default=lambda o: getattr(o, "unique_identifiers",
                                                                       {"class": type(o).__name__}))
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        arrays = cached_arrays(config.path_to_cache,
                               f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}",
                               self.unique_description, ["dataset_index", "dataset_sample_index"],
                               self._build)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self._check_components()

    def _build(self) -> dict[str, np.ndarray]:
        n = len(self.datasets)
        size = self.size if self.size is not None else int(sum(self.weights))
        dataset_index = np.zeros(size, dtype=np.int16)
        dataset_sample_index = np.zeros(size, dtype=np.int64)
        if self.size is not None:
            helpers.build_blending_indices(dataset_index, dataset_sample_index, self.weights, n, size)
        else:
            helpers.build_exhaustive_blending_indices(dataset_index, dataset_sample_index,
                                                      np.asarray(self.weights, dtype=np.int64), n)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def _check_components(self) -> None:
        used = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for i, d in enumerate(self.datasets):
            if used[i] > len(d):
                raise ValueError(f"blend draws {used[i]} samples from {d.dataset_path}, which has "
                                 f"{len(d)}; increase mid_level_dataset_surplus")
        log_rank_0(f"> BlendedDataset {self.split.name}: {len(self)} samples, per dataset "
                   f"{used.tolist()} for weights {[round(float(w), 6) for w in self.weights]}")

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> dict[str, Any]:
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": dataset_id, **sample}


def _component(cls: type, prefix: str, bookends: tuple[float, float], num_samples: int | None,
               split: Split, config: Any) -> Any:
    """One split of one component dataset."""
    low = cls.build_low_level_dataset(prefix, config)
    indices = split_indices(bookends, cls.numel_low_level_dataset(low))
    return cls(low, prefix, indices, num_samples, split, config)


def _build_splits_of_prefix(cls: type, prefix: str | None, matrix: list, sizes: list,
                            config: Any) -> list[Any]:
    """The mid-level datasets of every split of one low-level dataset (None where no split)."""
    low = cls.build_low_level_dataset(prefix, config)
    n = cls.numel_low_level_dataset(low)
    return [None if matrix[i] is None else
            cls(low, prefix, split_indices(matrix[i], n), sizes[i], split, config)
            for i, split in enumerate(Split)]


def _blend_split(cls: type, prefixes: list[str], weights: list[float] | None, matrix: list,
                 sizes: list, config: Any, i: int) -> Any:
    """Split i of a multi-prefix blend (weights already normalised, or None)."""
    from megatron.data.gpt_dataset import samples_for_blend

    split = Split(i)
    if weights is not None:
        if sizes[i] is None:
            raise ValueError("weighted blends need a sample count per split")
        parts = [_component(cls, p, matrix[i],
                            samples_for_blend(sizes[i], w, config.mid_level_dataset_surplus),
                            split, config) for p, w in zip(prefixes, weights)]
        targets = [samples_for_target(sizes[i], w) for w in weights]
        return BlendedDataset(parts, weights, sum(targets), config)
    parts = [_component(cls, p, matrix[i], None, split, config) for p in prefixes]
    lengths = [len(p) for p in parts]
    size = None if sizes[i] is None else min(sizes[i], sum(lengths))
    return BlendedDataset(parts, lengths, size, config)


def samples_for_target(target: int, weight: float) -> int:
    """``ceil(target * w)``: the samples a blended split takes from one component."""
    import math

    return int(math.ceil(target * weight))


def build_dataset_splits(cls: type, sizes: list[int | None], config: Any) -> list[Any]:
    """Megatron-Core's BlendedMegatronDatasetBuilder: [train, valid, test] datasets or None.

    Every rank builds its datasets; index files are built by rank 0 and loaded by the others
    (see :mod:`megatron.data.index_cache`).
    """
    if config.mock:
        return _build_splits_of_prefix(cls, None, config.split_matrix, sizes, config)
    if config.blend is not None:
        prefixes, weights = config.blend
        if weights is not None:
            weights = normalize(weights)
        _check_prefixes(prefixes, "--data-path")
        if len(prefixes) == 1 and weights is None:
            return _build_splits_of_prefix(cls, prefixes[0], config.split_matrix, sizes, config)
        return [None if config.split_matrix[i] is None else
                _blend_split(cls, prefixes, weights, config.split_matrix, sizes, config, i)
                for i in range(len(Split))]
    out: list[Any] = []
    for i, split in enumerate(Split):
        blend = config.blend_per_split[i]
        if blend is None:
            out.append(None)
            continue
        prefixes, weights = blend
        _check_prefixes(prefixes, f"--{split.name}-data-path")
        weights = normalize(weights) if weights is not None else None
        matrix = [None] * 3
        matrix[i] = (0.0, 1.0)
        split_sizes = [0] * 3
        split_sizes[i] = sizes[i]
        if len(prefixes) == 1:
            out.append(_build_splits_of_prefix(cls, prefixes[0], matrix, split_sizes, config)[i])
        else:
            out.append(_blend_split(cls, prefixes, weights, matrix, split_sizes, config, i))
    return out


def _check_prefixes(prefixes: list[str], flag: str) -> None:
    from megatron.data.indexed_dataset import IndexedDataset

    missing = [p for p in prefixes if not IndexedDataset.exists(p)]
    if missing:
        raise ValueError(f"{flag}: no dataset {missing[0]}.bin/.idx (give the prefix without "
                         "the extension)")
