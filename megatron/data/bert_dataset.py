"""BERT masked-LM samples with Megatron-Core v0.13's ``BERTMaskedWordPieceDataset`` semantics.

For the same ``_text_sentence`` .bin/.idx, split, seed and flags the samples equal
Megatron-Core's item for item (``docs/FORMATS.md`` section 2c). Item ``idx``:

1. row ``idx`` of the shuffled samples mapping: sentences ``[first, end)`` of one document and a
   target length (``seq_length - 3``, or shorter with ``--short-seq-prob``);
2. ``rng = numpy.random.RandomState((seed + idx) % 2**32)``, used in this order:
3. with the sentence-order head: segment A = the first ``randint(1, n)`` sentences (1 when
   n = 2), B = the rest; swapped with probability 0.5 (``is_random`` = 1). Without it, A = all;
4. the longer segment loses a token from its front or back (0.5 each) until both fit the target;
5. ``[CLS] A [SEP] B [SEP]`` (``[CLS] A [SEP]`` without B), types 0 for ``[CLS] A [SEP]``, 1 after;
6. whole-word n-gram masking (:meth:`MaskedWordPieceDataset.create_masked_lm_predictions`),
   80% ``[MASK]`` / 10% random id of the whole vocabulary / 10% kept;
7. padded to ``seq_length``: pad id for the text, 0 for types and the padding mask.

Each item is a dict of numpy int64 arrays ``text``, ``types``, ``labels`` (-1 where not
predicted), ``padding_mask`` (1 = real token), ``loss_mask`` (1 = predicted), all
``[seq_length]``, and Python ints ``is_random`` and ``truncated`` (0/1), as Megatron-Core's
items carry them (so an item goes through ``json.dumps`` once its arrays are lists; torch's
default collation makes int64 tensors of both alike).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron.data.builder import BlendedMegatronDatasetBuilder, SplitDataset
from megatron.data.dataset_config import (BERTMaskedWordPieceDatasetConfig,
                                          MaskedWordPieceDatasetConfig)
from megatron.data.masked_dataset import MaskedWordPieceDataset, min_sentences_per_sample
from megatron.data.utils import Split

__all__ = ["BERTMaskedWordPieceDataset", "BERTMaskedWordPieceDatasetConfig",
           "MaskedWordPieceDatasetConfig", "MockBERTMaskedWordPieceDataset",
           "MockBERTLowLevelDataset", "build_train_valid_test_datasets"]


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """One split of a sentence-split dataset as BERT pretraining samples.

    Args:
        indexed_dataset: the low-level dataset (IndexedDataset or mock).
        dataset_path: its prefix, None for mock data.
        indices: int32 ids of this split's documents.
        num_samples: samples requested (None: one epoch); whole epochs are built, so
            ``len(dataset)`` is at least this.
        index_split: which split.
        config: the BERT dataset config.

    Raises:
        ValueError: a split too small for one sample, naming it.
    """

    config: BERTMaskedWordPieceDatasetConfig

    def __init__(self, indexed_dataset: Any, dataset_path: str | None, indices: np.ndarray,
                 num_samples: int | None, index_split: Split,
                 config: BERTMaskedWordPieceDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, index_split, config)
        # Room for [CLS] and two [SEP] (one fewer token is used without the head).
        self.sample_index = self._build_sample_index(config.sequence_length - 3,
                                                     min_sentences_per_sample(config))

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MaskedWordPieceDataset._key_config_attributes() + ["classification_head"]

    def __getitem__(self, idx: int) -> dict[str, Any]:
        first, end, target = (int(v) for v in self.sample_index[idx])
        sentences = [self.dataset[i].tolist() for i in range(first, end)]
        rng = np.random.RandomState(seed=(self.config.random_seed + int(idx)) % 2**32)
        segment_a, segment_b, is_random = self._segments(sentences, rng)
        truncated = _truncate_pair(segment_a, segment_b, target, rng)
        tok = self.config.tokenizer
        tokens = [tok.cls, *segment_a, tok.sep]
        types = [0] * len(tokens)
        if segment_b:
            tokens += [*segment_b, tok.sep]
            types += [1] * (len(segment_b) + 1)
        tokens, positions, originals = self.create_masked_lm_predictions(tokens, target, rng)
        return self._padded(tokens, types, positions, originals, is_random, truncated)

    def _segments(self, sentences: list[list[int]], rng: np.random.RandomState
                  ) -> tuple[list[int], list[int], bool]:
        """Segments A and B and whether they were swapped (sentence-order prediction)."""
        pivot, swap = len(sentences), False
        if self.config.classification_head:
            assert len(sentences) > 1, "the mapping gives the head two sentences or more"
            pivot = rng.randint(low=1, high=len(sentences)) if len(sentences) >= 3 else 1
            swap = bool(rng.random() < 0.5)
        segment_a = [t for s in sentences[:pivot] for t in s]
        segment_b = [t for s in sentences[pivot:] for t in s]
        return (segment_b, segment_a, True) if swap else (segment_a, segment_b, False)

    def _padded(self, tokens: list[int], types: list[int], positions: list[int],
                originals: list[int], is_random: bool, truncated: bool) -> dict[str, Any]:
        seq = self.config.sequence_length
        pads = seq - len(tokens)
        assert pads >= 0, f"sample of {len(tokens)} tokens exceeds --seq-length {seq}"
        text = np.full(seq, self.config.tokenizer.pad, dtype=np.int64)
        text[:len(tokens)] = tokens
        # Megatron-Core pads types and the padding mask with the pad id, 0 in every BERT
        # vocabulary; 0 is what they mean.
        types_ = np.zeros(seq, dtype=np.int64)
        types_[:len(types)] = types
        padding_mask = np.zeros(seq, dtype=np.int64)
        padding_mask[:len(tokens)] = 1
        labels = np.full(seq, -1, dtype=np.int64)
        labels[positions] = originals
        loss_mask = np.zeros(seq, dtype=np.int64)
        loss_mask[positions] = 1
        return {"text": text, "types": types_, "labels": labels,
                "is_random": int(is_random), "padding_mask": padding_mask,
                "loss_mask": loss_mask, "truncated": int(truncated)}

    def _get_token_mask(self, rng: np.random.RandomState) -> int | None:
        """80% [MASK]; else half the time a random id of the whole vocabulary (special
        tokens included, as Megatron-Core), half the time None (keep the token)."""
        if rng.random() < 0.8:
            return self.config.tokenizer.mask
        if rng.random() >= 0.5:
            return self.token_lookup[rng.randint(0, len(self.token_lookup))]
        return None


def _truncate_pair(segment_a: list[int], segment_b: list[int], target: int,
                   rng: np.random.RandomState) -> bool:
    """Drop tokens from the longer segment (B on ties), front or back with probability 0.5
    each, until ``len(A) + len(B) <= target``; in place. Returns whether any was dropped."""
    if len(segment_a) + len(segment_b) <= target:
        return False
    while len(segment_a) + len(segment_b) > target:
        longer = segment_a if len(segment_a) > len(segment_b) else segment_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            del longer[-1]
    return True


# ---------------------------------------------------------------------------------------------
# Mock data (--mock-data)
# ---------------------------------------------------------------------------------------------

class MockBERTLowLevelDataset:
    """Synthetic sentence-split documents for ``--mock-data`` (Megatron-Core has no BERT mock).

    10000 documents of 1-8 sentences, sentence lengths 4-63 tokens (``default_rng(0)``), each
    sentence's ids drawn uniformly from the ordinary tokens of the vocabulary (not ``[...]``
    specials, ``[BOS]``/``[EOS]`` or ``<extra_id_N>``), by ``default_rng((1, sentence))``, so
    word pieces and ``##`` continuations both occur and every sentence is reproducible alone.

    Raises:
        ValueError: a tokenizer without a WordPiece vocabulary.
    """

    num_documents: int = 10000

    def __init__(self, tokenizer: Any) -> None:
        from megatron.data.masked_dataset import word_start_table

        word_start_table(tokenizer)  # the same clear error for a vocabulary-less tokenizer
        inv_vocab = tokenizer.inv_vocab
        self._ordinary = np.array(sorted(i for i, t in inv_vocab.items()
                                         if not (t.startswith("[") and t.endswith("]"))
                                         and not t.startswith("<extra_id_")), dtype=np.int64)
        rng = np.random.default_rng(0)
        sentences = rng.integers(1, 9, size=self.num_documents)
        self.document_indices = np.concatenate([[0], np.cumsum(sentences)]).astype(np.int64)
        self.sequence_lengths = rng.integers(4, 64, size=int(sentences.sum()), dtype=np.int32)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        picks = np.random.default_rng((1, int(idx))).integers(
            0, len(self._ordinary), size=int(self.sequence_lengths[idx]))
        return self._ordinary[picks]

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        tokens = self[idx]
        return tokens[offset:] if length is None else tokens[offset:offset + length]


class MockBERTMaskedWordPieceDataset(BERTMaskedWordPieceDataset):
    """BERTMaskedWordPieceDataset over :class:`MockBERTLowLevelDataset`, never cached."""

    def _cache_dir(self) -> str | None:
        return None

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None,
                                config: BERTMaskedWordPieceDatasetConfig) -> Any:
        return MockBERTLowLevelDataset(config.tokenizer)


def build_train_valid_test_datasets(config: BERTMaskedWordPieceDatasetConfig,
                                    train_valid_test_num_samples: list[int | None]
                                    ) -> list[SplitDataset | None]:
    """Train, valid and test BERT datasets (BERTMaskedWordPieceDataset, BlendedDataset or the
    mock; None for a split without data).

    Args:
        config: the BERT dataset config (from the flags:
            ``megatron.config.datasets.bert_dataset_config``).
        train_valid_test_num_samples: samples the schedule needs per split.

    Raises:
        ValueError: missing/invalid files, a dataset not split into sentences, or a split
            too small for one sample.
    """
    cls = MockBERTMaskedWordPieceDataset if config.mock else BERTMaskedWordPieceDataset
    return BlendedMegatronDatasetBuilder(cls, list(train_valid_test_num_samples), config).build()
