"""A pure-Python GPT-2 byte-level BPE written from the published algorithm (OpenAI encoder.py).

Independent of megatron.tokenizer on purpose: tests compare the fast tokenizer's ids to these,
and bench/bench_preprocess.py times it as the plain-Python baseline (Megatron-LM's approach: a
per-word-cached Python BPE loop). It lives here, not in tests/, because bench/ never imports
tests/; tests import it from here.
"""

from __future__ import annotations

import json

import regex

PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def byte_alphabet() -> dict[int, str]:
    """Printable bytes map to themselves; the other 68 to chr(256), chr(257), ... in byte order."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


class ReferenceGPT2:
    """encode(text) -> ids exactly as OpenAI's Encoder.encode."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")[1:-1]
        self.merge_rank = {tuple(line.split()): i for i, line in enumerate(lines)}
        self.alphabet = byte_alphabet()
        self.cache: dict[str, list[str]] = {}

    def bpe(self, piece: str) -> list[str]:
        if piece in self.cache:
            return self.cache[piece]
        word = list(piece)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: self.merge_rank.get(p, float("inf")))
            if best not in self.merge_rank:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        self.cache[piece] = word
        return word

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in PATTERN.findall(text):
            chars = "".join(self.alphabet[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(chars))
        return ids

    def decode(self, ids: list[int]) -> str:
        inverse_vocab = {i: t for t, i in self.encoder.items()}
        inverse_bytes = {c: b for b, c in self.alphabet.items()}
        text = "".join(inverse_vocab[i] for i in ids)
        return bytes(inverse_bytes[c] for c in text).decode("utf-8", errors="replace")
