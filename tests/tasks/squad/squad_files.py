"""Small hand-made SQuAD files in the official format, shared by the SQuAD tests."""

from __future__ import annotations

import json
from pathlib import Path

TESLA = ("Nikola Tesla (1856-1943) was a Serbian-American inventor. He worked for Edison's "
         "company in New York, then moved to Zürich, \"briefly\".")
ARNOLD = "Arnold Schwarzenegger's films were popular in the 1980s."

# (qid, question, answer text or None for an impossible question): every answer covers word
# pieces or punctuation inside a whitespace word.
TESLA_QAS = [
    ("born", "When was Tesla born?", "1856"),
    ("company", "Whose company did he work for?", "Edison's company"),
    ("nation", "What nationality first?", "Serbian"),
    ("city", "Where did he move?", "Zürich"),
    ("quoted", "How long?", "briefly"),
    ("king", "Who was the king of Mars?", None),
]
ARNOLD_QAS = [
    ("actor", "Whose films?", "Schwarzenegger"),
    ("decade", "When were they popular?", "1980s"),
]


def qa(qid: str, question: str, context: str, answer: str | None) -> dict:
    if answer is None:
        return {"id": qid, "question": question, "answers": [], "is_impossible": True,
                "plausible_answers": [{"text": "Mars", "answer_start": 0}]}
    return {"id": qid, "question": question, "is_impossible": False,
            "answers": [{"text": answer, "answer_start": context.index(answer)}]}


def squad_dict(impossible: bool = True) -> dict:
    paragraphs = [{"context": TESLA, "qas": [qa(q, s, TESLA, a) for q, s, a in TESLA_QAS
                                            if impossible or a is not None]},
                  {"context": ARNOLD, "qas": [qa(q, s, ARNOLD, a) for q, s, a in ARNOLD_QAS]}]
    return {"version": "v2.0" if impossible else "1.1",
            "data": [{"title": "Tesla", "paragraphs": paragraphs[:1]},
                     {"title": "Arnold", "paragraphs": paragraphs[1:]}]}


def write(path: Path, content) -> Path:
    path.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    return path


def bert_tokenizer(shared_data):
    from megatron.tokenizer.bert import BertWordPieceTokenizer

    return BertWordPieceTokenizer(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt")


# A synthetic SQuAD task a tiny BERT learns in a few dozen steps: the answer is the one colour
# word of the context (none in an impossible question).
COLORS = ["red", "blue", "green", "yellow", "black", "white", "brown", "pink", "purple",
          "orange", "gray", "golden"]
FILLER = ["the", "cat", "walked", "to", "river", "and", "then", "looked", "at", "a", "small",
          "boat", "near", "hill", "my", "friend", "bought", "house", "with", "garden", "old",
          "man", "found", "bridge", "school", "market", "car", "dog", "saw", "tree"]


def synthetic_squad(n: int, seed: int, impossible_every: int = 0, words: int = 14) -> dict:
    """``n`` questions on ``n`` paragraphs; with ``impossible_every`` = k, every k-th question
    has no colour in its context and is impossible (SQuAD 2.0)."""
    import random

    rng = random.Random(seed)
    articles = []
    for i in range(n):
        context_words = [rng.choice(FILLER) for _ in range(words)]
        impossible = impossible_every and i % impossible_every == impossible_every - 1
        qa = {"id": f"s{seed}-{i}", "question": "which colour is named here ?"}
        if impossible:
            qa.update(answers=[], is_impossible=True)
        else:
            color = rng.choice(COLORS)
            context_words.insert(rng.randrange(words + 1), color.capitalize() + ",")
            context = " ".join(context_words)
            start = context.index(color.capitalize() + ",")
            qa.update(answers=[{"text": color.capitalize(), "answer_start": start}],
                      is_impossible=False)
        articles.append({"title": f"t{i}", "paragraphs": [
            {"context": " ".join(context_words), "qas": [qa]}]})
    return {"version": "v2.0" if impossible_every else "1.1", "data": articles}
