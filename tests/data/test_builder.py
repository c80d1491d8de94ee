"""The dataset builder, base dataset and base config serve any dataset kind, not only GPT:
a toy MegatronDataset with its own config subclass (as BERT's will be, with masking fields)
is split, blended and cached by the same builder, under its own class name."""

from __future__ import annotations

import dataclasses
import hashlib
import types

import numpy as np
import pytest

from megatron.data.blended_dataset import BlendedDataset
from megatron.data.builder import BlendedMegatronDatasetBuilder, samples_for_blend
from megatron.data.dataset_config import BlendedMegatronDatasetConfig
from megatron.data.gpt_dataset import GPTDatasetConfig
from megatron.data.index_cache import cached_arrays
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.megatron_dataset import MegatronDataset
from megatron.data.utils import split_indices

TOKENIZER = types.SimpleNamespace(eod=0, vocab_size=100)


@dataclasses.dataclass(kw_only=True)
class ToyConfig(BlendedMegatronDatasetConfig):
    """A config subclass with a field of its own (BERT's will hold the masking parameters)."""

    max_tokens: int = 4


class ToyDataset(MegatronDataset):
    """Sample i: the first ``max_tokens`` tokens of sequence ``indices[order[i]]``; ``order``
    cycles through the split and is cached like the GPT indices."""

    def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        n = len(indices) if num_samples is None else num_samples
        base = f"{self.unique_description_hash}-{type(self).__name__}-{index_split.name}"
        self.order = cached_arrays(self._cache_dir(), base, self.unique_description, ["order"],
                                   lambda: {"order": np.arange(n) % len(indices)})["order"]

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MegatronDataset._key_config_attributes() + ["max_tokens"]

    @staticmethod
    def numel_low_level_dataset(low_level) -> int:
        return len(low_level)

    @staticmethod
    def build_low_level_dataset(dataset_path, config) -> IndexedDataset:
        return IndexedDataset(dataset_path)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict:
        sequence = int(self.indices[self.order[idx]])
        return {"tokens": self.dataset.get(sequence, 0, self.config.max_tokens)}


def _make(prefix, first: int, count: int) -> None:
    """``count`` sequences of 5 tokens; sequence j holds ``first + j`` five times."""
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for j in range(count):
        b.add_document(np.full(5, first + j, dtype=np.uint16), [5])
    b.finalize(f"{prefix}.idx")


@pytest.fixture
def data(tmp_path):
    _make(tmp_path / "a", 1, 10)
    _make(tmp_path / "b", 50, 20)
    return tmp_path


def _config(data, **kw) -> ToyConfig:
    return ToyConfig(random_seed=3, sequence_length=4, tokenizer=TOKENIZER,
                     path_to_cache=str(data / "cache"), **kw)


def test_split_of_one_prefix_is_the_subclass_cached_under_its_name(data):
    cfg = _config(data, blend=([str(data / "a")], None), split="8,2,0", max_tokens=3)
    train, valid, test = BlendedMegatronDatasetBuilder(ToyDataset, [12, None, 5], cfg).build()
    assert type(train) is ToyDataset and type(valid) is ToyDataset and test is None
    np.testing.assert_array_equal(train.indices, split_indices((0, 0.8), 10))
    np.testing.assert_array_equal(valid.indices, split_indices((0.8, 1.0), 10))
    assert len(train) == 12 and len(valid) == 2
    assert train[9]["tokens"].tolist() == [2, 2, 2]  # order 9 % 8 = 1: sequence 1 holds 2s
    assert valid[1]["tokens"].tolist() == [10, 10, 10]
    assert train.unique_identifiers["max_tokens"] == 3  # the subclass's own key attribute
    assert train.unique_description.endswith('"max_tokens": 3\n}')
    digest = hashlib.md5(train.unique_description.encode("utf-8")).hexdigest()
    assert sorted(p.name for p in (data / "cache").iterdir() if "-train-" in p.name) == [
        f"{digest}-ToyDataset-train-description.txt", f"{digest}-ToyDataset-train-order.npy"]


def test_weighted_blend_of_the_subclass(data):
    cfg = _config(data, blend=([str(data / "a"), str(data / "b")], [1.0, 3.0]), split="1,0,0")
    train, valid, test = BlendedMegatronDatasetBuilder(ToyDataset, [40, 0, 0], cfg).build()
    assert isinstance(train, BlendedDataset) and valid is None and test is None
    assert [type(d) for d in train.datasets] == [ToyDataset, ToyDataset]
    assert [len(d) for d in train.datasets] == [samples_for_blend(40, 0.25, 0.005),
                                                samples_for_blend(40, 0.75, 0.005)]
    assert len(train) == 40 and np.bincount(train.dataset_index).tolist() == [10, 30]
    assert '"class": "ToyDataset"' in train.unique_description
    s = train[0]
    assert s["dataset_id"] in (0, 1) and len(s["tokens"]) == 4


def test_per_split_prefixes_and_missing_prefix_name_their_flag(data):
    cfg = _config(data, blend_per_split=[([str(data / "a")], None),
                                         ([str(data / "a"), str(data / "b")], None), None])
    train, valid, test = BlendedMegatronDatasetBuilder(ToyDataset, [5, 100, 0], cfg).build()
    assert type(train) is ToyDataset and len(train) == 5 and test is None
    assert isinstance(valid, BlendedDataset) and len(valid) == 30  # both used whole: 10 + 20
    cfg = _config(data, blend_per_split=[None, ([str(data / "nothing")], None), None])
    with pytest.raises(ValueError, match=r"--valid-data-path: no dataset .*nothing\.bin/\.idx"):
        BlendedMegatronDatasetBuilder(ToyDataset, [5, 5, 0], cfg).build()


def test_base_config_owns_blend_split_and_mock():
    mock = BlendedMegatronDatasetConfig(random_seed=1, sequence_length=8)
    assert mock.mock and mock.split == "1,1,1" and len(mock.split_matrix) == 3
    per_split = BlendedMegatronDatasetConfig(random_seed=1, sequence_length=8, split="1,1,1",
                                             blend_per_split=[(["x"], None), None, None])
    assert per_split.split is None and per_split.split_matrix is None and not per_split.mock
    with pytest.raises(ValueError, match="--seq-length must be >= 2"):
        ToyConfig(random_seed=1, sequence_length=1)
    with pytest.raises(ValueError, match="--data-path cannot be combined"):
        ToyConfig(random_seed=1, sequence_length=8, blend=(["x"], None),
                  blend_per_split=[(["y"], None), None, None])
    assert issubclass(GPTDatasetConfig, BlendedMegatronDatasetConfig)
    assert not issubclass(ToyConfig, GPTDatasetConfig)



def test_each_prefix_of_a_blend_is_opened_once(data, monkeypatch):
    # Every split of a two-prefix blend cuts the same low-level datasets: each .idx is read and
    # checked against its .bin once per build, as Megatron-Core's builder does.
    opened = []
    monkeypatch.setattr(ToyDataset, "build_low_level_dataset",
                        staticmethod(lambda path, config: opened.append(path) or
                                     IndexedDataset(path)))
    cfg = _config(data, blend=([str(data / "a"), str(data / "b")], [1.0, 3.0]), split="8,1,1")
    train, valid, test = BlendedMegatronDatasetBuilder(ToyDataset, [40, 8, 8], cfg).build()
    assert all(isinstance(d, BlendedDataset) for d in (train, valid, test))
    assert sorted(opened) == [str(data / "a"), str(data / "b")]
