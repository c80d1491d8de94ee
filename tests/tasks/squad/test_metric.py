"""tasks.squad.metric: the official evaluate-v1.1 / v2.0 definitions on hand-computed cases."""

from __future__ import annotations

import pytest

from tasks.squad.metric import (evaluate, evaluate_v1, evaluate_v2, exact_match, f1_v1, f1_v2,
                                normalize_answer)


@pytest.mark.parametrize("text,normalized", [
    ("The  Quick, brown-fox!  an apple", "quick brownfox apple"),  # punctuation joins words
    ("Theory of a cat", "theory of cat"),  # whole-word articles only
    ("A", ""),
    ("  Denver\tBroncos.  ", "denver broncos"),
    ("«Zürich»", "«zürich»"),  # only ASCII punctuation is removed
    ("the-an", "thean"),  # the official order: punctuation goes before the articles
])
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


def test_exact_and_f1_by_hand():
    assert exact_match("The Broncos!", "broncos") == 1
    # pred tokens cat sat on mat, gold cat on mat: P = 3/4, R = 1, F1 = 6/7.
    assert f1_v1("the cat sat on the mat", "cat on mat") == pytest.approx(6 / 7)
    assert f1_v1("cat cat", "cat") == pytest.approx(2 * 0.5 * 1 / 1.5)  # counted overlap
    assert f1_v1("", "") == 0 and f1_v2("", "") == 1  # the two scripts differ here
    assert f1_v2("the", "") == 1 and f1_v2("cat", "") == 0 and f1_v2("", "cat") == 0


def _dataset(*qas):
    return [{"paragraphs": [{"context": "c", "qas": [
        {"id": qid, "answers": [{"text": t, "answer_start": 0} for t in golds]}
        for qid, golds in qas]}]}]


def test_v1_max_over_golds_and_unanswered_questions_score_zero():
    data = _dataset(("q1", ["Denver Broncos", "The Denver Broncos", "Broncos"]),
                    ("q2", ["Denver Broncos", "Broncos"]), ("q3", ["Santa Clara"]))
    # q1 exact; q2 "Denver": F1 max(2/3 vs "Denver Broncos", 0) = 2/3; q3 missing: 0.
    scores = evaluate_v1(data, {"q1": "the broncos", "q2": "Denver"})
    assert scores == {"exact_match": pytest.approx(100 / 3),
                      "f1": pytest.approx(100 * (1 + 2 / 3) / 3)}
    assert evaluate(data, {"q1": "the broncos", "q2": "Denver"}, "1.1") == scores


def test_v2_no_answer_breakdowns_and_best_threshold():
    # q1, q2 answerable; q3, q4 impossible; q5's only gold normalises to "" (so "" scores).
    data = _dataset(("q1", ["Broncos"]), ("q2", ["Carolina Panthers"]), ("q3", []), ("q4", []),
                    ("q5", ["The"]))
    preds = {"q1": "Broncos", "q2": "Panthers", "q3": "x", "q4": "", "q5": ""}
    out = evaluate_v2(data, preds)
    # exact: 1, 0, 0, 1, 1; F1: 1, 2/3 (P 1, R 1/2), 0, 1, 1.
    assert out["exact"] == pytest.approx(60.0) and out["total"] == 5
    assert out["f1"] == pytest.approx(100 * (1 + 2 / 3 + 0 + 1 + 1) / 5)
    assert out["HasAns_total"] == 3 and out["HasAns_exact"] == pytest.approx(200 / 3)
    assert out["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 3 + 1) / 3)
    assert (out["NoAns_exact"], out["NoAns_f1"], out["NoAns_total"]) == (50.0, 50.0, 2)
    assert "best_f1" not in out
    # Missing predictions are left out of v2's totals (the script's "Missing prediction").
    assert evaluate_v2(data, {"q1": "Broncos"}) == {
        "exact": 100.0, "f1": 100.0, "total": 1, "HasAns_exact": 100.0, "HasAns_f1": 100.0,
        "HasAns_total": 1}


def test_v2_null_odds_threshold_search():
    data = _dataset(("q1", ["Broncos"]), ("q2", ["Panthers"]), ("q3", []), ("q4", []))
    preds = {"q1": "Broncos", "q2": "Gophers", "q3": "x", "q4": ""}
    na = {"q1": 0.1, "q2": 0.5, "q3": 0.9, "q4": 0.3}
    out = evaluate_v2(data, preds, na)
    # Start at "all unanswered": 2 (the impossible ones). In na order: q1 +1 -> 3 (best, at
    # 0.1); q4 ("" predicted) +0; q2 +0; q3 ("x" predicted) -1 -> 2. Best 3/4 at 0.1.
    assert (out["best_exact"], out["best_exact_thresh"]) == (75.0, 0.1)
    assert (out["best_f1"], out["best_f1_thresh"]) == (75.0, 0.1)
    assert out["exact"] == 50.0  # no na value above the default --na-prob-thresh 1.0
    # --na-prob-thresh 0.4: q2 and q3 count as "no answer": q2 wrong, q3 right -> 3/4.
    assert evaluate_v2(data, preds, na, na_prob_thresh=0.4)["exact"] == 75.0
    with pytest.raises(ValueError, match="no question of the data set has a prediction"):
        evaluate_v2(data, {"other": "x"})


def test_reported_scores_are_the_plain_script_plus_best_threshold():
    data = _dataset(("q1", ["Broncos"]), ("q2", ["Panthers"]), ("q3", []), ("q4", []))
    preds = {"q1": "Broncos", "q2": "Gophers", "q3": "x", "q4": ""}
    na = {"q1": 0.1, "q2": 5.0, "q3": 0.9, "q4": 0.3}  # q2 above the script's default 1.0
    out = evaluate(data, preds, "2.0", na)
    assert out["exact"] == 50.0  # as `evaluate-v2.0.py data preds`: no threshold applied
    assert evaluate_v2(data, preds, na)["exact"] == 50.0  # (q2 is wrong either way)
    assert (out["best_exact"], out["best_exact_thresh"]) == (75.0, 0.1)
    assert "best_f1" not in evaluate(data, preds, "2.0")
