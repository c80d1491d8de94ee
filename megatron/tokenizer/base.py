"""The interface every Megatron tokenizer offers (Megatron-LM's ``AbstractTokenizer``)."""

from __future__ import annotations

import abc
import os


def megatron_identifiers(class_name: str, *paths: str | os.PathLike | None, **options) -> dict:
    """A tokenizer's ``unique_identifiers`` as Megatron-Core's ``MegatronTokenizer`` builds them:
    ``{"class": <Megatron's class name>, "tokenizer_path": [paths as given], <option>: str(value)
    ...}``. Dataset cache descriptions embed this dict, so equal identifiers give the md5 cache
    file names Megatron-Core computes for the same run (docs/FORMATS.md 2b)."""
    out: dict = {"class": class_name,
                 "tokenizer_path": [None if p is None else os.fspath(p) for p in paths]}
    out.update({name: str(value) for name, value in options.items()})
    return out


def read_utf8(path: str | os.PathLike) -> str:
    """The text of a tokenizer file. A byte sequence that is not UTF-8 is a ValueError naming
    the file, the line and the byte offset (Python's own message names neither)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte offset {err.start}: "
                         f"{err.reason}); is it the right file?") from None


def load_vocab_json(vocab_file: str | os.PathLike) -> dict[str, int]:
    """A ``vocab.json`` (token -> id), checked: JSON errors name the file, line and column; the
    top level must be an object and every id a non-negative integer."""
    import json

    try:
        vocab = json.loads(read_utf8(vocab_file))
    except json.JSONDecodeError as err:
        raise ValueError(f"{vocab_file}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})"
                         ) from None
    if not isinstance(vocab, dict):
        raise ValueError(f"{vocab_file}: expected a JSON object mapping tokens to ids, got a "
                         f"{type(vocab).__name__}")
    for token, index in vocab.items():
        if type(index) is not int or index < 0:  # bool is an int subclass: refused too
            raise ValueError(f"{vocab_file}: token {token!r} has id {index!r}; ids must be "
                             "non-negative integers")
    return vocab


class AbstractTokenizer(abc.ABC):
    """Text <-> token ids, plus the special ids the datasets and models ask for.

    Special ids a tokenizer does not have raise ``NotImplementedError`` naming the tokenizer, as
    in Megatron-LM, so that a BERT dataset built on a GPT-2 tokenizer fails at the first use.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.padded_vocab_size: int | None = None
        """Set by :func:`megatron.tokenizer.build_tokenizer`."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, before padding."""

    @property
    @abc.abstractmethod
    def vocab(self) -> dict[str, int]:
        """Token string -> id."""

    @property
    @abc.abstractmethod
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token string."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text``."""

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text (subclasses override where the library batches faster)."""
        return [self.tokenize(text) for text in texts]

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``."""
        raise NotImplementedError(f"detokenize is not implemented for the {self.name} tokenizer")

    def _missing(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"{what} is not provided for the {self.name} tokenizer")

    @property
    def cls(self) -> int:
        raise self._missing("CLS")

    @property
    def sep(self) -> int:
        raise self._missing("SEP")

    @property
    def pad(self) -> int:
        raise self._missing("PAD")

    @property
    def eod(self) -> int:
        raise self._missing("EOD")

    @property
    def mask(self) -> int:
        raise self._missing("MASK")


class VocabTokenizer(AbstractTokenizer):
    """A tokenizer whose vocabulary is a token -> id dict held here (all but the Null one)."""

    def _set_vocab(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab
        self._inv_vocab = {i: t for t, i in vocab.items()}

    def _add_token(self, token: str) -> int:
        """The id of ``token``, appended first if new (Megatron-LM's ``add_token``: the next id
        is the current vocabulary length)."""
        if token not in self._vocab:
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
