"""BERT WordPiece (``BertWordPieceLowerCase`` / ``BertWordPieceCase``) on top of HF tokenizers.

The ids are exactly those of Google's ``tokenization.py`` ``FullTokenizer``, which Megatron-LM's
``bert_tokenization.py`` copies: clean the text (drop NUL, U+FFFD and characters of category Cc
or Cf except tab/newline/carriage return), put spaces around CJK ideographs, split on
whitespace, (lowercase and strip accents: NFD, drop category Mn), split off every punctuation
character, then greedy longest-match WordPiece with ``##`` continuations; words over 200
characters become ``[UNK]``.

HF ``tokenizers``' own ``BertNormalizer``/``BertPreTokenizer`` differ from Google's in corners:
their ``clean_text`` also drops private-use and unassigned characters, their WordPiece default is
100 characters, their CJK table misses U+2B820..U+2B91F and their Unicode tables (punctuation,
lowercase) are another Unicode version than Python's. So every character class here comes from
Python's ``unicodedata`` (Megatron-LM's tables): the cleaning, lowercasing and NFD run in
Python (C-speed ``re``/``str`` calls), and HF runs, in Rust, only the deletion of Mn characters,
the whitespace split, the isolation of punctuation and CJK characters (as explicit code-point
classes) and WordPiece. We assemble the pipeline by hand rather than with
``BertWordPieceTokenizer`` because that class registers ``[CLS]``/``[SEP]``... as added tokens,
so a literal "[SEP]" in the text would become one id, where Google's tokenizer splits it into
``[``, ``sep``, ``]``.

Like Megatron-LM, ``[BOS]`` and ``[EOS]`` are appended to the vocabulary (bert-base-uncased:
30522 -> 30524) and ``[EOS]`` is the end-of-document id.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import re
import unicodedata

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from megatron.tokenizer.base import VocabTokenizer, read_utf8

_MAX_INPUT_CHARS_PER_WORD = 200  # Megatron-LM's bert_tokenization.py (Google's default is 100)
# Google's CJK ideograph blocks (not Hangul, Hiragana or Katakana).
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
# Stands in for a lone surrogate (which Rust strings cannot hold): like the surrogate, it is
# neither whitespace, punctuation, control nor a mark, so its word becomes [UNK].
_SURROGATE_STAND_IN = "\U0010FFFF"
_SURROGATES = re.compile("[\ud800-\udfff]")


def load_vocab(vocab_file: str | os.PathLike) -> dict[str, int]:
    """Google's ``load_vocab``: one token per line, stripped, id = line number.

    A token repeated after stripping keeps its last line number, as in Google's dict update.
    """
    vocab: dict[str, int] = {}
    # Text-mode line splitting (\n, \r\n, \r), as Google's reader sees the file.
    for index, line in enumerate(io.StringIO(read_utf8(vocab_file), newline=None)):
        vocab[line.strip()] = index
    return vocab


class BertWordPieceTokenizer(VocabTokenizer):
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
        self._set_vocab(load_vocab(vocab_file))
        self._vocab_file = os.fspath(vocab_file)
        missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]") if t not in self._vocab]
        if missing:
            raise ValueError(f"{vocab_file}: BERT vocabulary lacks {missing}")
        # Built before the additions: the WordPiece model never produces [BOS]/[EOS]/extra ids.
        self.lower_case = lower_case
        self._tokenizer = _wordpiece_pipeline(dict(self._vocab), lower_case)
        self.cls_id, self.sep_id = self._vocab["[CLS]"], self._vocab["[SEP]"]
        self.pad_id, self.mask_id = self._vocab["[PAD]"], self._vocab["[MASK]"]
        self._bos_token_id = self._add_token("[BOS]")
        self._eos_token_id = self._add_token("[EOS]")
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self.additional_special_tokens:
            self._add_token(token)

    def tokenize(self, text: str) -> list[int]:
        text = self._prepare(text)
        try:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:  # a lone surrogate: Rust strings cannot hold one
            text = _SURROGATES.sub(_SURROGATE_STAND_IN, text)
            return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        texts = [self._prepare(t) for t in texts]
        try:
            encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        except TypeError:
            texts = [_SURROGATES.sub(_SURROGATE_STAND_IN, t) for t in texts]
            encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def _prepare(self, text: str) -> str:
        """The Python half of Google's basic tokenizer: clean, then lowercase and decompose.

        Lowercasing the whole text equals Google's per-word ``str.lower`` (the only
        context-sensitive rule, final sigma, looks no further than the neighbouring whitespace
        or CJK character), and NFD of the whole text equals NFD per word.
        """
        classes = _char_classes()
        if not text.isascii():
            text = classes.control.sub("", text)
        elif classes.ascii_control.search(text):
            text = classes.ascii_control.sub("", text)
        if self.lower_case:
            text = text.lower()
            if not text.isascii():
                text = unicodedata.normalize("NFD", text)
        return text

    def detokenize(self, token_ids: list[int]) -> str:
        """Google's ``convert_tokens_to_string``: join with spaces, glue ``##`` pieces."""
        tokens = [self._inv_vocab[int(i)] for i in token_ids]
        return " ".join(tokens).replace(" ##", "").strip()

    decode = detokenize

    @property
    def unique_identifiers(self) -> dict:
        """What dataset cache descriptions record of this tokenizer, in Megatron-LM's form, so
        the cache file names (md5 of the description) match Megatron-Core's."""
        return {"class": "_BertWordPieceTokenizer", "tokenizer_path": [self._vocab_file],
                "lower_case": str(self.lower_case),
                "vocab_extra_ids": str(len(self.additional_special_tokens))}

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


