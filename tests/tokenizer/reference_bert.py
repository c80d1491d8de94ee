"""A pure-Python BERT tokenizer written from the published algorithm of Google's BERT
``tokenization.py`` (which Megatron-LM's ``bert_tokenization.py`` copies), character by
character, with Python's ``unicodedata`` as the only character table:

1. basic tokenization: clean the text (drop NUL, U+FFFD and control characters, i.e. category
   Cc or Cf other than tab, newline and carriage return; every whitespace character becomes a
   space), put spaces around CJK ideographs, split on whitespace; for an uncased vocabulary
   lowercase each word and strip accents (NFD, drop category Mn); split each word into runs of
   non-punctuation and single punctuation characters;
2. WordPiece: greedy longest-match-first with ``##`` continuations; a word longer than 200
   characters, or one with a piece missing from the vocabulary, becomes ``[UNK]``.

Independent of megatron.tokenizer on purpose: tests compare the fast tokenizer's ids to these.
"""

from __future__ import annotations

import unicodedata

MAX_INPUT_CHARS_PER_WORD = 200  # Megatron-LM's bert_tokenization.py WordpieceTokenizer

# Ideograph blocks as Google lists them (CJK Unified Ideographs, Extensions A-E, and the
# Compatibility Ideographs): not Hangul, Hiragana or Katakana.
CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
              (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def is_whitespace(ch: str) -> bool:
    """Space, tab, newline, carriage return, or any space separator (category Zs)."""
    if ch in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(ch) == "Zs"


def is_control(ch: str) -> bool:
    """Category Cc or Cf, except tab, newline and carriage return (counted as whitespace).

    Private-use (Co), unassigned (Cn) and surrogate (Cs) characters are *not* control.
    """
    if ch in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(ch) in ("Cc", "Cf")


def is_punctuation(ch: str) -> bool:
    """Every non-alphanumeric printable ASCII character (e.g. ``$``, ``^``, backtick), or any
    Unicode punctuation (category P*)."""
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def is_cjk(cp: int) -> bool:
    for lo, hi in CJK_RANGES:
        if lo <= cp <= hi:
            return True
    return False


class ReferenceBert:
    """``tokenize(text)`` -> ids exactly as Google's FullTokenizer + convert_tokens_to_ids."""

    def __init__(self, vocab_file: str, lower_case: bool) -> None:
        self.vocab: dict[str, int] = {}
        with open(vocab_file, encoding="utf-8") as f:
            for i, line in enumerate(f):
                self.vocab[line.strip()] = i  # a repeated token keeps its last line
        self.lower_case = lower_case

    # -- basic tokenizer ----------------------------------------------------------------------

    @staticmethod
    def clean(text: str) -> str:
        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or is_control(ch):
                continue
            out.append(" " if is_whitespace(ch) else ch)
        return "".join(out)

    @staticmethod
    def space_cjk(text: str) -> str:
        out = []
        for ch in text:
            if is_cjk(ord(ch)):
                out.extend((" ", ch, " "))
            else:
                out.append(ch)
        return "".join(out)

    @staticmethod
    def strip_accents(word: str) -> str:
        out = []
        for ch in unicodedata.normalize("NFD", word):
            if unicodedata.category(ch) != "Mn":
                out.append(ch)
        return "".join(out)

    @staticmethod
    def split_punctuation(word: str) -> list[str]:
        pieces: list[list[str]] = []
        start_new = True
        for ch in word:
            if is_punctuation(ch):
                pieces.append([ch])
                start_new = True
            else:
                if start_new:
                    pieces.append([])
                start_new = False
                pieces[-1].append(ch)
        return ["".join(p) for p in pieces]

    def basic(self, text: str) -> list[str]:
        text = self.space_cjk(self.clean(text))
        words = []
        for word in text.strip().split():
            if self.lower_case:
                word = self.strip_accents(word.lower())
            words.extend(self.split_punctuation(word))
        return " ".join(words).strip().split()

    # -- WordPiece ----------------------------------------------------------------------------

    def wordpiece(self, word: str) -> list[str]:
        if len(word) > MAX_INPUT_CHARS_PER_WORD:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(word):
            end, found = len(word), None
            while start < end:
                piece = word[start:end]
                if start > 0:
                    piece = "##" + piece
                if piece in self.vocab:
                    found = piece
                    break
                end -= 1
            if found is None:
                return ["[UNK]"]
            pieces.append(found)
            start = end
        return pieces

    def tokenize(self, text: str) -> list[int]:
        return [self.vocab[p] for w in self.basic(text) for p in self.wordpiece(w)]
