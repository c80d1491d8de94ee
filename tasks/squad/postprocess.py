"""Start/end logits -> answers (Google's ``write_predictions``), in the official output files.

For each example, over all its features: the ``n_best_size`` best start and end positions of
each feature give candidate spans, kept when both ends are document tokens, the start is where
its token has max context, end >= start and the span has at most ``max_answer_length``
sub-tokens. Candidates are ranked by start + end logit; a candidate's text is its sub-tokens
de-WordPieced and projected back onto the original words (:func:`get_final_text`), duplicates
dropped. SQuAD 2.0 also scores "no answer": the smallest ``start[0] + end[0]`` ([CLS]) over the
example's features; the prediction is "" when that null score minus the best non-null score
exceeds ``null_score_diff_threshold`` (the difference is written to ``null_odds.json``, which
``evaluate-v2.0.py --na-prob-file`` reads to find the best threshold on dev).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import unicodedata
from collections.abc import Mapping, Sequence

import numpy as np

from tasks.squad.features import SquadFeature
from tasks.squad.reader import SquadExample

# Google's CJK ideograph blocks (BasicTokenizer._is_chinese_char).
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


@dataclasses.dataclass
class Predictions:
    """The answers of a set of examples, in the official files' forms."""

    predictions: dict[str, str]
    """qid -> answer text ("" = no answer): ``predictions.json``."""
    nbest: dict[str, list[dict]]
    """qid -> the n-best candidates (text, probability, start_logit, end_logit)."""
    null_odds: dict[str, float] | None
    """SQuAD 2.0: qid -> null score - best non-null score (``null_odds.json``)."""


# Google's BasicTokenizer (only get_final_text uses it) -------------------------------------
def _is_punctuation(char: str) -> bool:
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_control(char: str) -> bool:
    return char not in "\t\n\r" and unicodedata.category(char) in ("Cc", "Cf")


def _is_whitespace(char: str) -> bool:
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
    """Google's ``BasicTokenizer``: clean, isolate CJK, split on whitespace, (lowercase and
    strip accents), split off punctuation. The WordPiece tokens of a word concatenate (without
    ``##``) to one of these."""
    chars = []
    for char in text:
        cp = ord(char)
        if cp == 0 or cp == 0xFFFD or _is_control(char):
            continue
        if any(lo <= cp <= hi for lo, hi in _CJK_RANGES):
            chars.append(f" {char} ")
        else:
            chars.append(" " if _is_whitespace(char) else char)
    out: list[str] = []
    for word in "".join(chars).split():
        if lower_case:
            word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                           if unicodedata.category(c) != "Mn")
        piece = ""
        for char in word:
            if _is_punctuation(char):
                out.extend([piece, char] if piece else [char])
                piece = ""
            else:
                piece += char
        if piece:
            out.append(piece)
    return out


def _strip_spaces(text: str) -> tuple[str, dict[int, int]]:
    """``text`` without spaces, and each kept character's index in ``text``."""
    kept = [(i, c) for i, c in enumerate(text) if c != " "]
    return "".join(c for _, c in kept), {n: i for n, (i, _) in enumerate(kept)}


def get_final_text(pred_text: str, orig_text: str, lower_case: bool) -> str:
    """The part of ``orig_text`` (original words) that the normalised ``pred_text`` is.

    ``pred_text`` is de-WordPieced, lowercased, punctuation-split text ("steve smith 's");
    the original words ("Steve Smith's") are basic-tokenised the same way, the prediction is
    found in them, and the characters are aligned ignoring spaces. Where the two do not align
    (accents stripped, a character the tokenizer dropped), the whole ``orig_text`` is the
    answer, as in Google's recipe.
    """
    tok_text = " ".join(basic_tokenize(orig_text, lower_case))
    start = tok_text.find(pred_text)
    if start == -1:
        return orig_text
    end = start + len(pred_text) - 1
    orig_ns_text, orig_ns_to_s = _strip_spaces(orig_text)
    tok_ns_text, tok_ns_to_s = _strip_spaces(tok_text)
    if len(orig_ns_text) != len(tok_ns_text):
        return orig_text
    tok_s_to_ns = {s: ns for ns, s in tok_ns_to_s.items()}
    if start not in tok_s_to_ns or end not in tok_s_to_ns:
        return orig_text
    return orig_text[orig_ns_to_s[tok_s_to_ns[start]]:orig_ns_to_s[tok_s_to_ns[end]] + 1]


def _best_indexes(logits: np.ndarray, n_best_size: int) -> list[int]:
    """Positions of the ``n_best_size`` largest logits, ties by position."""
    return np.argsort(-np.asarray(logits, dtype=np.float64), kind="stable")[:n_best_size].tolist()


def _softmax(scores: Sequence[float]) -> list[float]:
    if not scores:
        return []
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


_Prelim = collections.namedtuple("_Prelim", "feature_index start end start_logit end_logit")


def _candidates(features: Sequence[SquadFeature], results: Mapping[int, tuple],
                n_best_size: int, max_answer_length: int) -> list[_Prelim]:
    """Every valid (start, end) pair among each feature's best starts and ends."""
    out = []
    for feature_index, feature in enumerate(features):
        start_logits, end_logits = results[feature.unique_id]
        for start in _best_indexes(start_logits, n_best_size):
            if not feature.is_max_context(start):
                continue  # also drops non-document positions
            for end in _best_indexes(end_logits, n_best_size):
                if feature.word_index(end) is None or end < start or \
                        end - start + 1 > max_answer_length:
                    continue
                out.append(_Prelim(feature_index, start, end, float(start_logits[start]),
                                   float(end_logits[end])))
    return out


