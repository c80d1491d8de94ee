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
