"""GPT pretraining samples with Megatron-Core's GPTDataset index semantics.

For the same prefix, split, sequence length, seed and sample count the document index, sample
index and shuffle index equal Megatron-Core's (``docs/FORMATS.md`` section 2b), so a run can
move between the two frameworks without changing its data order.

Legend: ``s`` = sequence length, ``E`` = epochs, ``T`` = tokens per epoch of the split.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch

from megatron.core.log import log_rank_0
from megatron.data import helpers
from megatron.data.builder import BlendedMegatronDatasetBuilder, SplitDataset
from megatron.data.dataset_config import BlendedMegatronDatasetConfig
from megatron.data.index_cache import cached_arrays
from megatron.data.indexed_dataset import IndexedDataset, data_file_path
from megatron.data.megatron_dataset import MegatronDataset
from megatron.data.utils import Split

_PAD_TOKEN_ID = -1  # marks padding inside a sample; mapped to token 0 with loss_mask 0
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclasses.dataclass(kw_only=True)
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """What GPT samples need besides the shared fields (Megatron-Core ``GPTDatasetConfig``)."""

    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens."""
    eod_mask_loss: bool = False
    """No loss on end-of-document tokens."""
    create_attention_mask: bool = True
    """Build the ``[1, s, s]`` attention mask per sample."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the final partial sample of the valid split (always dropped for train and test)."""
    add_extra_token_to_sequence: bool = True
    """Samples hold ``s + 1`` tokens: tokens are the first s, labels the last s."""


# ---------------------------------------------------------------------------------------------
# Index building (pure functions; tests compare them with an independent reference)
# ---------------------------------------------------------------------------------------------

