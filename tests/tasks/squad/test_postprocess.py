"""tasks.squad.postprocess: n-best over features, the filters, get_final_text, the SQuAD 2.0
null answer and its threshold, and the official output files, on hand-made logits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks.squad.features import SquadFeature
from tasks.squad.postprocess import (basic_tokenize, compute_predictions, get_final_text,
                                     write_predictions)
from tasks.squad.reader import SquadExample, split_paragraph

INV_VOCAB = {0: "[CLS]", 1: "what", 2: "[SEP]", 3: "the", 4: "big", 5: "cat", 6: "."}


def test_basic_tokenize_is_googles():
    assert basic_tokenize("Steve Smith's\tZürich,\x00 北京  ", True) == [
        "steve", "smith", "'", "s", "zurich", ",", "北", "京"]
    assert basic_tokenize("Steve Smith's", False) == ["Steve", "Smith", "'", "s"]


@pytest.mark.parametrize("pred,orig,expected", [
    ("steve smith", "Steve Smith's", "Steve Smith"),  # Google's docstring case
    ("zurich", "Zürich,", "Zürich"),  # accent stripped, same length: aligned
    ("1856", "(1856-1943)", "1856"),
    ("smith ' s", "Smith's", "Smith's"),
    ("xyz", "Steve Smith", "Steve Smith"),  # not found: the whole original words
    ("beyonce", "Beyonce\u0301's", "Beyonce\u0301's"),  # a combining accent: lengths differ
])
def test_get_final_text(pred, orig, expected):
    assert get_final_text(pred, orig, True) == expected


def _example(qid="q") -> SquadExample:
    return SquadExample(qid, "what?", split_paragraph("The big cat."), ("big cat",))


def _feature(unique_id: int, max_context: bool = True) -> SquadFeature:
    # [CLS] what [SEP] the big cat . [SEP]: "cat" and "." are pieces of the word "cat."
    return SquadFeature(unique_id, 0, unique_id, np.array([0, 1, 2, 3, 4, 5, 6, 2]), 3,
                        np.array([0, 1, 2, 2]), np.full(4, max_context))


def _logits(cls, starts, ends):
    start, end = np.full(8, -9.0), np.full(8, -9.0)
    start[0], end[0] = cls
    start[3:7], end[3:7] = starts, ends
    return start, end


def _predict(features, results, **kw):
    kw.setdefault("version_2", True)
    return compute_predictions([_example()], features, results, inv_vocab=INV_VOCAB, **kw)


def test_best_span_null_score_and_threshold():
    # Best span: start "big" (3) + end "cat" (2.5) = 5.5; null: min over the features of
    # start[0] + end[0] = min(1 + 1, -1 + 0) = -1, so the score difference is -6.5.
    results = {0: _logits((1, 1), [0, 3, 0, -9], [0, 0, 2.5, -9]),
               1: _logits((-1, 0), [-9, -9, -9, -9], [-9, -9, -9, -9])}
    feats = [_feature(0), _feature(1)]
    out = _predict(feats, results)
    assert out.predictions == {"q": "big cat"}
    assert out.null_odds == {"q": pytest.approx(-6.5)}
    assert _predict(feats, results, null_score_diff_threshold=-7.0).predictions == {"q": ""}
    assert _predict(feats, results, null_score_diff_threshold=-6.5).predictions == {"q": "big cat"}
    v1 = _predict(feats, results, version_2=False)
    assert v1.predictions == {"q": "big cat"} and v1.null_odds is None
    nbest = out.nbest["q"]
    assert [e["text"] for e in nbest[:3]] == ["big cat", "big", "The big cat"]
    assert "" in [e["text"] for e in nbest]
    assert sum(e["probability"] for e in nbest) == pytest.approx(1.0)
    assert len(_predict(feats, results, n_best_size=2).nbest["q"]) <= 3  # 2 + the null


def test_filters_answer_length_end_before_start_and_max_context():
    results = {0: _logits((-5, -5), [-2, 3, 0, -9], [4, 0, 2.5, -9])}
    # "the" (end 4) wins the end logits but lies before the best start: never paired with it.
    out = _predict([_feature(0)], results, max_answer_length=1, version_2=False)
    assert out.predictions == {"q": "big"}  # "big cat" has 2 sub-tokens
    assert _predict([_feature(0)], results, version_2=False).predictions == {"q": "big cat"}
    # No start with max context: no span at all -> Google's "empty" (1.1) / "" (2.0).
    out = _predict([_feature(0, max_context=False)], results, version_2=False)
    assert out.predictions == {"q": "empty"}
    out = _predict([_feature(0, max_context=False)], results)
    assert out.predictions == {"q": ""} and out.null_odds == {"q": pytest.approx(-10.0)}


def test_missing_result_is_an_error():
    with pytest.raises(KeyError):
        _predict([_feature(0)], {})


def test_output_files(tmp_path):
    results = {0: _logits((1, 1), [0, 3, 0, -9], [0, 0, 2.5, -9])}
    out = _predict([_feature(0)], results)
    paths = write_predictions(out, tmp_path / "res", nbest=True)
    assert json.loads((tmp_path / "res" / "predictions.json").read_text()) == {"q": "big cat"}
    assert json.loads((tmp_path / "res" / "null_odds.json").read_text()) == {"q": -3.5}
    assert set(paths) == {"predictions", "nbest_predictions", "null_odds"}
    v1 = _predict([_feature(0)], results, version_2=False)
    assert set(write_predictions(v1, tmp_path / "v1")) == {"predictions"}
