"""Megatron-LM's zero-shot detokenizers (``tasks/zeroshot_gpt/detokenizer.py``), rule for rule,
and a chunk-wise form of them that gives the same text while reading a file piece by piece.

The word-level WikiText and PTB files separate every token by spaces (``don 't``, ``1 @,@ 000``,
``( a )``); before a BPE tokenizer sees them they are put back into running text. Perplexity
numbers are comparable only under the same rules, so these are Megatron's exactly, including
its quirks: the bracket and quote rules pair characters over the *whole* text (an apostrophe
opens a "pair" that the next apostrophe anywhere in the file closes), and the rule meant for
``' 5`` matches a literal ``/' 5/`` only (so it never fires on real data).

Chunks (:class:`ChunkDetokenizer`): a chunk ends between two ASCII letters, which no rule's
pattern spans, so every replacement is local to its chunk; the pairing of the five bracket
rules is the only state carried over. That state needs one fact about the rest of the file,
how many pairs each rule closes in total (:func:`count_pair_closings`, a first pass), because an
opener whose closer never comes is left alone by the regex.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# Applied in this order, over the whole text, by Megatron-LM's wikitext_detokenizer.
_WIKITEXT_BEFORE_PAIRS: tuple[tuple[str, str], ...] = (
    ("s '", "s'"),
    (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),
    (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "),
)
# Megatron's rule for "' 5", written with slashes inside the pattern: it matches "/' 5/" only.
_SLASHED_APOSTROPHE = re.compile(r"/' [0-9]/")
# (opener, closer, pattern): spaces just inside each pair are removed.
_PAIRS: tuple[tuple[str, str, re.Pattern], ...] = (
    ("(", ")", re.compile(r"\(\s*([^\)]*?)\s*\)")),
    ("[", "]", re.compile(r"\[\s*([^\]]*?)\s*\]")),
    ("{", "}", re.compile(r"{\s*([^}]*?)\s*}")),
    ('"', '"', re.compile(r"\"\s*([^\"]*?)\s*\"")),
    ("'", "'", re.compile(r"'\s*([^']*?)\s*'")),
)
_WIKITEXT_AFTER_PAIRS: tuple[tuple[str, str], ...] = (
    ("= = = =", "===="), ("= = =", "==="), ("= =", "=="),
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s"),
)
_PTB_RULES: tuple[tuple[str, str], ...] = (
    (" '", "'"), (" \n", "\n"), ("\n ", "\n"), (" n't", "n't"), (" N ", "1 "),
    ("$ 1", "$1"), ("# 1", "#1"),
)


def _replace_all(text: str, rules: tuple[tuple[str, str], ...]) -> str:
    for old, new in rules:
        text = text.replace(old, new)
    return text


def _before_pairs(text: str) -> str:
    text = text.replace(*_WIKITEXT_BEFORE_PAIRS[0])
    text = _SLASHED_APOSTROPHE.sub(r"/'[0-9]/", text)
    return _replace_all(text, _WIKITEXT_BEFORE_PAIRS[1:])


def wikitext_detokenizer(text: str) -> str:
    """Megatron-LM's WikiText rules over a whole text."""
    text = _before_pairs(text)
    for opener, closer, pattern in _PAIRS:
        text = pattern.sub(opener + r"\1" + closer, text)
    return _replace_all(text, _WIKITEXT_AFTER_PAIRS)


def ptb_detokenizer(text: str) -> str:
    """Megatron-LM's Penn Treebank rules."""
    return _replace_all(text, _PTB_RULES)


def lambada_detokenizer(text: str) -> str:
    """LAMBADA's text is already running text: unchanged."""
    return text


# Megatron-LM picks the first key found anywhere in the data path, in this order.
DETOKENIZERS: dict[str, Callable[[str], str]] = {
    "ptb": ptb_detokenizer,
    "wiki": wikitext_detokenizer,
    "lambada": lambada_detokenizer,
}


