"""The base of masked-LM datasets over WordPiece tokens (Megatron-Core's
``MaskedWordPieceDataset``).

Input: a dataset made with ``tools/preprocess_data.py --split-sentences`` (``_text_sentence``
files): every sentence is one sequence of the ``.idx`` and the document index groups them into
documents. Splits (``--split``) cut documents. The samples mapping (which sentences form each
sample) is Megatron-Core's ``build_mapping`` (:func:`megatron.data.helpers.build_mapping`),
cached as ``{md5}-{Class}-{description.txt|sample_index.npy}`` (no split in the name: the md5
covers it), and the n-gram masking draws from a per-sample ``numpy.random.RandomState`` in
Megatron-Core's order, so a sample is identical to Megatron-Core v0.13's item for item
(``docs/FORMATS.md`` section 2c).

Two input checks run before any index is built (on every rank, so no rank waits at a barrier
for a failed build):

* *Not split into sentences.* A dataset made without ``--split-sentences`` has one sequence per
  document. When no document of a dataset holds more than one sequence it is refused if the
  sentence-order head is on (its samples need two sentences of one document, so none could be
  made), and otherwise if more than 10% of its sequences are over 512 tokens: a sentence
  splitter practically never yields such "sentences" (512 is the length past which Megatron
  itself drops a document as broken), whole documents usually are. One-sentence documents of
  ordinary sentences (e.g. a corpus of short texts) stay usable without the head.
* *Too small.* A split with no document that can form a sample (two sentences with the head,
  none of several over 512 tokens) is refused naming the split, instead of Megatron-Core's
  endless loop over empty epochs.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from megatron.core.log import log_rank_0
from megatron.data import helpers
from megatron.data.dataset_config import MaskedWordPieceDatasetConfig
from megatron.data.gpt_dataset import check_token_ids
from megatron.data.index_cache import cached_arrays
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.megatron_dataset import MegatronDataset
from megatron.data.utils import Split

_NOT_SENTENCE_SPLIT_SHARE = 0.10  # of sequences over LONG_SENTENCE_LEN, see the module docstring


def min_sentences_per_sample(config: Any) -> int:
    """2 with the sentence-order head (two segments), else 1."""
    return 2 if getattr(config, "classification_head", False) else 1


def check_sentence_split(document_indices: np.ndarray, sequence_lengths: np.ndarray,
                         prefix: str | None, min_num_sent: int) -> None:
    """Refuse a dataset that was not split into sentences (rule in the module docstring).

    Raises:
        ValueError: naming the prefix and ``--split-sentences``.
    """
    counts = np.diff(np.asarray(document_indices, dtype=np.int64))
    lengths = np.asarray(sequence_lengths)
    if len(lengths) == 0 or counts.max(initial=0) > 1:
        return
    share_long = float(np.mean(lengths > helpers.LONG_SENTENCE_LEN))
    fix = (f"preprocess it with tools/preprocess_data.py --split-sentences (its "
           f"'_text_sentence' output keeps each sentence as a sequence)")
    if min_num_sent > 1:
        raise ValueError(
            f"dataset {prefix}: every document is a single sequence, so no sample of two "
            f"sentences (BERT's sentence-order pairs) can be made; it looks made without "
            f"--split-sentences: {fix}, or train without the sentence-order head "
            "(--bert-no-binary-head)")
    if share_long > _NOT_SENTENCE_SPLIT_SHARE:
        raise ValueError(
            f"dataset {prefix}: every document is a single sequence and {share_long:.0%} of "
            f"them are over {helpers.LONG_SENTENCE_LEN} tokens, so it was not split into "
            f"sentences: {fix}")


def word_start_table(tokenizer: Any) -> np.ndarray:
    """bool ``[vocab]``: which ids start a word (WordPiece continuations start with ``##``).

    Raises:
        ValueError: a tokenizer without a vocabulary (e.g. NullTokenizer).
    """
    try:
        inv_vocab = tokenizer.inv_vocab
    except NotImplementedError:
        inv_vocab = None
    if not inv_vocab:
        raise ValueError(f"masked-LM (BERT) data needs a WordPiece vocabulary; the "
                         f"{getattr(tokenizer, 'name', type(tokenizer).__name__)} tokenizer has "
                         "none: pass --tokenizer-type BertWordPieceLowerCase (or "
                         "BertWordPieceCase) and --vocab-file")
    table = np.ones(max(inv_vocab) + 1, dtype=bool)
    for token_id, token in inv_vocab.items():
        table[token_id] = not token.startswith("##")
    return table


class MaskedWordPieceDataset(MegatronDataset):
    """One split (by documents) of a sentence-split dataset, with the samples mapping and
    Megatron-Core's n-gram masking; subclasses assemble the samples.

    Args:
        indexed_dataset: the low-level dataset (IndexedDataset or mock).
        dataset_path: its prefix, None for mock data.
        indices: int32 ids of this split's documents.
        num_samples: samples requested (None: one epoch).
        index_split: which split.
        config: the masking config.

    Raises:
        ValueError: a split too small for one sample, naming it.
    """

    config: MaskedWordPieceDatasetConfig

    def __init__(self, indexed_dataset: Any, dataset_path: str | None, indices: np.ndarray,
                 num_samples: int | None, index_split: Split,
                 config: MaskedWordPieceDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, index_split, config)
        self._word_starts = word_start_table(config.tokenizer)
        self.token_lookup = list(config.tokenizer.inv_vocab.keys())
        # The n-gram distribution, normalised twice exactly as Megatron-Core (once for all
        # n, once for the n usable at a candidate, which are always all of them): the same
        # float64 cdf as its numpy choice() gives the same draws.
        nvals = np.arange(config.masking_max_ngram, dtype=np.int64) + 1
        probs = 1.0 / nvals
        probs = probs / probs.sum(keepdims=True)
        if config.masking_use_longer_ngrams:
            probs = probs[::-1]
        probs = probs / probs.sum(keepdims=True)
        cdf = probs.cumsum()
        self._ngram_cdf = cdf / cdf[-1]

    # -- the builder's interface ---------------------------------------------------------------

    @staticmethod
    def numel_low_level_dataset(low_level: Any) -> int:
        """Masked datasets split by document."""
        return len(low_level.document_indices) - 1

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None,
                                config: MaskedWordPieceDatasetConfig) -> IndexedDataset:
        """The sentence-split dataset at ``dataset_path``, checked.

        Raises:
            ValueError: missing files, ids outside the vocabulary, or a dataset not split into
                sentences (see the module docstring).
        """
        dataset = IndexedDataset(dataset_path, mmap=config.mmap_bin_files)
        vocab = types.SimpleNamespace(  # ids must have a token (masking reads it), not only a row
            vocab_size=len(config.tokenizer.inv_vocab),
            name=getattr(config.tokenizer, "name", type(config.tokenizer).__name__))
        check_token_ids(dataset, dataset_path, vocab)
        check_sentence_split(dataset.document_indices, dataset.sequence_lengths, dataset_path,
                             min_sentences_per_sample(config))
        return dataset

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MegatronDataset._key_config_attributes() + [
            "masking_probability", "short_sequence_probability", "masking_max_ngram",
            "masking_do_full_word", "masking_do_permutation", "masking_use_longer_ngrams",
            "masking_use_geometric_distribution"]

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    # -- samples mapping -----------------------------------------------------------------------

    def _split_boundaries(self) -> np.ndarray:
        """int64 document boundaries of this split (global sentence ids), closing one included."""
        if len(self.indices) == 0:
            return np.zeros(1, dtype=np.int64)
        ids = np.append(self.indices, self.indices[-1] + 1)
        return np.asarray(self.dataset.document_indices, dtype=np.int64)[ids]

    def _check_split_can_make_samples(self, docs: np.ndarray, min_num_sent: int) -> None:
        if self.num_samples == 0:
            return
        lengths = np.asarray(self.dataset.sequence_lengths)
        if len(helpers._eligible_documents(docs, lengths, min_num_sent)):
            return
        name = self.index_split.name
        where = self.dataset_path or "the mock data"
        fix = (f"give that split more documents with --split (now {self.config.split})"
               if self.config.split is not None else f"give --{name}-data-path more data")
        need = ("two sentences or more (the sentence-order head)" if min_num_sent > 1
                else "a sentence")
        raise ValueError(
            f"the {name} split of {where} holds {len(docs) - 1} documents, none with {need} "
            f"and, if several, none over {helpers.LONG_SENTENCE_LEN} tokens: too small for one "
            f"sample; {fix}")

    def _build_sample_index(self, max_seq_length: int, min_num_sent: int) -> np.ndarray:
        """uint32 ``[N, 3]`` rows (first sentence, end sentence, target length), shuffled;
        built by rank 0 and cached, loaded by the others.

        Whole epochs are built until ``num_samples`` is reached (Megatron-Core passes
        ``2**31 - 2`` epochs as the limit), so N >= num_samples; one epoch when None.
        """
        docs = self._split_boundaries()
        self._check_split_can_make_samples(docs, min_num_sent)
        lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int32)
        epochs = 1 if self.num_samples is None else np.iinfo(np.int32).max - 1
        limit = np.iinfo(np.uint64).max if self.num_samples is None else self.num_samples
        name = type(self).__name__

        def build() -> dict[str, np.ndarray]:
            mapping = helpers.build_mapping(docs, lengths, epochs, limit, max_seq_length,
                                            self.config.short_sequence_probability,
                                            self.config.random_seed, False, min_num_sent)
            log_rank_0(f"> {name} {self.index_split.name} ({self.dataset_path}): "
                       f"{len(mapping)} samples from {len(docs) - 1} documents "
                       f"({self.num_samples} requested)")
            return {"sample_index": mapping}

        def validate(arrays: dict[str, np.ndarray]) -> str | None:
            return validate_sample_index(arrays["sample_index"], docs, max_seq_length,
                                         self.num_samples)

        arrays = cached_arrays(self._cache_dir(), f"{self.unique_description_hash}-{name}",
                               self.unique_description, ["sample_index"], build, validate)
        self._mapped = arrays  # keeps a cached file's mapping open
        return np.asarray(arrays["sample_index"])

    # -- masking -------------------------------------------------------------------------------

    def _word_candidates(self, tokens: list[int]) -> list[list[int]]:
        """Positions grouped into maskable units: words (a ``##`` piece joins the unit before,
        even across a [SEP]), or single pieces without whole-word masking; [CLS]/[SEP] never."""
        cls, sep = self.config.tokenizer.cls, self.config.tokenizer.sep
        full_word = self.config.masking_do_full_word
        candidates: list[list[int]] = []
        for position, token in enumerate(tokens):
            if token == cls or token == sep:
                continue
            if self._word_starts[token] or not (full_word and candidates):
                candidates.append([position])
            else:
                candidates[-1].append(position)
        return candidates

    def _draw_n(self, rng: np.random.RandomState, geometric: bool) -> int:
        """Length (in units) of the next n-gram: SpanBERT's clipped geometric, or p ~ 1/n."""
        if geometric:
            return min(int(rng.geometric(0.2)), self.config.masking_max_ngram)
        # What RandomState.choice(values, p=...) does with one uniform draw.
        return int(np.searchsorted(self._ngram_cdf, rng.random_sample(), side="right")) + 1

    def _pick_ngram(self, candidates: list[list[int]], start: int, n: int, budget: float,
                    used: int) -> list[int] | None:
        """Positions of the longest n-gram from ``start`` of at most ``n`` units that fits in
        the budget (backing off one unit at a time), None when even one unit does not fit."""
        for size in range(n, 0, -1):
            positions = [p for unit in candidates[start:start + size] for p in unit]
            if budget >= used + len(positions):
                return positions
        return None

    def create_masked_lm_predictions(self, tokens: list[int], target_length: int,
                                     rng: np.random.RandomState
                                     ) -> tuple[list[int], list[int], list[int]]:
        """Mask n-grams of whole words until ``mask_prob`` of the tokens are predicted.

        Budget: ``min(p * target_length, max(1, round(p * len(tokens))))`` tokens. Units are
        visited in a random order; each draws n, backs off to shorter n-grams to stay in the
        budget, and is skipped if any of its positions is already masked. A masked position
        becomes [MASK] with probability 0.8, else keeps its token or (0.1) a random id.

        Returns:
            ``(masked tokens, predicted positions ascending, their original ids)``.
        """
        p = self.config.masking_probability
        candidates = self._word_candidates(tokens)
        budget = min(p * target_length, max(1, int(round(len(tokens) * p))))
        order = np.arange(len(candidates))
        rng.shuffle(order)
        masked = list(tokens)
        predicted: dict[int, int] = {}
        for start in order.tolist():
            if len(predicted) >= budget:
                break
            n = self._draw_n(rng, self.config.masking_use_geometric_distribution)
            positions = self._pick_ngram(candidates, start, n, budget, len(predicted))
            if positions is None or any(q in predicted for q in positions):
                continue
            for q in positions:
                predicted[q] = tokens[q]
                replacement = self._get_token_mask(rng)
                masked[q] = tokens[q] if replacement is None else replacement
        rng.shuffle(order)  # Megatron-Core reshuffles here; the draws are part of the format
        if self.config.masking_do_permutation:
            self._permute_ngrams(candidates, order, masked, predicted, budget, rng)
        positions = sorted(predicted)
        return masked, positions, [predicted[q] for q in positions]

    def _permute_ngrams(self, candidates: list[list[int]], order: np.ndarray, masked: list[int],
                        predicted: dict[int, int], budget: float,
                        rng: np.random.RandomState) -> None:
        """Megatron-Core's optional permutation: shuffle the tokens of further n-grams among
        themselves and predict them too. (Megatron-Core draws n here from numpy's global
        generator; this uses the sample's own, so samples stay reproducible.)"""
        chosen: set[int] = set()
        for start in order.tolist():
            if len(chosen) >= budget:
                break
            positions = self._pick_ngram(candidates, start, self._draw_n(rng, False), budget,
                                         len(chosen))
            if positions is None or any(q in predicted or q in chosen for q in positions):
                continue
            chosen.update(positions)
        sources = sorted(chosen)
        targets = list(sources)
        rng.shuffle(targets)
        before = list(masked)
        for q, source in zip(sources, targets):
            masked[q] = before[source]
            predicted[q] = before[q]

    def _get_token_mask(self, rng: np.random.RandomState) -> int | None:
        """The replacement of a predicted token (None: keep it)."""
        raise NotImplementedError


def validate_sample_index(mapping: np.ndarray, docs: np.ndarray, max_seq_length: int,
                          num_samples: int | None) -> str | None:
    """Whether a cached samples mapping still fits the split (a re-made dataset at the same
    prefix does not): rows (first, end, target) with first < end inside one document of the
    split, targets in [2, max_seq_length], enough samples. None when it fits."""
    mapping = np.asarray(mapping)
    if mapping.ndim != 2 or mapping.shape[1] != 3:
        return f"samples mapping of shape {mapping.shape}, expected [N, 3]"
    if num_samples is not None and len(mapping) < num_samples:
        return f"{len(mapping)} samples cached, {num_samples} requested"
    if len(mapping) == 0:
        return None
    first, end, target = (mapping[:, k].astype(np.int64) for k in range(3))
    if (first >= end).any() or first.min() < docs[0] or end.max() > docs[-1]:
        return "samples reference sentences outside the split"
    document = np.searchsorted(docs, first, side="right") - 1
    if (end > docs[np.minimum(document + 1, len(docs) - 1)]).any():
        return "samples cross document boundaries"
    if target.min() < 2 or target.max() > max_seq_length:
        return f"target lengths outside [2, {max_seq_length}]"
    return None