@dataclasses.dataclass(frozen=True)
class _CharClasses:
    """Google's character classes, from Python's ``unicodedata``."""

    control: re.Pattern  # Python regex: NUL, U+FFFD, Cc/Cf except \t \n \r (dropped)
    ascii_control: re.Pattern  # the same restricted to ASCII (fast path)
    nonspacing_marks: str  # Oniguruma class: category Mn (dropped after NFD when lowercasing)
    split_alone: str  # Oniguruma class: punctuation and CJK ideographs (each its own word)


def _ranges(code_points: list[int]) -> list[tuple[int, int]]:
    """Sorted code points -> inclusive (first, last) runs."""
    runs: list[tuple[int, int]] = []
    for cp in code_points:
        if runs and runs[-1][1] == cp - 1:
            runs[-1] = (runs[-1][0], cp)
        else:
            runs.append((cp, cp))
    return runs


def _python_class(code_points: list[int]) -> str:
    return "[" + "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
                         for a, b in _ranges(code_points)) + "]"


def _oniguruma_class(code_points: list[int]) -> str:
    return "[" + "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}"
                         for a, b in _ranges(code_points)) + "]"


@functools.cache
def _char_classes() -> _CharClasses:
    # One pass over every code point (~0.3 s, once per process).
    categories = list(map(unicodedata.category, map(chr, range(0x110000))))
    control = [cp for cp, cat in enumerate(categories)
               if (cat in ("Cc", "Cf") and cp not in (0x09, 0x0A, 0x0D)) or cp == 0xFFFD]
    marks = [cp for cp, cat in enumerate(categories) if cat == "Mn"]
    alone = {cp for cp, cat in enumerate(categories) if cat[0] == "P"}
    # Every printable non-alphanumeric ASCII character counts as punctuation ("$", "^", "`").
    alone.update(cp for lo, hi in ((33, 47), (58, 64), (91, 96), (123, 126))
                 for cp in range(lo, hi + 1))
    alone.update(cp for lo, hi in _CJK_RANGES for cp in range(lo, hi + 1))
    return _CharClasses(control=re.compile(_python_class(control)),
                        ascii_control=re.compile(_python_class([cp for cp in control if cp < 128])),
                        nonspacing_marks=_oniguruma_class(marks),
                        split_alone=_oniguruma_class(sorted(alone)))


def _wordpiece_pipeline(vocab: dict[str, int], lower_case: bool) -> Tokenizer:
    """HF's half: (drop Mn), whitespace split, isolate punctuation/CJK, WordPiece."""
    classes = _char_classes()
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]",
                                           max_input_chars_per_word=_MAX_INPUT_CHARS_PER_WORD))
    if lower_case:
        tokenizer.normalizer = normalizers.Replace(Regex(classes.nonspacing_marks), "")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(classes.split_alone), behavior="isolated")])
    return tokenizer
