"""Blending of several datasets by weight (Megatron-Core ``BlendedDataset``).

``--data-path 0.3 a 0.7 b``: the builder (:mod:`megatron.data.builder`) normalises the weights
and builds each component split with ``ceil(ceil(target * w_i) * 1.005)`` samples;
:class:`BlendedDataset` then draws ``sum_i ceil(target * w_i)`` samples with Megatron-Core's
greedy rule (each sample goes to the component lagging its weight the most), so per-component
counts follow the weights to within one sample. Indices are cached like the GPT ones
(``{md5}-BlendedDataset-{split}-...``).
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
from megatron.data.dataset_config import BlendedMegatronDatasetConfig
from megatron.data.index_cache import cached_arrays
from megatron.data.megatron_dataset import MegatronDataset, describe
from megatron.data.utils import normalize


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

    def __init__(self, datasets: list[MegatronDataset], weights: list[float] | list[int],
                 size: int | None, config: BlendedMegatronDatasetConfig) -> None:
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
        self.unique_description = json.dumps(ids, indent=4, default=describe)
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