def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int,
                      extra: int = 1) -> int:
    """Smallest E with ``E * T >= num_samples * s + extra`` (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= extra:
        raise ValueError(f"the split holds {tokens_per_epoch} tokens: too few for any sample")
    needed = num_samples * seq_length + extra
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(num_epochs: int, tokens_per_epoch: int, num_samples: int,
                         seq_length: int, extra: int = 1) -> tuple[bool, int]:
    """Whether the last epoch is shuffled apart, and the samples before it.

    The last epoch is kept separate when less than 80% of it is used, so the samples of the
    partly used epoch do not crowd the shuffled order (Megatron-Core's rule). Unlike
    Megatron-Core, no assertion on the final-epoch sample count: many epochs work.
    """
    if num_epochs == 1:
        return False, 0
    sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    from_final = num_samples - sans_final
    per_epoch = (tokens_per_epoch - extra) // seq_length
    return from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), sans_final


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """int32 ``[E * len(documents)]``: the split's documents tiled E times, shuffled."""
    if separate_final and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(document_index)
    return document_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """``arange(num_samples)`` shuffled, then ``arange(num_samples, total_size)`` shuffled apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int | None,
                      seq_length: int, seed: int, drop_last_partial_sequence: bool = True,
                      add_extra_token: bool = True, use_cpp: bool | None = None,
                      name: str = "") -> dict[str, np.ndarray]:
    """Document, sample and shuffle indices of one split (Megatron-Core order of RNG use).

    Args:
        sequence_lengths: int32 ``[S]`` of the low-level dataset.
        documents: int32 ids of the split's sequences.
        num_samples: samples requested (None: one epoch).
        seq_length: tokens per sample.
        seed: the seed of the one RandomState used for document then shuffle index.
        drop_last_partial_sequence: drop the final partial sample.
        add_extra_token: samples hold ``seq_length + 1`` tokens.
        use_cpp: see :func:`megatron.data.helpers.build_sample_idx`.
        name: for log lines.

    Returns:
        ``{"document_index", "sample_index", "shuffle_index"}``.
    """
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.sum(sequence_lengths[documents], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length, extra)
    separate, sans_final = (separate_final_epoch(num_epochs, tokens_per_epoch, num_samples,
                                                 seq_length, extra)
                            if num_samples is not None else (False, 0))
    log_rank_0(f"> {name}: {num_samples} samples of {seq_length}+{extra} tokens need "
               f"{num_epochs} epoch(s) over {tokens_per_epoch} tokens "
               f"({len(documents)} documents); separate final epoch: {separate}")
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = helpers.build_sample_idx(sequence_lengths, document_index, seq_length, num_epochs,
                                            tokens_per_epoch, drop_last_partial_sequence, extra,
                                            use_cpp=use_cpp)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_final if separate else total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index}


def validate_gpt_indices(arrays: dict[str, np.ndarray], sequence_lengths: np.ndarray,
                         documents: np.ndarray, num_samples: int | None, seq_length: int,
                         drop_last_partial_sequence: bool = True, add_extra_token: bool = True
                         ) -> str | None:
    """Whether cached indices still fit the dataset (re-made data at the same prefix does not).

    Checks, in O(documents + samples) and without rebuilding (~17 ms for 1M documents and
    2M samples, a tenth of a build): the document index has ``epochs x documents``
    entries, all of them documents of the split; the sample and shuffle indices have the
    sample count the current token count gives; the last sample-index row, and 4096 others,
    point into the document index at an offset within that document.

    Returns:
        None when they fit, else a short description of the mismatch.
    """
    extra = int(add_extra_token)
    document_index = np.asarray(arrays["document_index"])
    sample_index = np.asarray(arrays["sample_index"])
    shuffle_index = np.asarray(arrays["shuffle_index"])
    lengths = np.asarray(sequence_lengths)
    tokens = int(np.sum(lengths[documents], dtype=np.int64))
    if tokens <= extra and num_samples is not None:
        return f"the split now holds {tokens} tokens"
    epochs = num_epochs_needed(tokens, num_samples, seq_length, extra)
    if document_index.shape != (epochs * len(documents),):
        return (f"document index of {len(document_index)} entries; the split now needs "
                f"{epochs} epoch(s) x {len(documents)} documents")
    if len(document_index) and len(documents) and (int(document_index.min()) < int(documents.min())
                                or int(document_index.max()) > int(documents.max())):
        return (f"document index references documents {int(document_index.min())}.."
                f"{int(document_index.max())}; the split has {int(documents.min())}.."
                f"{int(documents.max())}")
    expected = helpers.num_samples_of(epochs * tokens, seq_length, drop_last_partial_sequence, extra)
    if sample_index.shape != (expected + 1, 2) or shuffle_index.shape != (expected,):
        return (f"{len(sample_index) - 1} samples cached; {epochs} epoch(s) of {tokens} tokens "
                f"now give {expected}")
    if expected <= 0:
        return None
    # The last row and up to 4096 evenly spaced others (a full check costs as much as a build).
    rows = sample_index[np.unique(np.linspace(0, expected, min(expected + 1, 4097)).astype(np.int64))]
    positions, offsets = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    if positions.min() < 0 or positions.max() >= len(document_index):
        return "sample index points past the document index"
    if offsets.min() < 0 or (offsets > lengths[document_index[positions]]).any():
        return "sample index offsets exceed the document sizes"
    if int(shuffle_index.max()) >= expected:
        return "shuffle index points past the samples"
    return None


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------

def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool,
                                    create_attention_mask: bool = True
                                    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Causal mask ``[1, s, s]`` (bool, True = masked), loss mask ``[s]`` and position ids ``[s]``.

    With resets, a position after an EOD token starts a new document: its position id restarts
    at 0 and (reset_attention_mask) it cannot attend to tokens at or before that EOD.
    """
    s = tokens.numel()
    is_eod = tokens == eod
    loss_mask = torch.ones(s, dtype=torch.float, device="cpu")
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    # [s] document number of each position: EODs strictly before it.
    segment = torch.cumsum(is_eod.long(), 0) - is_eod.long()
    position_ids = torch.arange(s, dtype=torch.long, device="cpu")
    if reset_position_ids:
        starts = torch.zeros(s, dtype=torch.long, device="cpu")
        starts[1:] = torch.where(is_eod[:-1], position_ids[1:], torch.zeros_like(position_ids[1:]))
        position_ids = position_ids - torch.cummax(starts, 0).values
    attention_mask = None
    if create_attention_mask:
        allowed = torch.ones(s, s, dtype=torch.bool, device="cpu").tril_()  # [s_q, s_k]
        if reset_attention_mask:
            allowed &= segment[:, None] == segment[None, :]
        attention_mask = (~allowed).unsqueeze(0)  # [1, s, s]
    return attention_mask, loss_mask, position_ids


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------

class GPTDataset(MegatronDataset):
    """Samples of ``seq_length + 1`` tokens drawn across documents of one split.

    Args:
        indexed_dataset: the low-level dataset (IndexedDataset or mock).
        dataset_path: its prefix (bookkeeping, cache location), None for mock data.
        indices: int32 sequence ids of this split.
        num_samples: samples requested (None: one epoch).
        index_split: which split.
        config: the GPT dataset config.
    """

    config: GPTDatasetConfig

    def __init__(self, indexed_dataset: Any, dataset_path: str | None, indices: np.ndarray,
                 num_samples: int | None, index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, index_split, config)
        self._pad = _PAD_TOKEN_ID
        self._cached_masks: tuple | None = None
        self._check_split_has_tokens()
        indices_ = self._build_indices()
        # Keep the np.memmap objects alive (file mapping) but index through plain ndarray
        # views of the same pages: np.memmap indexing is ~10x slower per element.
        self._mapped = indices_
        self.document_index = np.asarray(indices_["document_index"])
        self.sample_index = np.asarray(indices_["sample_index"])
        self.shuffle_index = np.asarray(indices_["shuffle_index"])

    def _check_split_has_tokens(self) -> None:
        # On every rank, before the rank-0-only index build: a failure there would leave the
        # other ranks waiting at its barrier.
        if self.num_samples is None:
            return
        extra = int(self.config.add_extra_token_to_sequence)
        lengths = np.asarray(self.dataset.sequence_lengths)
        tokens = int(np.sum(lengths[self.indices], dtype=np.int64))
        if tokens <= extra:
            fix = (f"give that split more documents with --split (now {self.config.split})"
                   if self.config.split is not None else
                   f"give --{self.index_split.name}-data-path more data")
            raise ValueError(
                f"the {self.index_split.name} split of {self.dataset_path or 'the mock data'} "
                f"holds {len(self.indices)} documents, {tokens} tokens: nothing to draw samples "
                f"from; {fix}")

    def _build_indices(self) -> dict[str, np.ndarray]:
        drop_last = (self.config.drop_last_partial_validation_sequence
                     if self.index_split == Split.valid else True)
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"

        def build() -> dict[str, np.ndarray]:
            return build_gpt_indices(
                np.asarray(self.dataset.sequence_lengths, dtype=np.int32), self.indices,
                self.num_samples, self.config.sequence_length, self.config.random_seed, drop_last,
                self.config.add_extra_token_to_sequence,
                name=f"{type(self).__name__} {self.index_split.name} ({self.dataset_path})")

        def validate(arrays: dict[str, np.ndarray]) -> str | None:
            return validate_gpt_indices(arrays, self.dataset.sequence_lengths, self.indices,
                                        self.num_samples, self.config.sequence_length, drop_last,
                                        self.config.add_extra_token_to_sequence)

        return cached_arrays(self._cache_dir(), base, self.unique_description,
                             ["document_index", "sample_index", "shuffle_index"], build, validate)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def _tokens_of_sample(self, idx: int) -> np.ndarray:
        """int64 ``[s + 1]`` tokens of shuffled sample ``idx``, padded with -1 if short."""
        extra = int(self.config.add_extra_token_to_sequence)
        j = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(v) for v in self.sample_index[j])
        doc_end, off_end = (int(v) for v in self.sample_index[j + 1])
        if doc_beg == doc_end:
            parts = [self.dataset.get(int(self.document_index[doc_beg]), offset=off_beg,
                                      length=off_end - off_beg + extra)]
        else:
            parts = []
            for i in range(doc_beg, doc_end + 1):
                offset = off_beg if i == doc_beg else 0
                length = off_end + extra if i == doc_end else None
                parts.append(self.dataset.get(int(self.document_index[i]), offset=offset,
                                              length=length))
        want = self.config.sequence_length + extra
        have = sum(len(p) for p in parts)
        if have < want:
            parts.append(np.full(want - have, self._pad, dtype=np.int64))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self._tokens_of_sample(0 if idx is None else int(idx)))
        if self.config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad
        attention_mask, loss_mask, position_ids = self._masks(tokens)
        padded = labels == self._pad
        if padded.any() or idx is None:
            loss_mask = loss_mask.clone()  # the cached mask is shared between samples
            loss_mask[padded] = 0.0
            if idx is None:  # batch padding: no loss at all
                loss_mask.zero_()
        tokens = tokens.masked_fill(tokens == self._pad, 0)
        labels = labels.masked_fill(padded, 0)
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                  "position_ids": position_ids}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        return sample

    def _masks(self, tokens: torch.Tensor) -> tuple:
        cfg = self.config
        cacheable = not (cfg.reset_position_ids or cfg.reset_attention_mask or cfg.eod_mask_loss)
        if cacheable and self._cached_masks is not None:
            return self._cached_masks
        masks = get_ltor_masks_and_position_ids(tokens, cfg.tokenizer.eod, cfg.reset_position_ids,
                                                cfg.reset_attention_mask, cfg.eod_mask_loss,
                                                cfg.create_attention_mask)
        if cacheable:
            self._cached_masks = masks
        return masks

    @staticmethod
    def numel_low_level_dataset(low_level: Any) -> int:
        """GPT splits by sequence."""
        return len(low_level.sequence_lengths)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """The mmap dataset of ``dataset_path``, its token ids checked against the tokenizer.

        Raises:
            ValueError: missing/bad files, or ids outside the (padded) vocabulary.
        """
        dataset = IndexedDataset(dataset_path, mmap=config.mmap_bin_files)
        check_token_ids(dataset, dataset_path, config.tokenizer)
        return dataset


