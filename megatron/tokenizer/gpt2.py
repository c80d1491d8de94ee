"""GPT-2 byte-level BPE (``--tokenizer-type GPT2BPETokenizer``) on top of tiktoken.

The ids are those of OpenAI's ``encoder.py`` (and Megatron-LM's ``gpt2_tokenization.py``): text
is split with the GPT-2 regex, each piece's UTF-8 bytes are mapped to printable characters
(``bytes_to_unicode``) and merged by ``merges.txt`` priority: repeatedly, the adjacent *pair*
listed earliest in ``merges.txt`` is merged. tiktoken runs a close cousin in Rust, about 10x
faster than the pure-Python loop (docs/benchmarks.md, Preprocessing): it merges any adjacent pair
whose concatenation is a token, ranked by the rank of the merged *token*. We give merge ``i``
the rank ``256 + i``, so priorities are the merges order, and map ranks back to the ids of
``vocab.json`` (an identity for GPT-2's own files, whose ids follow that order).

The two rules give the same ids when the merges are *rank-consistent*; GPT-2's own files and
``tools/train_tokenizer.py``'s output are. Other merge files need not be (a merge listed twice
with the same result, a merge using a token made only by a later merge, or a token that
tiktoken would assemble from another pair than its listed one), so at load time we check
(:func:`rank_consistency_problem`) and, when the check fails, tokenize with HF ``tokenizers``'
BPE instead, which ranks by pair exactly as OpenAI does (several times slower than tiktoken).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import tiktoken

from megatron.core.log import warn_rank_0
from megatron.tokenizer.base import (VocabTokenizer, load_vocab_json, megatron_identifiers,
                                     read_utf8)

# OpenAI's pattern, verbatim from encoder.py.
GPT2_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
EOD_TOKEN = "<|endoftext|>"


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """OpenAI's reversible byte -> printable character table (the alphabet of vocab.json)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = dict(bytes_to_unicode())  # latin-1 code point (= byte) -> alphabet character


def token_to_bytes(token: str) -> bytes:
    """The bytes a vocab.json token string stands for.

    Raises:
        ValueError: a character outside the byte alphabet.
    """
    # str.translate + latin-1 runs in C: 50k tokens in milliseconds, not a Python loop.
    try:
        return token.translate(_byte_translation()).encode("latin-1")
    except UnicodeEncodeError as err:
        raise ValueError(f"token {token!r} has a character outside the GPT-2 byte alphabet") from err


@functools.cache
def _byte_translation() -> dict[int, int]:
    """Alphabet character -> its byte; raw characters that are not in the alphabet -> an
    unencodable code point, so that latin-1 encoding rejects them."""
    table = {ord(ch): b for b, ch in bytes_to_unicode().items()}
    for b in range(256):
        table.setdefault(b, 0xFFFF)
    return table


def load_merges(merge_file: str | os.PathLike) -> list[tuple[str, str]]:
    """The merge pairs of ``merges.txt``, in priority order.

    Raises:
        ValueError: a line that is not two space-separated tokens.
    """
    merges = []
    lines = read_utf8(merge_file).split("\n")
    for lineno, line in enumerate(lines, 1):
        # OpenAI skips the first line ("#version: ...") and the empty string after the final
        # newline; we skip a '#version' header and blank lines: the same on well-formed files.
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        pair = line.split()
        if len(pair) != 2:
            raise ValueError(f"{merge_file}:{lineno}: expected two tokens, got {line!r}")
        merges.append((pair[0], pair[1]))
    return merges


