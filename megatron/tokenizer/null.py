"""``NullTokenizer`` (``--vocab-size N``): text is space-separated ids; EOD = N (vocab N + 1).

For benchmarks and tests that need token files without a real vocabulary (Megatron-LM's).
"""

from __future__ import annotations

from megatron.tokenizer.base import AbstractTokenizer, megatron_identifiers


class NullTokenizer(AbstractTokenizer):
    """Ids written as decimal numbers separated by single spaces.

    Args:
        vocab_size: number of ordinary ids; the EOD id is ``vocab_size`` itself.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__("NullTokenizer")
        self.unique_identifiers = megatron_identifiers("_NullTokenizer", None,
                                                       vocab_size=vocab_size)
        self._eod_id = int(vocab_size)
        self._vocab_size = int(vocab_size) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        raise self._missing("vocab")

    @property
    def inv_vocab(self) -> dict[int, str]:
        raise self._missing("inv_vocab")

    def tokenize(self, text: str) -> list[int]:
        """Raises ValueError when a piece is not an integer (as ``int()`` does).

        Empty or blank text is an empty document (Megatron-LM's ``int("")`` would fail).
        """
        return [int(x) for x in text.split(" ")] if text.strip() else []

    def detokenize(self, token_ids: list[int]) -> str:
        return " ".join(str(int(x)) for x in token_ids)

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1