_CHECKED_TOKEN_IDS: dict[tuple, int] = {}  # (bin path, size, mtime, limit) -> max id seen


def check_token_ids(dataset: IndexedDataset, prefix: str, tokenizer: Any) -> None:
    """Fail early when a dataset holds ids the model's embedding cannot look up.

    Runs once per dataset file (the result is kept per path, size and modification time),
    over all tokens or a sample of them (:meth:`IndexedDataset.token_id_range`), never per
    sample. The limit is the padded vocabulary (the embedding size) when the tokenizer was
    built by ``build_tokenizer``, else its vocabulary size.

    Raises:
        ValueError: an id < 0 or >= the limit, naming the prefix and the tokenizer.
    """
    padded = getattr(tokenizer, "padded_vocab_size", None)
    limit = padded or getattr(tokenizer, "vocab_size", None)
    if limit is None:
        return
    what = "padded vocabulary" if padded else "vocabulary size"
    bin_path = os.path.abspath(data_file_path(prefix))
    stat = os.stat(bin_path)
    key = (bin_path, stat.st_size, stat.st_mtime_ns, int(limit))
    if key in _CHECKED_TOKEN_IDS:
        return
    lo, hi, exhaustive = dataset.token_id_range()
    if lo < 0 or hi >= limit:
        name = getattr(tokenizer, "name", type(tokenizer).__name__)
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"dataset {prefix} holds token id {bad}, outside the vocabulary of the {name} "
            f"tokenizer (ids 0..{int(limit) - 1}, {what} {int(limit)}): the dataset was "
            "made with another tokenizer; check --data-path against --tokenizer-type and "
            "--vocab-file/--merge-file/--tokenizer-model/--vocab-size")
    if not exhaustive:
        log_rank_0(f"> {prefix}: token ids checked on a sample of the data (max {hi} < {limit})")
    _CHECKED_TOKEN_IDS[key] = hi