class GPT2BPETokenizer(VocabTokenizer):
    """OpenAI GPT-2 BPE from ``vocab.json`` + ``merges.txt``; EOD is ``<|endoftext|>``.

    Args:
        vocab_file: GPT-2 ``vocab.json`` (token string -> id).
        merge_file: GPT-2 ``merges.txt``.

    Raises:
        ValueError: unreadable files, a merge whose result is not in the vocabulary, or no
            ``<|endoftext|>`` token.
    """

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike) -> None:
        super().__init__("GPT2 BPE")
        self.unique_identifiers = megatron_identifiers("_GPT2BPETokenizer", vocab_file, merge_file)
        tables = _tables(vocab_file, merge_file)
        self._set_vocab(dict(tables.vocab))  # a copy: _add_token extends this one
        self.eod_id = self._vocab[EOD_TOKEN]
        self._encoding = tables.encoding
        self._rank_to_id = tables.rank_to_id
        self._id_to_bytes: dict[int, bytes] | None = None  # built by the first detokenize
        self._exact = None  # HF tokenizers BPE, used where tiktoken's ranking would differ
        if tables.problem is not None:
            warn_rank_0(f"{merge_file}: merges are not rank-consistent ({tables.problem}); "
                        "tokenizing with the exact pair-ranked BPE (HF tokenizers), slower than "
                        "tiktoken")
            self._exact = _exact_bpe(self._vocab, tables.merges)

    @property
    def uses_tiktoken(self) -> bool:
        """False when the merges needed the exact (slower) pair-ranked BPE."""
        return self._exact is None

    @staticmethod
    def _token_bytes(token: str) -> bytes:
        try:
            return token_to_bytes(token)
        except ValueError:  # an added token written in plain text
            return token.encode("utf-8")

    def tokenize(self, text: str) -> list[int]:
        if self._exact is not None:
            return self._exact.encode(text, add_special_tokens=False).ids
        # encode_ordinary: like OpenAI's encoder, "<|endoftext|>" inside text is plain text.
        ids = self._encoding.encode_ordinary(text)
        if self._rank_to_id is not None:
            ids = self._rank_to_id[ids].tolist()
        return ids

    def tokenize_to_array(self, text: str) -> np.ndarray:
        """The ids of ``text`` as an int64 array (no Python list on the mapped path)."""
        if self._exact is not None:
            return np.asarray(self.tokenize(text), dtype=np.int64)
        ids = np.asarray(self._encoding.encode_ordinary(text), dtype=np.int64)
        return ids if self._rank_to_id is None else self._rank_to_id[ids]

    def detokenize(self, token_ids: list[int]) -> str:
        if self._id_to_bytes is None:
            self._id_to_bytes = {i: self._token_bytes(t) for t, i in self._vocab.items()}
        data = b"".join(self._id_to_bytes[int(i)] for i in token_ids)
        return data.decode("utf-8", errors="replace")

    @property
    def eod(self) -> int:
        return self.eod_id

def _ranks(vocab: dict[str, int], merges: list[tuple[str, str]], vocab_file
       ) -> tuple[dict[bytes, int], np.ndarray]:
    """tiktoken ranks (bytes -> rank) and the rank -> vocab id table."""
    byte_chars = bytes_to_unicode()
    missing = [ch for ch in byte_chars.values() if ch not in vocab]
    if missing:
        raise ValueError(f"{vocab_file}: byte tokens {missing[:5]} are missing")
    byte_ids = [vocab[byte_chars[b]] for b in range(256)]
    # Single bytes keep their vocab id as rank when those ids are exactly 0..255 (GPT-2);
    # their ranks never decide a merge, only the 256 + i of merged tokens do.
    byte_rank = byte_ids if sorted(byte_ids) == list(range(256)) else list(range(256))
    ranks = {bytes([b]): byte_rank[b] for b in range(256)}
    rank_to_id = np.empty(256 + len(merges), dtype=np.int64)
    rank_to_id[byte_rank] = byte_ids
    for i, (left, right) in enumerate(merges):
        merged = left + right
        if merged not in vocab:
            raise ValueError(f"{vocab_file}: merge {i + 1} ({left} {right}) makes {merged!r}, "
                             "which is not in the vocabulary")
        # A repeated merge result keeps its first (highest) priority, as OpenAI's lookup
        # of the lowest-ranked pair would.
        ranks.setdefault(token_to_bytes(merged), 256 + i)
        rank_to_id[256 + i] = vocab[merged]
    return ranks, rank_to_id


@dataclasses.dataclass(frozen=True)
class _Tables:
    """What a GPT-2 tokenizer is built from, parsed and checked once per pair of files."""
    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    encoding: tiktoken.Encoding
    rank_to_id: np.ndarray | None  # None: ranks are the vocab ids (GPT-2's own files)
    problem: str | None  # why the merges are not rank-consistent; None when they are


