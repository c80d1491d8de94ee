"""The --data-* flags land in the data layer's typed GPT dataset config."""

from __future__ import annotations

import types

import pytest

from megatron.config import DataConfig, parse_args
from megatron.config.datasets import dataset_blends, gpt_dataset_config

TOKENIZER = types.SimpleNamespace(eod=0, vocab_size=10)


def test_every_data_flag_reaches_its_field():
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                      "--seq-length", "16", "--max-position-embeddings", "16",
                      "--micro-batch-size", "1", "--seed", "5",
                      "--data-path", "0.3", "a", "0.7", "b", "--split", "9,1,0",
                      "--data-cache-path", "/cache", "--reset-position-ids",
                      "--reset-attention-mask", "--eod-mask-loss",
                      "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files"],
                     validate_config=False)
    config = gpt_dataset_config(cfg.data, TOKENIZER, cfg.model.seed)
    assert (config.random_seed, config.sequence_length, config.tokenizer) == (5, 16, TOKENIZER)
    assert config.blend == (["a", "b"], [0.3, 0.7]) and config.blend_per_split is None
    assert (config.split, config.path_to_cache, config.mock) == ("9,1,0", "/cache", False)
    assert config.split_matrix == [(0, 0.9), (0.9, 1.0), None]
    assert config.reset_position_ids and config.reset_attention_mask and config.eod_mask_loss
    assert not config.create_attention_mask and not config.mmap_bin_files
    defaults = gpt_dataset_config(DataConfig(data_path=["a"], seq_length=8), TOKENIZER, 1)
    assert defaults.create_attention_mask and defaults.mmap_bin_files
    assert defaults.split == "969, 30, 1" and defaults.path_to_cache is None


def test_per_split_paths_and_mock():
    data = DataConfig(train_data_path=["a"], valid_data_path=["1", "b", "3", "c"], seq_length=8)
    config = gpt_dataset_config(data, TOKENIZER, 1)
    assert config.blend is None and config.split is None and config.split_matrix is None
    assert config.blend_per_split == [(["a"], None), (["b", "c"], [1.0, 3.0]), None]
    mock = DataConfig(data_path=["ignored"], mock_data=True, seq_length=8)
    assert dataset_blends(mock) == (None, None)
    config = gpt_dataset_config(mock, TOKENIZER, 1)
    assert config.mock and config.split == "1,1,1"


def test_no_data_and_bad_paths_name_the_flags():
    with pytest.raises(ValueError, match="no data: pass --data-path"):
        gpt_dataset_config(DataConfig(seq_length=8), TOKENIZER, 1)
    with pytest.raises(ValueError, match="--valid-data-path"):
        dataset_blends(DataConfig(valid_data_path=["0.5", "a", "b", "c"], mock_data=True))
    with pytest.raises(ValueError, match="--seq-length must be >= 2"):
        gpt_dataset_config(DataConfig(data_path=["a"], seq_length=1), TOKENIZER, 1)