class MockGPTLowLevelDataset:
    """Synthetic documents as Megatron-Core's: 100000 documents of lengths drawn from
    ``default_rng(0).integers(1, 4096)``, tokens ``1, 2, ..., len-1, eod``.

    Megatron-Core writes ids up to 4094 whatever the vocabulary. Here the ordinary ids wrap
    around below the vocabulary (``1 .. high-1``, then ``1`` again; ``high`` = the vocabulary
    size, less one when the last id is the EOD), which is the same data when the vocabulary
    holds 4096 ids or more, and in-range ids for a small ``--vocab-size``.

    Raises:
        ValueError: a vocabulary with no ordinary id besides 0 and the EOD.
    """

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size,
                                             dtype=np.int32)
        self._wrap = None  # None: Megatron-Core's ids 1 .. len-1 are all in the vocabulary
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if vocab_size is not None:
            high = int(vocab_size) - (1 if tokenizer.eod == int(vocab_size) - 1 else 0)
            if high < 2:
                raise ValueError(f"--mock-data needs a vocabulary with an id besides 0 and the "
                                 f"end-of-document id; got vocab size {vocab_size} (raise "
                                 "--vocab-size)")
            if high - 1 < self.max_sequence_length - 2:  # the largest id Megatron-Core writes
                self._wrap = high - 1
                log_rank_0(f"> mock data: ids wrap around below the vocabulary ({vocab_size} "
                           f"ids, --vocab-size < {self.max_sequence_length}); Megatron-Core "
                           f"would write ids up to {self.max_sequence_length - 2}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        ids = np.arange(length - 1, dtype=np.int64)
        if self._wrap is not None:
            ids %= self._wrap
        return np.concatenate([ids + 1, np.array([self.tokenizer.eod], dtype=np.int64)])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


# The last mock split's indices, by (description, split): Megatron-Core's mock corpus is ~200M
# tokens, so a short --seq-length makes a shuffle index of millions of samples; a process that
# trains again on the same mock data (a finetune after a pretrain, test worlds) reuses it.
_MOCK_INDICES: dict[tuple, dict[str, np.ndarray]] = {}


class MockGPTDataset(GPTDataset):
    """GPTDataset over :class:`MockGPTLowLevelDataset` (``--mock-data``), never cached on disk
    (as Megatron-Core); the last indices built are kept in memory."""

    def _cache_dir(self) -> str | None:
        return None

    def _build_indices(self) -> dict[str, np.ndarray]:
        key = (self.unique_description, self.index_split.name,
               self.config.drop_last_partial_validation_sequence,
               self.config.add_extra_token_to_sequence)
        if key not in _MOCK_INDICES:
            arrays = super()._build_indices()
            for array in arrays.values():
                array.setflags(write=False)  # shared by every dataset built from this key
            if len(_MOCK_INDICES) >= 3:  # one mock run's train, valid and test splits
                _MOCK_INDICES.clear()
            _MOCK_INDICES[key] = arrays
        return _MOCK_INDICES[key]

    @staticmethod
    def numel_low_level_dataset(low_level: Any) -> int:
        return len(low_level)

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: GPTDatasetConfig) -> Any:
        return MockGPTLowLevelDataset(config.tokenizer)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def build_train_valid_test_datasets(config: GPTDatasetConfig,
                                    train_valid_test_num_samples: list[int | None]
                                    ) -> list[SplitDataset | None]:
    """Train, valid and test datasets (GPTDataset, BlendedDataset or MockGPTDataset, or None).

    Args:
        config: the GPT dataset config (the caller maps its flags onto it, e.g.
            ``megatron.config.datasets.gpt_dataset_config``).
        train_valid_test_num_samples: samples the schedule needs per split.

    Raises:
        ValueError: missing/invalid dataset files.
    """
    cls = MockGPTDataset if config.mock else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, list(train_valid_test_num_samples), config).build()
