"""The RACE reader (Megatron-LM's ``tasks/race/data.py``).

A RACE split is a directory (``RACE/dev/middle``, ``RACE/dev/high``...) of ``*.txt`` files,
each line one JSON document ``{"article", "questions": [q], "options": [[4 options]],
"answers": ["A".."D"]}``. Every question becomes one sample of 4 rows, one per option:
``qa`` = the question with ``_`` replaced by the option (else ``question + " " + option``),
:func:`~tasks.data_utils.clean_text`-ed, tokenized and cut to 128 tokens;
``[CLS] qa [SEP] article [SEP]`` cut to ``max_seq_length`` and padded. Label = the answer's
index (``ord(answer) - ord("A")``).

Megatron asserts on a malformed document; here a ``ValueError`` names the file, the line and
what is wrong (invalid JSON, a missing key, mismatched list lengths, not 4 options, an answer
outside A-D). Files are read in sorted order (Megatron's ``glob`` order is the file system's).
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Sequence

import torch

from megatron.core.log import log_rank_0
from tasks.data_utils import (build_sample, build_tokens_types_paddings_from_ids, clean_text,
                              utf8_lines)

NUM_CHOICES = 4
MAX_QA_LENGTH = 128
_KEYS = ("article", "questions", "options", "answers")


class RaceDataset(torch.utils.data.Dataset):
    """The questions of one or more RACE directories; items as
    :func:`~tasks.data_utils.build_sample` with ``[4, s]`` rows."""

    sample_multiplier = NUM_CHOICES
    """Rows per sample (Megatron's attribute): the model sees ``4 b`` sequences."""

    def __init__(self, dataset_name: str, datapaths: Sequence[str], tokenizer,
                 max_seq_length: int, max_qa_length: int = MAX_QA_LENGTH) -> None:
        self.dataset_name = dataset_name
        log_rank_0(f" > building RACE dataset for {dataset_name}:")
        self.samples: list[dict] = []
        for datapath in datapaths:
            self.samples.extend(read_race_directory(datapath, tokenizer, max_qa_length,
                                                    max_seq_length))
        log_rank_0(f"  >> total number of samples: {len(self.samples)}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict:
        return self.samples[idx]


def qa_text(question: str, option: str) -> str:
    """Megatron's question + option: ``_`` (a cloze blank) replaced by the option, else the two
    joined by a space; cleaned."""
    qa = question.replace("_", option) if "_" in question else " ".join([question, option])
    return clean_text(qa)


def read_race_directory(datapath: str, tokenizer, max_qa_length: int,
                        max_seq_length: int) -> list[dict]:
    """Every question of every ``*.txt`` file in ``datapath``, as samples.

    Raises:
        ValueError: naming the file and line of a malformed document, or a directory without
            ``*.txt`` files.
    """
    log_rank_0(f"   > working on {datapath}")
    start = time.time()
    filenames = sorted(glob.glob(os.path.join(datapath, "*.txt")))
    if not filenames:
        raise ValueError(f"RACE data {datapath}: no *.txt files (give a directory such as "
                         "RACE/train/middle, whose files hold one JSON document per line)")
    samples: list[dict] = []
    num_docs = num_questions = 0
    for filename in filenames:
        for number, line in utf8_lines(filename):
            if not line.strip():
                continue
            doc = _document(line, filename, number)
            num_docs += 1
            for sample in _question_samples(doc, tokenizer, max_qa_length, max_seq_length,
                                            f"{filename}:{number}", len(samples)):
                samples.append(sample)
                num_questions += 1
    log_rank_0(f"    > processed {num_docs} document, {num_questions} questions, and "
               f"{len(samples)} samples in {time.time() - start:.2f} seconds")
    return samples


def _document(line: str, filename: str, number: int) -> dict:
    where = f"{filename}:{number}"
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not a JSON document ({err.msg} at column {err.colno})") \
            from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object with keys {', '.join(_KEYS)}")
    missing = [key for key in _KEYS if key not in doc]
    if missing:
        raise ValueError(f"{where}: a RACE document needs the keys {', '.join(_KEYS)}; "
                         f"missing {', '.join(missing)}")
    if not (len(doc["questions"]) == len(doc["options"]) == len(doc["answers"])):
        raise ValueError(f"{where}: {len(doc['questions'])} questions, {len(doc['options'])} "
                         f"option lists and {len(doc['answers'])} answers: expected one of "
                         "each per question")
    return doc


def _question_samples(doc: dict, tokenizer, max_qa_length: int, max_seq_length: int,
                      where: str, first_uid: int):
    context_ids = tokenizer.tokenize(clean_text(doc["article"]))
    for qi, question in enumerate(doc["questions"]):
        answer, options = doc["answers"][qi], doc["options"][qi]
        if not (isinstance(answer, str) and len(answer) == 1 and "A" <= answer <= "D"):
            raise ValueError(f"{where}: question {qi}: answer {answer!r} is not one of A-D")
        if len(options) != NUM_CHOICES:
            raise ValueError(f"{where}: question {qi} has {len(options)} options, expected "
                             f"{NUM_CHOICES}")
        rows = []
        for option in options:
            qa_ids = tokenizer.tokenize(qa_text(question, option))[:max_qa_length]
            rows.append(build_tokens_types_paddings_from_ids(
                qa_ids, context_ids, max_seq_length, tokenizer.cls, tokenizer.sep,
                tokenizer.pad))
        ids, types, paddings = zip(*rows)
        yield build_sample(ids, types, paddings, ord(answer) - ord("A"), first_uid + qi)


def dataset_name_from_path(path: str) -> str:
    """Megatron's name of a RACE split in the results lines: the path after ``RACE`` with
    ``/`` as ``-`` (``data/RACE/dev/middle`` -> ``dev-middle``); else its last two parts."""
    if "RACE" in path:
        return path.split("RACE")[-1].strip("/").replace("/", "-")
    parts = os.path.normpath(path).split(os.sep)
    return "-".join(parts[-2:])