# (vocab file, merges file) identities -> their tables. Parsing GPT-2's files and building the
# ranks costs seconds, and a process builds the same tokenizer several times (validation derives
# the padded vocabulary with one, training builds its own; test worlds run many trainings).
_TABLES: dict[tuple, _Tables] = {}


def _tables(vocab_file: str | os.PathLike, merge_file: str | os.PathLike) -> _Tables:
    """The tables of this pair of files, read again only when either file changed.

    Raises:
        ValueError: unreadable files, a merge whose result is not in the vocabulary, or no
            ``<|endoftext|>`` token.
    """
    key = (_file_identity(vocab_file), _file_identity(merge_file))
    if key not in _TABLES:
        vocab = load_vocab_json(vocab_file)
        if EOD_TOKEN not in vocab:
            raise ValueError(f"{vocab_file}: no {EOD_TOKEN} token (is it a GPT-2 vocab.json?)")
        merges = load_merges(merge_file)
        ranks, rank_to_id = _ranks(vocab, merges, vocab_file)
        encoding = tiktoken.Encoding(name=f"gpt2-bpe-{os.fspath(vocab_file)}",
                                     pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={})
        identity = np.array_equal(rank_to_id, np.arange(len(rank_to_id)))
        _TABLES[key] = _Tables(vocab, merges, encoding, None if identity else rank_to_id,
                               rank_consistency_problem(merges, vocab, encoding))
    return _TABLES[key]


def _pair_ranked_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """HF ``tokenizers`` BPE model: OpenAI's rule (lowest-ranked listed pair first)."""
    from tokenizers import models

    return models.BPE(vocab=vocab, merges=merges)


def _exact_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """A HF tokenizer doing OpenAI's encode: GPT-2 regex split, byte mapping, pair-ranked BPE."""
    from tokenizers import Tokenizer, pre_tokenizers

    tokenizer = Tokenizer(_pair_ranked_bpe(vocab, merges))
    # ByteLevel's regex is GPT-2's pattern; no prefix space, as OpenAI's encoder.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tokenizer


def _file_identity(path: str | os.PathLike) -> tuple:
    stat = os.stat(path)
    return os.path.realpath(path), stat.st_size, stat.st_mtime_ns


def rank_consistency_problem(merges: list[tuple[str, str]], vocab: dict[str, int],
                             encoding: tiktoken.Encoding) -> str | None:
    """Why tiktoken's rule (rank of the merged token) could give other ids than OpenAI's
    (rank of the listed pair) for these merges; None when it cannot.

    With every merge result distinct and every merge's two parts made earlier (bytes or
    earlier results), the two rules agree on every input exactly when they agree on each merge
    result's own bytes. Sketch: the rules first differ when tiktoken merges an adjacent, unlisted
    pair (x, y) whose concatenation is a merge result t; the merges that built x and y stayed
    inside t's span, so on t's bytes alone OpenAI's rule also reaches [x, y] and stops there
    (no listed pair), while tiktoken cannot stop at [x, y]. Costs ~0.2 s for GPT-2's 50k merges.

    Args:
        merges: the pairs of ``merges.txt`` in priority order.
        vocab: ``vocab.json`` (token string -> id).
        encoding: the tiktoken encoding built with rank ``256 + i`` for merge ``i``.
    """
    made = set(bytes_to_unicode().values())
    for i, (left, right) in enumerate(merges):
        for part in (left, right):
            if part not in made:
                return f"merge {i + 1} ({left} {right}) uses {part!r} before a merge makes it"
        if left + right in made:
            return f"merge {i + 1} ({left} {right}) makes {left + right!r} again"
        made.add(left + right)
    pair_ranked = _pair_ranked_bpe(vocab, merges)
    core = encoding._core_bpe  # tiktoken's BPE on bytes, without the regex split
    for left, right in merges:
        token = left + right
        expected = [t.value for t in pair_ranked.tokenize(token)]
        got = core.encode_single_piece(token_to_bytes(token))
        if len(got) == 1 and expected == [token]:
            continue  # both give the token itself (the common case, checked cheaply)
        got_tokens = [b.decode("latin-1").translate(_BYTE_TO_CHAR)
                      for b in encoding.decode_tokens_bytes(got)]
        if got_tokens != expected:
            return f"on {token!r} OpenAI's rule gives {expected}, tiktoken's {got_tokens}"
    return None

