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


@dataclasses.dataclass(kw_only=True)
class MaskedWordPieceDatasetConfig(BlendedMegatronDatasetConfig):
    """What masked-LM samples over WordPiece tokens need (Megatron-Core's
    ``MaskedWordPieceDatasetConfig``).

    ``pretrain_bert.py`` sets only ``masking_probability`` (--mask-prob) and
    ``short_sequence_probability`` (--short-seq-prob); the n-gram fields keep Megatron's
    BERT values.

    Raises:
        ValueError: a probability outside its range, ``masking_max_ngram < 1``, geometric
            n-grams together with permutation, or no tokenizer.
    """

    masking_probability: float = 0.15
    """Fraction of the tokens predicted (--mask-prob)."""
    short_sequence_probability: float = 0.1
    """Probability that a sample targets a random shorter length (--short-seq-prob)."""
    masking_max_ngram: int = 3
    """Longest n-gram (in whole words) masked at once."""
    masking_do_full_word: bool = True
    """Mask whole words: a ``##`` piece goes with the word before it."""
    masking_do_permutation: bool = False
    """Also permute a subset of the n-grams (not used by BERT)."""
    masking_use_longer_ngrams: bool = False
    """Favour longer n-grams (p proportional to n instead of 1/n)."""
    masking_use_geometric_distribution: bool = False
    """Draw n from SpanBERT's geometric distribution (p = 0.2), clipped to the maximum."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("masked WordPiece datasets need a tokenizer with a vocabulary "
                             "(--tokenizer-type BertWordPieceLowerCase/BertWordPieceCase)")
        if not 0.0 < self.masking_probability < 1.0:
            raise ValueError(f"--mask-prob must be in (0, 1), got {self.masking_probability}")
        if not 0.0 <= self.short_sequence_probability <= 1.0:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got "
                             f"{self.short_sequence_probability}")
        if self.masking_max_ngram < 1:
            raise ValueError(f"masking_max_ngram must be >= 1, got {self.masking_max_ngram}")
        if self.masking_use_geometric_distribution and self.masking_do_permutation:
            raise ValueError("masking_use_geometric_distribution and masking_do_permutation "
                             "cannot be combined")


@dataclasses.dataclass(kw_only=True)
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """BERT samples (Megatron-Core's ``BERTMaskedWordPieceDatasetConfig``).

    Raises:
        ValueError: see :class:`MaskedWordPieceDatasetConfig`; a sequence length below 4 with
            the binary head (room for ``[CLS] A [SEP] B [SEP]``).
    """

    classification_head: bool = True
    """Two segments per sample and the sentence-order label ``is_random`` (off with
    --bert-no-binary-head: one segment, ``is_random`` always 0)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sequence_length < 5:
            raise ValueError(f"--seq-length {self.sequence_length} is too short for BERT "
                             "samples ([CLS] A [SEP] B [SEP] needs at least 5)")
