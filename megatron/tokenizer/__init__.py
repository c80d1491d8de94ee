"""Tokenizers with Megatron-LM's names, interface and ids (``--tokenizer-type``).

``build_tokenizer(cfg.tokenizer, tp, divisible_by)`` builds one; ``vocab_size_with_padding``
gives the embedding size. Backends: tiktoken (GPT-2 BPE), HF tokenizers (BERT WordPiece,
tokenizer.json), sentencepiece.
"""

from megatron.tokenizer.base import AbstractTokenizer
from megatron.tokenizer.build import build_tokenizer, create_tokenizer, vocab_size_with_padding
from megatron.tokenizer.config import TokenizerConfig

__all__ = ["AbstractTokenizer", "TokenizerConfig", "build_tokenizer", "create_tokenizer",
           "vocab_size_with_padding"]
