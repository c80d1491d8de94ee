"""Small synthetic task files in the official formats (RACE directories of JSON lines, MNLI and
QQP TSVs) whose labels a tiny BERT learns in a few dozen steps (the label is carried by the
words of the text): the data of examples/finetune_{race,mnli,qqp}.sh's demo runs and of the
tests.

    python -m tasks.finetune_sample_data --task RACE --out demo/   (or MNLI, QQP)

writes the training and dev files under ``demo/`` and prints their paths.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our team", "the old man",
            "a young girl", "the farmer", "his brother", "the doctor"]
VERBS = ["walked to", "looked at", "talked about", "painted", "visited", "cleaned",
         "bought", "found", "liked", "watched"]
OBJECTS = ["the house", "a garden", "the river", "the market", "a small boat", "the school",
           "the bridge", "a red car", "the hill", "the library"]
# MNLI: the hypothesis word that decides the label.
MNLI_CUES = {"contradiction": "never", "entailment": "surely", "neutral": "perhaps"}
MNLI_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
               "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
               "sentence2", "label1", "gold_label"]


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} ."


def write_mnli(path: Path, n: int, seed: int, test: bool = False) -> Path:
    """An MNLI TSV of ``n`` rows (12 columns; a 10-column test file without labels)."""
    rng = random.Random(seed)
    header = MNLI_HEADER[:10] if test else MNLI_HEADER
    lines = ["\t".join(header)]
    for i in range(n):
        label = rng.choice(sorted(MNLI_CUES))
        premise = _sentence(rng)
        cue = MNLI_CUES[label]
        hypothesis = f"{cue} {_sentence(rng)[:-2]} {cue} ."
        row = [str(i), str(1000 + i), f"{i}e", "fiction", "(x)", "(y)", "(X)", "(Y)",
               premise, hypothesis]
        if not test:
            row += [label, label]
        lines.append("\t".join(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def write_qqp(path: Path, n: int, seed: int, test: bool = False) -> Path:
    """A QQP TSV of ``n`` rows: duplicates share the question word ``why`` at the start."""
    rng = random.Random(seed)
    lines = ["id\tquestion1\tquestion2" if test else
             "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"]
    for i in range(n):
        dup = rng.randint(0, 1)
        q1 = f"why did {_sentence(rng)[:-2]} ?"
        q2 = (f"why did {_sentence(rng)[:-2]} ?" if dup else
              f"where is {rng.choice(OBJECTS)} ?")
        if test:
            lines.append(f"{i}\t{q1}\t{q2}")
        else:
            lines.append(f"{i}\t{2 * i}\t{2 * i + 1}\t{q1}\t{q2}\t{dup}")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_race(directory: Path, docs: int, seed: int, questions_per_doc: int = 2) -> Path:
    """A RACE directory of two ``*.txt`` files: the right option is the place the article
    names, the wrong ones are actions (a cloze ``_`` question every other time)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for _ in range(docs):
        named = rng.choice(OBJECTS)
        article = f"{rng.choice(SUBJECTS)} went to {named}.\n{_sentence(rng)}"
        questions, options, answers = [], [], []
        for q in range(questions_per_doc):
            right = rng.randrange(4)
            order = rng.sample(VERBS, 3)
            order.insert(right, named)
            options.append(order)
            answers.append("ABCD"[right])
            questions.append("where did they go ?" if q % 2 else "they went to _ .")
        lines.append(json.dumps({"article": article, "questions": questions,
                                 "options": options, "answers": answers,
                                 "id": f"{len(lines)}.txt"}))
    half = len(lines) // 2
    (directory / "1.txt").write_text("\n".join(lines[:half]) + "\n")
    (directory / "2.txt").write_text("\n".join(lines[half:]) + "\n")
    return directory


def write_vocab(path: Path) -> Path:
    """A WordPiece vocabulary of exactly the synthetic tasks' words (a 30k-entry embedding
    would be most of a tiny model's step)."""
    words = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", "_", "where", "did",
             "why", "is", "they", "go", "went", "to", "never", "surely", "perhaps"}
    for phrase in SUBJECTS + VERBS + OBJECTS:
        words.update(phrase.split())
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    path.write_text("\n".join(specials + sorted(words - set(specials))) + "\n")
    return path


def write_task(task: str, out: Path) -> dict[str, list[str]]:
    """The demo's training and dev data of ``task`` under ``out``: ``{"train": [...],
    "valid": [...]}`` (paths)."""
    out.mkdir(parents=True, exist_ok=True)
    if task == "RACE":
        return {"train": [str(write_race(out / "RACE" / "train" / "middle", 128, seed=1))],
                "valid": [str(write_race(out / "RACE" / "dev" / name, 16, seed=2 + i))
                          for i, name in enumerate(("middle", "high"))]}
    writer = {"MNLI": write_mnli, "QQP": write_qqp}[task]
    (out / task).mkdir(exist_ok=True)
    dev = "dev_matched.tsv" if task == "MNLI" else "dev.tsv"
    return {"train": [str(writer(out / task / "train.tsv", 512, seed=1))],
            "valid": [str(writer(out / task / dev, 64, seed=2))]}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, choices=("RACE", "MNLI", "QQP"))
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    paths = write_task(args.task, args.out)
    sys.stdout.write(f"TRAIN_DATA='{' '.join(paths['train'])}'\n"
                     f"VALID_DATA='{' '.join(paths['valid'])}'\n")


if __name__ == "__main__":
    main()
