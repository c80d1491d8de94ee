"""Dataset flags (the tokenizer section is megatron.tokenizer.config.TokenizerConfig)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron.config.base import spec

@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Where samples come from and how they are shaped."""

    data_path: list[str] | None = spec(None, nargs="*")
    """Dataset prefix, or weighted prefixes "w1 prefix1 w2 prefix2 ...", split by --split."""
    split: str = "969, 30, 1"
    """Train/validation/test proportions of --data-path, e.g. "969,30,1"."""
    train_data_path: list[str] | None = spec(None, nargs="*")
    """Dataset prefix(es) for training only (instead of --data-path and --split)."""
    valid_data_path: list[str] | None = spec(None, nargs="*")
    """Dataset prefix(es) for validation only."""
    test_data_path: list[str] | None = spec(None, nargs="*")
    """Dataset prefix(es) for testing only."""
    data_cache_path: str | None = None
    """Directory for the cached document/sample/shuffle index files."""
    mock_data: bool = False
    """Train on synthetic token samples instead of a dataset (smoke tests, benchmarks)."""
    seq_length: int | None = None
    """Tokens per sample."""
    encoder_seq_length: int | None = None
    """Encoder tokens per sample (same as --seq-length for GPT/BERT)."""
    decoder_seq_length: int | None = None
    """Decoder tokens per sample (encoder-decoder models)."""
    retriever_seq_length: int = 256
    """Tokens per retriever (ICT / biencoder) sample; retriever models are not built yet."""
    sample_rate: float = 1.0
    """Fraction of the samples to use (task datasets)."""
    mask_prob: float = 0.15
    """Probability of masking a token (BERT)."""
    short_seq_prob: float = 0.1
    """Probability of a shorter-than-maximum sample (BERT)."""
    mmap_warmup: bool = False
    """Read the whole mmap file once at start (accepted; the OS page cache does this lazily)."""
    num_workers: int = 2
    """Data-loader worker processes."""
    data_impl: Literal["mmap", "infer"] = "infer"
    """Indexed-dataset implementation (only mmap exists; infer reads the magic)."""
    dataloader_type: Literal["single", "cyclic"] | None = None
    """Sampler: single (one pass in order, resumable) or cyclic (random, reshuffled each epoch);
    defaults to single."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens."""
    eod_mask_loss: bool = False
    """Do not compute the loss on end-of-document tokens."""
    create_attention_mask_in_dataloader: bool = spec(
        True, flag="--no-create-attention-mask-in-dataloader")
    """Do not build the [s, s] attention mask per sample (the model then uses a plain causal
    mask; only valid without --reset-attention-mask)."""
    mmap_bin_files: bool = spec(True, flag="--no-mmap-bin-files")
    """Read the .bin files with plain file reads instead of mmap."""
