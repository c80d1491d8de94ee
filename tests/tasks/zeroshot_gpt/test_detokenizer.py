"""Megatron-LM's zero-shot detokenizers, rule by rule, and the chunk-wise form giving the same
text as the whole-text one wherever the chunks are cut."""

from __future__ import annotations

import random
import re

import pytest

from tasks.zeroshot_gpt import datasets
from tasks.zeroshot_gpt.detokenizer import (ChunkDetokenizer, detokenizer_name,
                                            lambada_detokenizer, ptb_detokenizer,
                                            wikitext_detokenizer)


@pytest.mark.parametrize("raw,expected", [
    ("the dogs ' bone", "the dogs' bone"),               # "s '" -> "s'"
    ("a well @-@ known film", "a well-known film"),
    ("1 @,@ 000 men", "1,000 men"),
    ("3 @.@ 5 km", "3.5 km"),
    ("one : two ; three . four ! five ? six , seven", "one: two; three. four! five? six, seven"),
    ("see ( the film ) now", "see (the film) now"),
    ("a [ b ] c { d } e", "a [b] c {d} e"),
    ('he said " hello there " twice', 'he said "hello there" twice'),
    ("= = = = Deep = = = =", "==== Deep ===="),
    ("= = = Mid = = =", "=== Mid ==="),
    ("= = Top = =", "== Top =="),
    ("it was 5 ° C", "it was 5°C"),
    ("line one \n line two", "line one\nline two"),
    ("it is N years", "it is 1 years"),
    ("John 's book", "John's book"),
    # Megatron's "' 5" rule has slashes inside its pattern: only "/' 5/" matches, replaced by
    # the literal text "/'[0-9]/".
    ("the ' 90s", "the ' 90s"),
    ("x /' 5/ y", "x /'[0-9]/ y"),
    # Apostrophes pair over the text like quotes: the spaces inside a "pair" go.
    ("the ' quoted ' word", "the 'quoted' word"),
    # An opener that nothing closes is left alone.
    ("a ( b c", "a ( b c"),
    ('say " nothing', 'say " nothing'),
])
def test_wikitext_rules(raw, expected):
    assert wikitext_detokenizer(raw) == expected


def test_wikitext_pairs_span_lines_and_rules_apply_in_megatrons_order():
    # The quote pair spans the line; " \n" and "\n " go after the pairs are closed.
    assert wikitext_detokenizer('a " b \n c " d') == 'a "b\nc" d'
    # A quote opened on one line pairs with the next quote, wherever it is.
    assert wikitext_detokenizer('x " y \n \n z w " v') == 'x "y\n\nz w" v'
    assert wikitext_detokenizer(" = Robert = \n \n Robert is an actor . \n") == \
        " = Robert =\n\nRobert is an actor.\n"  # the file's first space has no newline before it


@pytest.mark.parametrize("raw,expected", [
    ("the dog 's bone", "the dog's bone"),
    ("i do n't know", "i don't know"),
    ("a N b", "a1 b"),  # Megatron's PTB rule drops the space before N, too
    ("cost $ 1 million", "cost $1 million"),
    ("no. # 1 hit", "no. #1 hit"),
    ("one \n two", "one\ntwo"),
])
def test_ptb_rules(raw, expected):
    assert ptb_detokenizer(raw) == expected


def test_lambada_is_identity():
    assert lambada_detokenizer(" a ( b ) 's ") == " a ( b ) 's "


@pytest.mark.parametrize("path,name", [
    ("data/wikitext-103/wiki.test.tokens", "wiki"),
    ("data/ptb/ptb.test.txt", "ptb"),
    ("lambada_test.jsonl", "lambada"),
    ("wikitext/ptb.valid.txt", "ptb"),  # Megatron checks ptb first, anywhere in the path
])
def test_detokenizer_chosen_by_path_as_megatron(path, name):
    assert detokenizer_name(path) == name


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="--valid-data corpus/test.txt: cannot tell which "
                                         "detokenizer"):
        detokenizer_name("corpus/test.txt")


def _chunked(path, kind: str, chunk_chars: int) -> str:
    scan = datasets.scan_word_level_file(str(path), kind, chunk_chars)
    detok = ChunkDetokenizer(kind, scan.pair_closings or None)
    return "".join(detok(c) for c in datasets.read_text_chunks(str(path), chunk_chars))


TRICKY = ("Alpha ( beta gamma ) delta ' eps ' zeta \" eta theta \n \n Iota ( kappa lambda "
          "mu nu \" xi omicron ' pi rho ) sigma \n tau [ upsilon ] phi { chi } psi ' omega "
          "@-@ ends here \" after it ' dangling ( paren opener stays open and ends")


@pytest.mark.parametrize("chunk_chars", [3, 7, 16, 41, 1000])
@pytest.mark.parametrize("kind,whole", [("wiki", wikitext_detokenizer),
                                        ("ptb", ptb_detokenizer)])
def test_chunks_give_the_whole_texts_result(tmp_path, chunk_chars, kind, whole):
    """Pairs that cross chunks, an apostrophe pairing over the file, a quote and a paren left
    open at the end (Megatron leaves those alone)."""
    path = tmp_path / f"{kind}.txt"
    path.write_text(TRICKY)
    assert _chunked(path, kind, chunk_chars) == whole(TRICKY)
    if kind == "wiki":
        assert "(beta gamma)" in whole(TRICKY)
        assert "( paren opener stays" in whole(TRICKY)  # never closed: keeps its space


def test_chunks_on_real_text(tmp_path, shared_data):
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()[:60000]
    rng = random.Random(0)
    # Word-level, as WikiText: punctuation split off, random brackets and quotes.
    words = re.sub(r"([,.;:!?\"()\-])", r" \1 ", text).replace("'", " '").split(" ")
    words = [w if rng.random() > 0.01 else rng.choice(["(", ")", '"', "[", "]"]) + " " + w
             for w in words]
    word_level = " ".join(words)
    path = tmp_path / "wiki.txt"
    path.write_text(word_level)
    assert _chunked(path, "wiki", 997) == wikitext_detokenizer(word_level)
