"""A pure-Python BERT tokenizer written from the published algorithm (Google tokenization.py):
basic tokenization (clean, CJK spacing, whitespace split, lowercase + accent strip, punctuation
split) then greedy longest-match-first WordPiece.

Independent of megatron.tokenizer on purpose: tests compare the fast tokenizer's ids to these.
"""

from __future__ import annotations

import unicodedata


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    if ch in "\t\n\r":
        return False
    return unicodedata.category(ch).startswith("C")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # Every non-letter/number ASCII character counts, e.g. "^", "$", "`".
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    ranges = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
              (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]
    return any(lo <= cp <= hi for lo, hi in ranges)


class ReferenceBert:
    """tokenize(text) -> ids exactly as Google's FullTokenizer + convert_tokens_to_ids."""

    def __init__(self, vocab_file: str, lower_case: bool) -> None:
        self.vocab = {}
        with open(vocab_file, encoding="utf-8") as f:
            for i, line in enumerate(f):
                self.vocab[line.strip()] = i
        self.lower_case = lower_case

    def _clean(self, text: str) -> str:
        out = []
        for ch in text:
            if ord(ch) == 0 or ord(ch) == 0xFFFD or _is_control(ch):
                continue
            out.append(" " if _is_whitespace(ch) else ch)
        return "".join(out)

    def _split_punct(self, token: str) -> list[str]:
        pieces: list[list[str]] = []
        new_word = True
        for ch in token:
            if _is_punctuation(ch):
                pieces.append([ch])
                new_word = True
            else:
                if new_word:
                    pieces.append([])
                new_word = False
                pieces[-1].append(ch)
        return ["".join(p) for p in pieces]

    def basic(self, text: str) -> list[str]:
        text = self._clean(text)
        text = "".join(f" {ch} " if _is_cjk(ord(ch)) else ch for ch in text)
        words = []
        for token in text.strip().split():
            if self.lower_case:
                token = token.lower()
                token = "".join(c for c in unicodedata.normalize("NFD", token)
                                if unicodedata.category(c) != "Mn")
            words.extend(self._split_punct(token))
        return " ".join(words).strip().split()

    def wordpiece(self, word: str) -> list[str]:
        if len(word) > 100:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(word):
            end, found = len(word), None
            while start < end:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
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