def _span_text(example: SquadExample, feature: SquadFeature, start: int, end: int,
               inv_vocab: Mapping[int, str], lower_case: bool) -> str:
    tok_text = " ".join(inv_vocab[int(i)] for i in feature.input_ids[start:end + 1])
    tok_text = " ".join(tok_text.replace(" ##", "").replace("##", "").strip().split())
    orig_tokens = example.doc_tokens[feature.word_index(start):feature.word_index(end) + 1]
    return get_final_text(tok_text, " ".join(orig_tokens), lower_case)


def _null_score(features: Sequence[SquadFeature],
                results: Mapping[int, tuple]) -> tuple[float, _Prelim]:
    """The smallest [CLS] score over the features, as a candidate."""
    best = None
    for feature_index, feature in enumerate(features):
        start_logits, end_logits = results[feature.unique_id]
        score = float(start_logits[0]) + float(end_logits[0])
        if best is None or score < best[0]:
            best = (score, _Prelim(feature_index, 0, 0, float(start_logits[0]),
                                   float(end_logits[0])))
    return best


def predict_example(example: SquadExample, features: Sequence[SquadFeature],
                    results: Mapping[int, tuple], *, n_best_size: int, max_answer_length: int,
                    version_2: bool, null_score_diff_threshold: float,
                    inv_vocab: Mapping[int, str], lower_case: bool
                    ) -> tuple[str, list[dict], float | None]:
    """One example's answer, n-best list and (2.0) null-score difference."""
    prelim = _candidates(features, results, n_best_size, max_answer_length)
    if version_2:
        score_null, null = _null_score(features, results)
        prelim.append(null)
    prelim.sort(key=lambda p: p.start_logit + p.end_logit, reverse=True)
    seen, nbest = set(), []
    for pred in prelim:
        if len(nbest) >= n_best_size:
            break
        text = "" if pred.start == 0 else _span_text(
            example, features[pred.feature_index], pred.start, pred.end, inv_vocab, lower_case)
        if text in seen:
            continue
        seen.add(text)
        nbest.append((text, pred.start_logit, pred.end_logit))
    if version_2 and "" not in seen:
        nbest.append(("", null.start_logit, null.end_logit))
    no_span = not any(text for text, _, _ in nbest)
    if no_span:
        # No valid span at all: Google's "empty" entry (its 2.0 code would crash here; HF
        # scores this entry as 0 for the null-score difference, as here).
        nbest.insert(0, ("empty", 0.0, 0.0))
    probs = _softmax([s + e for _, s, e in nbest])
    nbest_json = [{"text": t, "probability": p, "start_logit": s, "end_logit": e}
                  for (t, s, e), p in zip(nbest, probs)]
    if not version_2:
        return nbest[0][0], nbest_json, None
    best_text, best_start, best_end = next(entry for entry in nbest if entry[0])
    score_diff = score_null - best_start - best_end
    answer = "" if no_span or score_diff > null_score_diff_threshold else best_text
    return answer, nbest_json, score_diff


def compute_predictions(examples: Sequence[SquadExample], features: Sequence[SquadFeature],
                        results: Mapping[int, tuple], *, n_best_size: int = 20,
                        max_answer_length: int = 30, version_2: bool = False,
                        null_score_diff_threshold: float = 0.0,
                        inv_vocab: Mapping[int, str], lower_case: bool = True) -> Predictions:
    """The answers of ``examples`` from their features' logits.

    Args:
        examples: the examples, read for evaluation.
        features: their features (``example_index`` into ``examples``).
        results: feature ``unique_id`` -> (start logits, end logits), each one value per
            position of the padded sequence.
        n_best_size: ``--n-best-size``.
        max_answer_length: ``--max-answer-length`` (sub-tokens).
        version_2: SQuAD 2.0 (null answers).
        null_score_diff_threshold: ``--null-score-diff-threshold``.
        inv_vocab: the tokenizer's id -> token string.
        lower_case: the tokenizer lowercases (BertWordPieceLowerCase).

    Raises:
        KeyError: a feature without a result.
    """
    by_example: dict[int, list[SquadFeature]] = collections.defaultdict(list)
    for feature in features:
        by_example[feature.example_index].append(feature)
    out = Predictions({}, {}, {} if version_2 else None)
    for index, example in enumerate(examples):
        answer, nbest, diff = predict_example(
            example, by_example[index], results, n_best_size=n_best_size,
            max_answer_length=max_answer_length, version_2=version_2,
            null_score_diff_threshold=null_score_diff_threshold, inv_vocab=inv_vocab,
            lower_case=lower_case)
        out.predictions[example.qas_id] = answer
        out.nbest[example.qas_id] = nbest
        if version_2:
            out.null_odds[example.qas_id] = diff
    return out


def write_predictions(predictions: Predictions, out_dir: str | os.PathLike, *,
                      nbest: bool = False, prefix: str = "") -> dict[str, str]:
    """Write ``predictions.json`` (and ``nbest_predictions.json``, ``null_odds.json`` for 2.0)
    into ``out_dir``; returns what -> path."""
    os.makedirs(out_dir, exist_ok=True)
    files = {"predictions": predictions.predictions}
    if nbest:
        files["nbest_predictions"] = predictions.nbest
    if predictions.null_odds is not None:
        files["null_odds"] = predictions.null_odds
    paths = {}
    for name, content in files.items():
        path = os.path.join(out_dir, f"{prefix}{name}.json")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=4, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, path)  # a reader never sees half a file
        paths[name] = path
    return paths