def detokenizer_name(path: str) -> str:
    """The detokenizer Megatron-LM applies to ``path``: the first of ``ptb``, ``wiki``,
    ``lambada`` that occurs in the path (directories included).

    Raises:
        ValueError: the path names none of them (Megatron-LM would crash on it).
    """
    for key in DETOKENIZERS:
        if key in path:
            return key
    raise ValueError(f"--valid-data {path}: cannot tell which detokenizer to apply: the path "
                     f"contains none of {', '.join(repr(k) for k in DETOKENIZERS)} (Megatron-LM "
                     "chooses by these substrings); name the file (or a link to it) after its "
                     "corpus, e.g. wiki.test.tokens")


# Chunk-wise ---------------------------------------------------------------------------------
class PairState:
    """The pairing of one bracket rule across chunks: is a pair open, how many pairs closed."""

    def __init__(self, opener: str, closer: str) -> None:
        self.opener, self.closer = opener, closer
        # The rule's pairs without its spaces: an opener, then everything up to the first closer.
        self._pair = re.compile(f"{re.escape(opener)}[^{re.escape(closer)}]*{re.escape(closer)}")
        self.open = False
        self.closed = 0

    def scan(self, text: str) -> None:
        """Advance over ``text`` as the regex pairs it (left to right, first closer wins)."""
        text = (self.opener if self.open else "") + text
        end = 0
        for match in self._pair.finditer(text):
            self.closed += 1
            end = match.end()
        self.open = text.find(self.opener, end) >= 0


def count_pair_closings(chunks) -> list[int]:
    """First pass over a WikiText file's chunks: the pairs each bracket rule closes in the
    whole text (what :class:`ChunkDetokenizer` needs to know where pairing ends)."""
    states = [PairState(o, c) for o, c, _ in _PAIRS]
    for chunk in chunks:
        text = _before_pairs(chunk)
        for state in states:
            state.scan(text)
    return [state.closed for state in states]


class ChunkDetokenizer:
    """Detokenize a text given as consecutive chunks, each ending between two ASCII letters
    (:func:`~tasks.zeroshot_gpt.datasets.read_text_chunks`): the concatenated output equals
    the detokenizer applied to the whole text.

    Args:
        name: ``wiki``, ``ptb`` or ``lambada``.
        pair_closings: for ``wiki``, :func:`count_pair_closings` of the same chunks.
    """

    def __init__(self, name: str, pair_closings: list[int] | None = None) -> None:
        self.name = name
        if name == "wiki":
            if pair_closings is None or len(pair_closings) != len(_PAIRS):
                raise ValueError("the WikiText detokenizer needs the pair counts of a first pass")
            self.states = [PairState(o, c) for o, c, _ in _PAIRS]
            self.total_closings = list(pair_closings)

    def __call__(self, chunk: str) -> str:
        if self.name != "wiki":
            return DETOKENIZERS[self.name](chunk)
        text = _before_pairs(chunk)
        for (opener, closer, pattern), state, total in zip(_PAIRS, self.states,
                                                           self.total_closings):
            text = self._pair_rule(text, opener, closer, pattern, state, total)
        return _replace_all(text, _WIKITEXT_AFTER_PAIRS)

    @staticmethod
    def _pair_rule(text: str, opener: str, closer: str, pattern: re.Pattern,
                   state: PairState, total: int) -> str:
        # A pair left open by the previous chunk: a virtual opener makes the regex close it at
        # this chunk's first closer. A pair this chunk leaves open that a later chunk closes: a
        # virtual closer strips the spaces after its opener now. Chunks start and end with a
        # letter, so the virtual characters strip no real space next to them.
        prefix = opener if state.open else ""
        state.scan(text)
        suffix = closer if state.open and state.closed < total else ""
        out = pattern.sub(opener + r"\1" + closer, prefix + text + suffix)
        return out[len(prefix):len(out) - len(suffix)]
