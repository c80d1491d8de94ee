"""The official SQuAD scores: ``evaluate-v1.1.py`` and ``evaluate-v2.0.py``, same definitions.

Answers are compared after :func:`normalize_answer` (lowercase, drop ASCII punctuation, drop
the articles a/an/the, collapse whitespace). Exact match and token F1 of a prediction are the
maximum over its question's gold answers.

* v1.1: every question of the file counts; a question without a prediction scores 0. Keys
  ``exact_match`` and ``f1`` (percentages).
* v2.0: gold answers that normalise to "" are dropped and a question left without one (an
  impossible question) has the single gold answer "" (so only "" scores); questions without a
  prediction are left out, as the script does. Keys ``exact``, ``f1``, ``total`` and the same
  over answerable (``HasAns_``) and impossible (``NoAns_``) questions. With ``na_probs``
  (``null_odds.json``: larger = more likely no answer), a question is predicted unanswerable
  where its value exceeds ``na_prob_thresh``, and ``best_exact``/``best_f1`` are the scores at
  the best threshold, found as the script finds it, with that threshold
  (``best_exact_thresh``/``best_f1_thresh``: the ``--null-score-diff-threshold`` to use).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lowercase, remove punctuation, articles and extra whitespace (the official order)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, gold: str) -> int:
    return int(normalize_answer(prediction) == normalize_answer(gold))


def f1_v1(prediction: str, gold: str) -> float:
    """evaluate-v1.1's token F1 (0 when either side normalises to nothing)."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(gold).split())


def f1_v2(prediction: str, gold: str) -> float:
    """evaluate-v2.0's token F1: an empty side scores 1 only when both are empty."""
    pred_toks = normalize_answer(prediction).split() if prediction else []
    gold_toks = normalize_answer(gold).split() if gold else []
    if not pred_toks or not gold_toks:
        return float(pred_toks == gold_toks)
    return _token_f1(pred_toks, gold_toks)


def _token_f1(pred_toks: list[str], gold_toks: list[str]) -> float:
    num_same = sum((collections.Counter(pred_toks) & collections.Counter(gold_toks)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_toks), num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def _questions(dataset: Sequence) -> list[dict]:
    return [qa for article in dataset for paragraph in article["paragraphs"]
            for qa in paragraph["qas"]]


def evaluate_v1(dataset: Sequence, predictions: Mapping[str, str]) -> dict[str, float]:
    """``evaluate-v1.1.py``: ``dataset`` is the file's ``data`` list.

    Returns:
        ``{"exact_match": ..., "f1": ...}`` in percent.
    """
    em = f1 = 0.0
    questions = _questions(dataset)
    for qa in questions:
        if qa["id"] not in predictions:
            continue  # "Unanswered question ... will receive score 0."
        golds = [a["text"] for a in qa["answers"]]
        pred = predictions[qa["id"]]
        em += max(exact_match(pred, g) for g in golds)
        f1 += max(f1_v1(pred, g) for g in golds)
    total = max(len(questions), 1)
    return {"exact_match": 100.0 * em / total, "f1": 100.0 * f1 / total}


def raw_scores_v2(dataset: Sequence, predictions: Mapping[str, str]
                  ) -> tuple[dict[str, float], dict[str, float], dict[str, bool]]:
    """Per-question exact and F1 (questions with a prediction) and whether each has an answer."""
    exact, f1, has_ans = {}, {}, {}
    for qa in _questions(dataset):
        qid = qa["id"]
        has_ans[qid] = bool(qa["answers"])
        golds = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])] or [""]
        if qid not in predictions:
            continue  # "Missing prediction for ..."
        pred = predictions[qid]
        exact[qid] = max(exact_match(pred, g) for g in golds)
        f1[qid] = max(f1_v2(pred, g) for g in golds)
    return exact, f1, has_ans


def _apply_no_answer_threshold(scores: Mapping[str, float], na_probs: Mapping[str, float],
                               has_ans: Mapping[str, bool], thresh: float) -> dict[str, float]:
    return {qid: float(not has_ans[qid]) if na_probs[qid] > thresh else s
            for qid, s in scores.items()}


