"""``build_tokenizer``: the tokenizer named by ``--tokenizer-type``, and the padded vocab size."""

from __future__ import annotations

import os

from megatron.core.log import log_rank_0
from megatron.tokenizer.base import AbstractTokenizer
from megatron.tokenizer.config import (BERT_TOKENIZERS, FILE_FIELDS, REQUIRED_FIELDS,
                                       TokenizerConfig)


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by x TP``.

    The padding keeps the embedding GEMMs aligned and lets every TP rank hold an equal slice.

    Raises:
        ValueError: a non-positive multiple.
    """
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    if multiple <= 0:
        raise ValueError(f"--make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) x "
                         f"tensor-model-parallel-size ({tensor_model_parallel_size}) must be > 0")
    return -(-orig_vocab_size // multiple) * multiple


def create_tokenizer(cfg: TokenizerConfig) -> AbstractTokenizer:
    """The tokenizer of ``cfg``, without logging or padding (for worker processes).

    Raises:
        ValueError: unknown type, a file/size flag the type needs is missing, or a tokenizer
            file does not exist or cannot be read (naming the flag and the path).
    """
    kind = cfg.tokenizer_type
    if kind not in REQUIRED_FIELDS:
        raise ValueError(f"--tokenizer-type {kind!r} is not supported; choose one of {list(REQUIRED_FIELDS)}")
    for field in REQUIRED_FIELDS[kind]:
        if getattr(cfg, field) is None:
            raise ValueError(f"--tokenizer-type {kind} needs --{field.replace('_', '-')}")
    for field in REQUIRED_FIELDS[kind]:
        flag, value = f"--{field.replace('_', '-')}", getattr(cfg, field)
        # HuggingFaceTokenizer checks its own path (a file or a directory).
        if field in FILE_FIELDS and kind != "HuggingFaceTokenizer" and not os.path.isfile(value):
            what = "is a directory, not a file" if os.path.isdir(value) else "does not exist"
            raise ValueError(f"{flag} {value} {what} (--tokenizer-type {kind})")
    try:
        return _create(kind, cfg)
    except OSError as err:  # unreadable file: name it instead of a traceback
        path = err.filename or "a tokenizer file"
        raise ValueError(f"--tokenizer-type {kind}: cannot read {path} ({err.strerror or err})"
                         ) from err
    except ValueError as err:  # a file of the wrong format (e.g. not JSON): name the files
        files = ", ".join(f"--{f.replace('_', '-')} {getattr(cfg, f)}"
                          for f in REQUIRED_FIELDS[kind] if f in FILE_FIELDS)
        raise ValueError(f"--tokenizer-type {kind}: cannot load {files}: {err}") from err


def _create(kind: str, cfg: TokenizerConfig) -> AbstractTokenizer:
    # Imported lazily: each backend library costs start-up time only when used.
    if kind == "GPT2BPETokenizer":
        from megatron.tokenizer.gpt2 import GPT2BPETokenizer
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if kind in BERT_TOKENIZERS:
        from megatron.tokenizer.bert import BertWordPieceTokenizer
        return BertWordPieceTokenizer(cfg.vocab_file, lower_case=kind == "BertWordPieceLowerCase",
                                      vocab_extra_ids=cfg.vocab_extra_ids)
    if kind == "SentencePieceTokenizer":
        from megatron.tokenizer.spm import SentencePieceTokenizer
        return SentencePieceTokenizer(cfg.tokenizer_model, vocab_extra_ids=cfg.vocab_extra_ids)
    if kind == "GPTSentencePieceTokenizer":
        from megatron.tokenizer.spm import GPTSentencePieceTokenizer
        return GPTSentencePieceTokenizer(cfg.tokenizer_model)
    if kind == "Llama2Tokenizer":
        from megatron.tokenizer.spm import Llama2Tokenizer
        return Llama2Tokenizer(cfg.tokenizer_model)
    if kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface import HuggingFaceTokenizer
        return HuggingFaceTokenizer(cfg.tokenizer_model)
    from megatron.tokenizer.null import NullTokenizer
    return NullTokenizer(cfg.vocab_size)


def build_tokenizer(tokenizer_config: TokenizerConfig, tensor_model_parallel_size: int = 1,
                    make_vocab_size_divisible_by: int = 128,
                    padded_vocab_size: int | None = None) -> AbstractTokenizer:
    """The tokenizer of ``--tokenizer-type``; sets its ``padded_vocab_size``.

    Args:
        tokenizer_config: the tokenizer flags.
        tensor_model_parallel_size: TP size (the padding multiple grows with it).
        make_vocab_size_divisible_by: ``--make-vocab-size-divisible-by``.
        padded_vocab_size: the size the model is built with when it is not the flags' padding
            (the checkpoint's, with --use-checkpoint-args); logged as the one built.

    Raises:
        ValueError: unknown type, or a file/size flag the type needs is missing.
    """
    log_rank_0(f"> building {tokenizer_config.tokenizer_type} tokenizer ...")
    tokenizer = create_tokenizer(tokenizer_config)
    padded = vocab_size_with_padding(tokenizer.vocab_size, make_vocab_size_divisible_by,
                                     tensor_model_parallel_size)
    whose = ""
    if padded_vocab_size is not None and padded_vocab_size != padded:
        whose = (f", the checkpoint's embedding size; --make-vocab-size-divisible-by "
                 f"{make_vocab_size_divisible_by} x TP {tensor_model_parallel_size} gives {padded}")
        padded = padded_vocab_size
    log_rank_0(f" > padded vocab (size: {tokenizer.vocab_size}) with "
               f"{padded - tokenizer.vocab_size} dummy tokens (new size: {padded}{whose})")
    tokenizer.padded_vocab_size = padded
    return tokenizer
