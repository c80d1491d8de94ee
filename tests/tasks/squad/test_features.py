"""tasks.squad.features: Google's document spans, max-context flags and span labels; every
tokenised answer maps back to exactly its original characters through the postprocessing."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.squad.features import (DocSpan, check_is_max_context, convert_examples_to_features,
                                  doc_spans, improve_answer_span,
                                  max_context_spans, tokenize_paragraph)
from tasks.squad.postprocess import compute_predictions
from tasks.squad.reader import read_squad_examples
from tests.tasks.squad.squad_files import ARNOLD_QAS, TESLA_QAS, bert_tokenizer, squad_dict, write


@pytest.fixture(scope="module")
def tokenizer(shared_data):
    return bert_tokenizer(shared_data)


def _pieces(tokenizer, ids):
    return [tokenizer.inv_vocab[i] for i in ids]


def test_doc_spans_and_max_context_by_hand():
    # 10 tokens, windows of 4, stride 3: [0,4) [3,7) [6,10).
    spans = doc_spans(10, 4, 3)
    assert spans == [DocSpan(0, 4), DocSpan(3, 4), DocSpan(6, 4)]
    assert doc_spans(5, 8, 3) == [DocSpan(0, 5)]
    # Token 3: span 0 gives min(3, 0) = 0, span 1 min(0, 3) = 0: equal lengths, first wins.
    assert [check_is_max_context(spans, i, 3) for i in range(3)] == [True, False, False]
    # Token 5: only span 1 holds it (min(2, 1) = 1).
    assert [check_is_max_context(spans, i, 5) for i in range(3)] == [False, True, False]
    # A shorter last span loses ties by its 0.01 x length term.
    spans = [DocSpan(0, 5), DocSpan(2, 4)]
    assert check_is_max_context(spans, 0, 3) and not check_is_max_context(spans, 1, 3)


@pytest.mark.parametrize("tokens,window,stride", [(10, 4, 3), (50, 7, 2), (33, 8, 8), (5, 9, 1)])
def test_max_context_of_all_tokens_is_googles_rule(tokens, window, stride):
    spans = doc_spans(tokens, window, stride)
    best = max_context_spans(spans, tokens)
    for position in range(tokens):
        assert [check_is_max_context(spans, i, position) for i in range(len(spans))] == \
            [best[position] == i for i in range(len(spans))]


def test_improve_answer_span_tightens_to_the_answer_tokens():
    doc = ["(", "1856", "-", "1943", ")"]
    assert improve_answer_span(doc, 0, 4, ["1856"]) == (1, 1)
    assert improve_answer_span(doc, 0, 4, ["1856", "-", "1943"]) == (1, 3)
    assert improve_answer_span(doc, 0, 4, ["1857"]) == (0, 4)


def test_features_layout_and_labels(tmp_path, tokenizer):
    path = write(tmp_path / "t.json", squad_dict())
    examples = read_squad_examples(path, "2.0", True).examples
    feats = convert_examples_to_features(examples, tokenizer, max_seq_length=24, doc_stride=6,
                                         max_query_length=5, is_training=True)
    born = [f for f in feats if f.example_index == 0]
    assert [f.unique_id for f in feats] == list(range(1000000000, 1000000000 + len(feats)))
    first = born[0]
    assert _pieces(tokenizer, first.input_ids) == [
        "[CLS]", "when", "was", "tesla", "born", "?", "[SEP]", "nikola", "tesla", "(", "1856",
        "-", "1943", ")", "was", "a", "serbian", "-", "american", "inventor", ".", "he",
        "worked", "[SEP]"]
    assert first.token_type_ids.tolist() == [0] * 7 + [1] * 17
    assert (first.start_position, first.end_position) == (10, 10)  # "1856" only
    assert first.token_to_orig_map[7] == 0 and first.token_to_orig_map[10] == 2
    assert 0 not in first.token_to_orig_map and 23 not in first.token_to_orig_map
    assert (first.word_index(10), first.word_index(6), first.word_index(23)) == (2, None, None)
    # The next span starts 6 sub-tokens on; "1856" lies before it: label [CLS].
    assert _pieces(tokenizer, born[1].input_ids)[7:9] == [")", "was"]
    assert (born[1].start_position, born[1].end_position) == (0, 0)
    # Every document sub-token is max context in exactly one of its example's features.
    for example_index, example in enumerate(examples):
        flags = sum(sum(f.token_is_max_context.values()) for f in feats
                    if f.example_index == example_index)
        assert flags == len(tokenize_paragraph(example.paragraph, tokenizer).sub_tokens)
    king = [f for f in feats if examples[f.example_index].qas_id == "king"]
    assert king and all((f.start_position, f.end_position, f.is_impossible) == (0, 0, True)
                        for f in king)
    # The question is cut to max_query_length sub-tokens.
    company = next(f for f in feats if examples[f.example_index].qas_id == "company")
    assert _pieces(tokenizer, company.input_ids)[:7] == [
        "[CLS]", "whose", "company", "did", "he", "work", "[SEP]"]
    with pytest.raises(ValueError, match="--seq-length 10 leaves no document tokens after "
                                         "--max-query-length 7"):
        convert_examples_to_features(examples, tokenizer, 10, 6, 7, True)


@pytest.mark.parametrize("seq,stride", [(24, 6), (32, 3), (128, 128)])
def test_tokenised_answers_map_back_to_the_exact_characters(tmp_path, tokenizer, seq, stride):
    """Logits peaked on each training label, postprocessed on the evaluation features, give
    back each answer's original text exactly: word pieces ("Schwarzenegger" in
    "Schwarzenegger's"), punctuation inside words ("1856" in "(1856-1943)", "briefly" in
    '"briefly".'), an accent the uncased tokenizer strips ("Zürich")."""
    path = write(tmp_path / "t.json", squad_dict())
    train = read_squad_examples(path, "2.0", True).examples
    evaluation = read_squad_examples(path, "2.0", False).examples
    labelled = convert_examples_to_features(train, tokenizer, seq, stride, 8, True)
    feats = convert_examples_to_features(evaluation, tokenizer, seq, stride, 8, False)
    assert [f.input_ids.tolist() for f in feats] == [f.input_ids.tolist() for f in labelled]
    results = {}
    for f in labelled:
        start, end = np.full(seq, -5.0), np.full(seq, -5.0)
        start[f.start_position] = end[f.end_position] = 5.0
        results[f.unique_id] = (start, end)
    out = compute_predictions(evaluation, feats, results, version_2=True,
                              inv_vocab=tokenizer.inv_vocab)
    expected = {qid: answer or "" for qid, _, answer in TESLA_QAS + ARNOLD_QAS}
    assert out.predictions == expected
