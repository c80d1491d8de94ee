"""SentencePiece tokenizers (``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``,
``Llama2Tokenizer``).

Megatron-LM's ``SentencePieceTokenizer`` appends ``<CLS> <SEP> <EOD> <MASK>`` and the model's
pad/bos/eos pieces (``<PAD> <BOS> <EOS>`` when the model has none) plus ``<extra_id_N>`` to the
vocabulary when absent, and cuts the text at those special strings before encoding the pieces
between them; ``GPTSentencePieceTokenizer`` encodes the text as is, EOD = the model's eos;
``Llama2Tokenizer`` is that with the model's bos before each text.
"""

from __future__ import annotations

import os
import re

import sentencepiece

from megatron.tokenizer.base import VocabTokenizer, megatron_identifiers


class SentencePieceTokenizer(VocabTokenizer):
    """Megatron-LM's SentencePiece wrapper with its special tokens.

    Args:
        model_file: SentencePiece ``.model`` file (``--tokenizer-model``).
        vocab_extra_ids: number of ``<extra_id_N>`` sentinels to add (T5).

    Raises:
        ValueError: the model file does not exist or does not load.
    """

    def __init__(self, model_file: str | os.PathLike, vocab_extra_ids: int = 0,
                 name: str = "SentencePieceTokenizer") -> None:
        super().__init__(name)
        self.unique_identifiers = megatron_identifiers(
            f"_{name}", model_file, vocab_extra_ids=vocab_extra_ids)
        if not os.path.isfile(model_file):
            raise ValueError(f"--tokenizer-model {model_file} does not exist")
        try:
            self.tokenizer = sentencepiece.SentencePieceProcessor(model_file=os.fspath(model_file))
        except (OSError, RuntimeError) as err:
            raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model ({err})") from err
        self._set_vocab({self.tokenizer.id_to_piece(i): i for i in range(len(self.tokenizer))})
        self._special_tokens: dict[str, int] = {}
        self._t5_tokens: list[str] = []
        self._add_specials(vocab_extra_ids)
        self._special_re = (re.compile("|".join(re.escape(t) for t in self._special_tokens))
                            if self._special_tokens else None)

    def _add_special_token(self, token: str) -> int:
        self._special_tokens[token] = self._add_token(token)
        return self._special_tokens[token]

    def _model_piece(self, piece_id: int, fallback: str) -> str:
        # sentencepiece reports a disabled special piece as id -1 (IndexError in id_to_piece).
        return self.tokenizer.id_to_piece(piece_id) if 0 <= piece_id < len(self.tokenizer) else fallback

    def _add_specials(self, vocab_extra_ids: int) -> None:
        self._cls_id = self._add_special_token("<CLS>")
        self._sep_id = self._add_special_token("<SEP>")
        self._eod_id = self._add_special_token("<EOD>")
        self._mask_id = self._add_special_token("<MASK>")
        self._pad_id = self._add_special_token(self._model_piece(self.tokenizer.pad_id(), "<PAD>"))
        self._bos_id = self._add_special_token(self._model_piece(self.tokenizer.bos_id(), "<BOS>"))
        self._eos_id = self._add_special_token(self._model_piece(self.tokenizer.eos_id(), "<EOS>"))
        for i in range(vocab_extra_ids):
            self._t5_tokens.append(f"<extra_id_{i}>")
            self._add_special_token(self._t5_tokens[-1])

    def tokenize(self, text: str) -> list[int]:
        if self._special_re is None:
            return self.tokenizer.encode_as_ids(text)
        # A regex alternation in insertion order finds the earliest special string, ties going
        # to the first added: the same choice as Megatron-LM's min() over str.index results.
        ids: list[int] = []
        start = 0
        for match in self._special_re.finditer(text):
            ids.extend(self.tokenizer.encode_as_ids(text[start:match.start()]))
            ids.append(self._special_tokens[match.group()])
            start = match.end()
        ids.extend(self.tokenizer.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, token_ids: list[int]) -> str:
        inv_special = {i: t for t, i in self._special_tokens.items()}
        ids = [int(i) for i in token_ids]
        text, last = "", 0
        for i, token_id in enumerate(ids):
            if token_id in inv_special:
                text += self.tokenizer.decode_ids(ids[last:i]) + " " + inv_special[token_id] + " "
                last = i + 1
        return text + self.tokenizer.decode_ids(ids[last:])

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def mask(self) -> int:
        return self._mask_id

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self._vocab[t] for t in self._t5_tokens]


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Plain SentencePiece encoding (no special strings); EOD = the model's eos id."""

    def __init__(self, model_file: str | os.PathLike) -> None:
        super().__init__(model_file, vocab_extra_ids=0, name="GPTSentencePieceTokenizer")

    def _add_specials(self, vocab_extra_ids: int) -> None:
        self._pad_id = self.tokenizer.pad_id()
        self._bos_id = self.tokenizer.bos_id()
        self._eos_id = self.tokenizer.eos_id()
        self._eod_id = self._eos_id

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode_ids([int(i) for i in token_ids])

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's ``Llama2Tokenizer``: Llama 2's SentencePiece ``tokenizer.model``, each
    text encoded as ``<s>`` + its pieces (Meta's text-completion default, bos on, eos off);
    EOD = the model's eos ``</s>``, which the preprocessing's ``--append-eod`` appends."""

    def __init__(self, model_file: str | os.PathLike) -> None:
        SentencePieceTokenizer.__init__(self, model_file, vocab_extra_ids=0,
                                        name="Llama2Tokenizer")
        if self._bos_id < 0 or self._eos_id < 0:
            raise ValueError(f"--tokenizer-model {model_file}: Llama2Tokenizer needs a "
                             "SentencePiece model with bos and eos pieces (train it with "
                             "bos_id/eos_id set)")

    def tokenize(self, text: str) -> list[int]:
        return [self._bos_id] + self.tokenizer.encode_as_ids(text)
