"""The tokenizer layer's config; the CLI's ``tokenizer`` flag section is this class itself."""

from __future__ import annotations

import dataclasses
from typing import Literal

TokenizerType = Literal["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                        "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                        "Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer"]

# The flags each tokenizer type needs (validation and the builder read the same table).
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}
FILE_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")

BERT_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase")
"""Tokenizers with the [CLS]/[SEP]/[MASK]/[PAD] tokens BERT samples are made of, and that split
text into words and WordPiece sub-tokens (pretrain_bert.py and the SQuAD task accept only these)."""


@dataclasses.dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer turns text into ids, and its files."""

    tokenizer_type: TokenizerType | None = None
    """Tokenizer kind."""
    vocab_file: str | None = None
    """Vocabulary file (GPT-2 vocab.json, BERT vocab.txt)."""
    merge_file: str | None = None
    """BPE merges file (GPT-2 merges.txt)."""
    vocab_size: int | None = None
    """Vocabulary size of the NullTokenizer."""
    vocab_extra_ids: int = 0
    """Extra sentinel tokens added to the vocabulary (T5)."""
    tokenizer_model: str | None = None
    """SentencePiece model file, or a HuggingFace tokenizer.json / directory."""
