"""``HuggingFaceTokenizer``: a local ``tokenizer.json`` (or a directory holding one).

Megatron-LM loads these with ``transformers.AutoTokenizer``; we read the same file with the
``tokenizers`` library, offline (no hub download). As with ``AutoTokenizer(text).input_ids``,
the tokenizer's post-processor runs, so a model that adds ``<s>`` gets it here too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer

from megatron.tokenizer.base import VocabTokenizer, megatron_identifiers

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


def _special_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "</s>", ...} in newer tokenizer_config.json
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(directory: Path) -> dict:
    """The eos/bos names of a tokenizer directory, as ``AutoTokenizer`` finds them:
    ``tokenizer_config.json``, then the older ``special_tokens_map.json`` for what it lacks."""
    found: dict = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = directory / name
        config = _json_object(file) if file.is_file() else {}
        for key in ("eos_token", "bos_token"):
            if found.get(key) is None:
                found[key] = _special_token(config, key)
                found[f"{key}_file"] = file
    return found


def _json_object(file: Path) -> dict:
    """A JSON object file of the tokenizer directory.

    Raises:
        ValueError: naming the file and --tokenizer-model.
    """
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"--tokenizer-model: {file} is not valid JSON ({err}); restore it from "
                         "the tokenizer's source") from None
    if not isinstance(config, dict):
        raise ValueError(f"--tokenizer-model: {file} holds a JSON {type(config).__name__}, not "
                         "an object")
    return config


def _load_tokenizer_json(file: Path) -> Tokenizer:
    """``Tokenizer.from_file`` with an error naming the file and the flag.

    Raises:
        ValueError: a truncated or corrupt tokenizer.json, or another kind of file (a
            SentencePiece ``.model`` given as one).
    """
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        hint = " (a SentencePiece model: pass --tokenizer-type Llama2Tokenizer)" \
            if _looks_like_sentencepiece(file) else " (truncated or corrupt? copy it again)"
        raise ValueError(f"--tokenizer-model: {file} is not a HuggingFace tokenizer.json: "
                         f"{first}{hint}") from None


def _looks_like_sentencepiece(file: Path) -> bool:
    with open(file, "rb") as f:
        head = f.read(64)
    return file.suffix == ".model" or (bool(head) and head[:1] != b"{" and b"\x00" in head)


class HuggingFaceTokenizer(VocabTokenizer):
    """A ``tokenizers`` JSON tokenizer; EOD = ``eos_token`` of ``tokenizer_config.json`` (or
    ``special_tokens_map.json``), Megatron-LM's ``eos_token_id``.

    Args:
        path: ``tokenizer.json`` or a directory with ``tokenizer.json`` (and optionally
            ``tokenizer_config.json`` / ``special_tokens_map.json``, which name the eos/bos
            tokens).

    Raises:
        ValueError: no ``tokenizer.json`` at ``path`` (hub names are not downloaded).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__("HuggingFaceTokenizer")
        self.unique_identifiers = megatron_identifiers("_HuggingFaceTokenizer", path)
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer-model {path}: no tokenizer.json there (give a local file "
                             "or directory; models are not downloaded)")
        self._tokenizer = _load_tokenizer_json(file)
        special = _special_tokens(file.parent)
        self._set_vocab(self._tokenizer.get_vocab(with_added_tokens=True))
        eos = special["eos_token"]
        if eos is not None and eos not in self._vocab:
            # Named but absent: every document would end in a token the model cannot embed.
            raise ValueError(f"--tokenizer-model: the eos_token {eos!r} of "
                             f"{special['eos_token_file']} is not in the vocabulary of {file}; "
                             "correct eos_token there (or use the tokenizer's own files)")
        if eos is None:
            eos = next((t for t in _EOS_CANDIDATES if t in self._vocab), None)
        self._eos_id = self._vocab.get(eos) if eos is not None else None
        bos = special["bos_token"]
        self._bos_id = self._vocab.get(bos) if bos is not None else None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts)]

    def detokenize(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=False)

    @property
    def eod(self) -> int:
        if self._eos_id is None:
            raise self._missing("EOD (no eos_token in tokenizer_config.json or "
                                "special_tokens_map.json, and none of "
                                f"{', '.join(_EOS_CANDIDATES)} in the vocabulary)")
        return self._eos_id

    @property
    def bos(self) -> int | None:
        return self._bos_id