def _summary(exact: Mapping[str, float], f1: Mapping[str, float],
             qids: Sequence[str] | None = None) -> dict[str, float]:
    qids = list(exact) if qids is None else qids
    total = len(qids)
    return {"exact": 100.0 * sum(exact[q] for q in qids) / total,
            "f1": 100.0 * sum(f1[q] for q in qids) / total, "total": total}


def find_best_threshold(predictions: Mapping[str, str], scores: Mapping[str, float],
                        na_probs: Mapping[str, float],
                        has_ans: Mapping[str, bool]) -> tuple[float, float]:
    """evaluate-v2.0's ``find_best_thresh``: start from "every question unanswered" (the
    impossible questions right), lower the threshold past one question at a time in order of
    ``na_probs`` and keep the best running score. Returns (score in percent, threshold)."""
    cur = best = sum(1 for q in has_ans if not has_ans[q])
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in scores:
            continue
        if has_ans[qid]:
            cur += scores[qid]
        elif predictions[qid]:
            cur -= 1
        if cur > best:
            best, best_thresh = cur, na_probs[qid]
    return 100.0 * best / len(scores), best_thresh


def evaluate_v2(dataset: Sequence, predictions: Mapping[str, str],
                na_probs: Mapping[str, float] | None = None,
                na_prob_thresh: float = 1.0) -> dict[str, float]:
    """``evaluate-v2.0.py`` (``--na-prob-file`` = ``na_probs``, ``--na-prob-thresh``).

    Returns:
        ``exact``, ``f1``, ``total``, ``HasAns_*``/``NoAns_*`` where the file has such questions,
        and ``best_exact``, ``best_exact_thresh``, ``best_f1``, ``best_f1_thresh`` with
        ``na_probs``.

    Raises:
        ValueError: no question of ``dataset`` has a prediction.
    """
    exact_raw, f1_raw, has_ans = raw_scores_v2(dataset, predictions)
    if not exact_raw:
        raise ValueError("no question of the data set has a prediction: are the predictions "
                         "for another file?")
    probs = na_probs if na_probs is not None else {qid: 0.0 for qid in predictions}
    exact = _apply_no_answer_threshold(exact_raw, probs, has_ans, na_prob_thresh)
    f1 = _apply_no_answer_threshold(f1_raw, probs, has_ans, na_prob_thresh)
    out = _summary(exact, f1)
    for prefix, wanted in (("HasAns", True), ("NoAns", False)):
        # (The script would stop with a KeyError on such a question left unpredicted.)
        qids = [q for q, h in has_ans.items() if h == wanted and q in exact]
        if qids:
            out.update({f"{prefix}_{k}": v for k, v in _summary(exact, f1, qids).items()})
    if na_probs is not None:
        out["best_exact"], out["best_exact_thresh"] = find_best_threshold(
            predictions, exact_raw, na_probs, has_ans)
        out["best_f1"], out["best_f1_thresh"] = find_best_threshold(
            predictions, f1_raw, na_probs, has_ans)
    return out


def evaluate(dataset: Sequence, predictions: Mapping[str, str], version: str,
             null_odds: Mapping[str, float] | None = None) -> dict[str, float]:
    """What the finetuning reports: ``evaluate-v1.1.py data predictions.json``, or for 2.0
    ``evaluate-v2.0.py data predictions.json`` (the predictions as the threshold made them)
    plus, with ``null_odds``, the ``best_*`` lines that ``--na-prob-file null_odds.json`` adds
    (those do not depend on ``--na-prob-thresh``)."""
    if version == "1.1":
        return evaluate_v1(dataset, predictions)
    out = evaluate_v2(dataset, predictions)
    if null_odds is not None:
        exact_raw, f1_raw, has_ans = raw_scores_v2(dataset, predictions)
        out["best_exact"], out["best_exact_thresh"] = find_best_threshold(
            predictions, exact_raw, null_odds, has_ans)
        out["best_f1"], out["best_f1_thresh"] = find_best_threshold(
            predictions, f1_raw, null_odds, has_ans)
    return out
