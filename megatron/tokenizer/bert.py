"""BERT WordPiece (``BertWordPieceLowerCase`` / ``BertWordPieceCase``) on top of HF tokenizers.

The ids are those of Google's ``tokenization.py`` ``FullTokenizer`` (which Megatron-LM copies):
clean control characters, pad CJK characters with spaces, split on whitespace, (lowercase and
strip accents), split on punctuation, then greedy longest-match WordPiece with ``##``
continuations; words over 100 characters become ``[UNK]``. HF ``tokenizers`` implements the
same steps in Rust. We assemble the pipeline by hand rather than with
``BertWordPieceTokenizer`` because that class registers ``[CLS]``/``[SEP]``... as added tokens,
so a literal "[SEP]" in the text would become one id, where Google's tokenizer splits it into
``[``, ``sep``, ``]``.

Like Megatron-LM, ``[BOS]`` and ``[EOS]`` are appended to the vocabulary (bert-base-uncased:
30522 -> 30524) and ``[EOS]`` is the end-of-document id.
"""

from __future__ import annotations

import os
import unicodedata

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from megatron.tokenizer.base import AbstractTokenizer

_MAX_INPUT_CHARS_PER_WORD = 100  # Google's WordpieceTokenizer default


def load_vocab(vocab_file: str | os.PathLike) -> dict[str, int]:
    """Google's ``load_vocab``: one token per line, stripped, id = line number.

    A token repeated after stripping keeps its last line number, as in Google's dict update.
    """
    vocab: dict[str, int] = {}
    with open(vocab_file, encoding="utf-8") as f:
        for index, line in enumerate(f):
            vocab[line.strip()] = index
    return vocab


class BertWordPieceTokenizer(AbstractTokenizer):
    """Google BERT tokenization with Megatron-LM's added ``[BOS]``/``[EOS]``/``<extra_id_N>``.

    Args:
        vocab_file: BERT ``vocab.txt``.
        lower_case: lowercase and strip accents (uncased models).
        vocab_extra_ids: number of ``<extra_id_N>`` sentinel tokens to append (T5-style).

    Raises:
        ValueError: the vocabulary lacks ``[CLS]``, ``[SEP]``, ``[PAD]``, ``[MASK]`` or ``[UNK]``.
    """

    def __init__(self, vocab_file: str | os.PathLike, lower_case: bool = True,
                 vocab_extra_ids: int = 0) -> None:
        super().__init__("BERT Lower Case" if lower_case else "BERT Upper Case")
        self._vocab = load_vocab(vocab_file)
        missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]") if t not in self._vocab]
        if missing:
            raise ValueError(f"{vocab_file}: BERT vocabulary lacks {missing}")
        # Built before the additions: the WordPiece model never produces [BOS]/[EOS]/extra ids.
        self.lower_case = lower_case
        self._tokenizer = _wordpiece_pipeline(dict(self._vocab), lower_case)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self.cls_id, self.sep_id = self._vocab["[CLS]"], self._vocab["[SEP]"]
        self.pad_id, self.mask_id = self._vocab["[PAD]"], self._vocab["[MASK]"]
        self._bos_token_id = self._add_token("[BOS]")
        self._eos_token_id = self._add_token("[EOS]")
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self.additional_special_tokens:
            self._add_token(token)

    def _add_token(self, token: str) -> int:
        if token not in self._vocab:
            # Megatron-LM's add_token: the next id is the current vocabulary length.
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        return self._vocab[token]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(self._prepare(text), add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        texts = [self._prepare(t) for t in texts]
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def _prepare(self, text: str) -> str:
        """Lowercase in Python where HF's per-character lowercase would differ from Google's.

        Google lowercases each whitespace-separated word with ``str.lower``, which writes a
        word-final capital sigma as "ς"; HF maps every "Σ" to "σ". Only then do we pay for the
        Python pass (the rest of the pipeline is idempotent on its output).
        """
        if not self.lower_case or "Σ" not in text:
            return text
        return " ".join(word.lower() for word in _clean_text(text).split())

    def detokenize(self, token_ids: list[int]) -> str:
        """Google's ``convert_tokens_to_string``: join with spaces, glue ``##`` pieces."""
        tokens = [self._inv_vocab[int(i)] for i in token_ids]
        return " ".join(tokens).replace(" ##", "").strip()

    decode = detokenize

    @property
    def cls(self) -> int:
        return self.cls_id

    @property
    def sep(self) -> int:
        return self.sep_id

    @property
    def pad(self) -> int:
        return self.pad_id

    @property
    def mask(self) -> int:
        return self.mask_id

    @property
    def bos_token_id(self) -> int:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def eod(self) -> int:
        return self._eos_token_id

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self._vocab[t] for t in self.additional_special_tokens]


def _wordpiece_pipeline(vocab: dict[str, int], lower_case: bool) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]",
                                           max_input_chars_per_word=_MAX_INPUT_CHARS_PER_WORD))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


def _clean_text(text: str) -> str:
    """Google's ``_clean_text``: drop NUL, U+FFFD and control characters; whitespace -> space."""
    out = []
    for ch in text:
        if ch in "\t\n\r":
            out.append(" ")
            continue
        category = unicodedata.category(ch)
        if ch in "\x00\ufffd" or category.startswith("C"):
            continue
        out.append(" " if ch == " " or category == "Zs" else ch)
    return "".join(out)
