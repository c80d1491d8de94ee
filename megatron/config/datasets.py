"""The data layer's dataset configs, filled from the ``--data-*`` flags.

``megatron.data`` owns its typed configs and never reads the CLI config; the training scripts
map the validated :class:`~megatron.config.data.DataConfig` (plus ``--seed`` and the built
tokenizer) onto them here. Importing this module loads torch (through ``megatron.data``), so
``megatron.config`` itself does not import it.
"""

from __future__ import annotations

from typing import Any

from megatron.config.data import DataConfig
from megatron.data.dataset_config import BERTMaskedWordPieceDatasetConfig, Blend
from megatron.data.gpt_dataset import GPTDatasetConfig
from megatron.data.utils import get_blend_from_list


def dataset_blends(data: DataConfig) -> tuple[Blend | None, list[Blend | None] | None]:
    """``(blend, blend_per_split)`` from --data-path and --train/valid/test-data-path.

    Both are None with --mock-data (the paths, still parsed, are then ignored).

    Raises:
        ValueError: a path list that does not parse (naming its flag), or no data at all.
    """
    per_split = [get_blend_from_list(getattr(data, f"{name}_data_path"), f"--{name}-data-path")
                 for name in ("train", "valid", "test")]
    blend = get_blend_from_list(data.data_path)
    if data.mock_data:
        return None, None
    if blend is None and not any(per_split):
        raise ValueError("no data: pass --data-path, --train-data-path/--valid-data-path/"
                         "--test-data-path, or --mock-data")
    return blend, per_split if any(per_split) else None


def gpt_dataset_config(data: DataConfig, tokenizer: Any, seed: int) -> GPTDatasetConfig:
    """The GPT dataset config of the ``--data-*`` flags.

    Args:
        data: the validated data flags (``cfg.data``).
        tokenizer: the built tokenizer (``.eod``, ``.vocab_size``, ``.padded_vocab_size``).
        seed: --seed.

    Raises:
        ValueError: see :func:`dataset_blends`; an invalid --split or --seq-length.
    """
    blend, blend_per_split = dataset_blends(data)
    return GPTDatasetConfig(
        random_seed=seed, sequence_length=data.seq_length, tokenizer=tokenizer, blend=blend,
        blend_per_split=blend_per_split, split=data.split, path_to_cache=data.data_cache_path,
        mmap_bin_files=data.mmap_bin_files, reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=data.create_attention_mask_in_dataloader)


def bert_dataset_config(data: DataConfig, tokenizer: Any, seed: int,
                        classification_head: bool = True) -> BERTMaskedWordPieceDatasetConfig:
    """The BERT dataset config of the ``--data-*`` flags, as Megatron-LM's ``pretrain_bert.py``
    fills it (n-grams up to 3 whole words, no permutation, no geometric n-grams).

    Args:
        data: the validated data flags (``cfg.data``: --mask-prob, --short-seq-prob...).
        tokenizer: the built WordPiece tokenizer (``cls``, ``sep``, ``mask``, ``pad``,
            ``inv_vocab``).
        seed: --seed.
        classification_head: the sentence-order head (``cfg.model.bert_binary_head``, off with
            --bert-no-binary-head).

    Raises:
        ValueError: see :func:`dataset_blends`; an invalid --split, --seq-length, --mask-prob
            or --short-seq-prob.
    """
    blend, blend_per_split = dataset_blends(data)
    return BERTMaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=data.seq_length, tokenizer=tokenizer, blend=blend,
        blend_per_split=blend_per_split, split=data.split, path_to_cache=data.data_cache_path,
        mmap_bin_files=data.mmap_bin_files, masking_probability=data.mask_prob,
        short_sequence_probability=data.short_seq_prob, masking_max_ngram=3,
        masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
        classification_head=classification_head)
