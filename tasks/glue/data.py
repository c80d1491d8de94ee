"""GLUE sentence-pair readers (Megatron-LM's ``tasks/glue/{data,mnli,qqp}.py``).

* MNLI: a TSV with a header; ``uid`` = column 0, ``text_a`` = column 8, ``text_b`` = column 9,
  label = the last column, ``contradiction`` 0 / ``entailment`` 1 / ``neutral`` 2. A 10-column
  header marks a test file (no labels): every label is set to ``contradiction``.
* QQP: ``id qid1 qid2 question1 question2 is_duplicate`` (6 columns) for train/dev, ``id
  question1 question2`` (3) for test (labels set to 0). As Megatron, a train/dev row without
  6 columns, or with an empty question, is skipped with a warning (the official QQP files have
  such rows); the skips are counted and reported per file.

Where Megatron asserts (a short MNLI row, an unknown label, a bad header), a ``ValueError``
names the file and line. Texts are :func:`~tasks.data_utils.clean_text`-ed; the samples are
tokenized when read (``__getitem__``), as Megatron's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from megatron.core.log import log_rank_0, warn_rank_0
from tasks.data_utils import (build_sample, build_tokens_types_paddings_from_text, clean_text,
                              utf8_lines)

MNLI_LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}
QQP_LABELS = (0, 1)


class GLUEDataset(torch.utils.data.Dataset):
    """Samples of one or more files of a GLUE task; items as
    :func:`~tasks.data_utils.build_sample`."""

    def __init__(self, task_name: str, dataset_name: str, samples: list[dict], tokenizer,
                 max_seq_length: int) -> None:
        self.task_name, self.dataset_name = task_name, dataset_name
        self.samples, self.tokenizer, self.max_seq_length = samples, tokenizer, max_seq_length
        log_rank_0(f"  >> total number of {task_name} {dataset_name} samples: {len(samples)}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict:
        raw = self.samples[idx]
        ids, types, paddings = build_tokens_types_paddings_from_text(
            raw["text_a"], raw["text_b"], self.tokenizer, self.max_seq_length)
        return build_sample(ids, types, paddings, raw["label"], raw["uid"])


def _rows(filename: str):
    """``(line number, columns)`` of a TSV file (each line stripped, split on tabs)."""
    for number, line in utf8_lines(filename):
        yield number, line.strip().split("\t")


def _uid(value: str, filename: str, number: int) -> int:
    try:
        uid = int(value.strip())
    except ValueError:
        raise ValueError(f"{filename}:{number}: the id column holds {value!r}, not a "
                         "non-negative integer") from None
    if uid < 0:
        raise ValueError(f"{filename}:{number}: negative id {uid}")
    return uid


def read_mnli(filename: str, test_label: str = "contradiction") -> list[dict]:
    """The MNLI samples of one TSV file (train, dev_matched/mismatched, or test).

    Raises:
        ValueError: naming the file and line: fewer than 10 columns, an empty sentence, an
            unknown label, a bad id, or no header.
    """
    log_rank_0(f" > Processing {filename} ...")
    samples, is_test = [], None
    for number, row in _rows(filename):
        if is_test is None:
            if len(row) < 10:
                raise ValueError(f"{filename}:{number}: an MNLI header has >= 10 tab-separated "
                                 f"columns (sentence1 is column 9), this one {len(row)}")
            is_test = len(row) == 10
            if is_test:
                log_rank_0(f"   reading {row[0].strip()}, {row[8].strip()} and {row[9].strip()} "
                           f"columns and setting labels to {test_label}")
            else:
                log_rank_0(f"    reading {row[0].strip()} , {row[8].strip()}, "
                           f"{row[9].strip()}, and {row[-1].strip()} columns ...")
            continue
        if len(row) < 10:
            raise ValueError(f"{filename}:{number}: malformed MNLI row: {len(row)} "
                             "tab-separated columns, expected at least 10")
        text_a, text_b = clean_text(row[8].strip()), clean_text(row[9].strip())
        label = test_label if is_test else row[-1].strip()
        if not text_a or not text_b:
            raise ValueError(f"{filename}:{number}: empty sentence{'1' if not text_a else '2'}")
        if label not in MNLI_LABELS:
            raise ValueError(f"{filename}:{number}: unknown MNLI label {label!r} (expected one "
                             f"of {', '.join(MNLI_LABELS)})")
        samples.append({"text_a": text_a, "text_b": text_b, "label": MNLI_LABELS[label],
                        "uid": _uid(row[0], filename, number)})
    log_rank_0(f" >> processed {len(samples)} samples.")
    return samples


def read_qqp(filename: str, test_label: int = 0) -> list[dict]:
    """The QQP samples of one TSV file (train/dev with 6 columns, test with 3).

    Rows Megatron skips (train/dev rows without 6 columns or with an empty question) are
    skipped, counted and reported in one warning naming the file and their lines.

    Raises:
        ValueError: naming the file and line: a header of neither 3 nor 6 columns, a test row
            without 3 columns, an empty test question, a label not 0/1, a bad id.
    """
    log_rank_0(f" > Processing {filename} ...")
    samples, is_test, skipped = [], None, []
    for number, row in _rows(filename):
        if is_test is None:
            if len(row) not in (3, 6):
                raise ValueError(f"{filename}:{number}: a QQP header has 6 columns (id, qid1, "
                                 "qid2, question1, question2, is_duplicate) or 3 for a test "
                                 f"file (id, question1, question2), this one {len(row)}")
            is_test = len(row) == 3
            if is_test:
                log_rank_0(f"   reading {row[0].strip()}, {row[1].strip()}, and "
                           f"{row[2].strip()} columns and setting labels to {test_label}")
            else:
                log_rank_0(f"    reading {row[0].strip()}, {row[3].strip()}, {row[4].strip()}, "
                           f"and {row[5].strip()} columns ...")
            continue
        if is_test:
            if len(row) != 3:
                raise ValueError(f"{filename}:{number}: malformed QQP test row: {len(row)} "
                                 "tab-separated columns, expected 3")
            uid, text_a, text_b = row[0], clean_text(row[1].strip()), clean_text(row[2].strip())
            if not text_a or not text_b:
                raise ValueError(f"{filename}:{number}: empty question in a test file")
            label = test_label
        else:
            if len(row) != 6:
                skipped.append((number, f"{len(row)} columns"))
                continue
            uid, text_a, text_b = row[0], clean_text(row[3].strip()), clean_text(row[4].strip())
            if not text_a or not text_b:
                skipped.append((number, "empty question"))
                continue
            label = _qqp_label(row[5], filename, number)
        samples.append({"text_a": text_a, "text_b": text_b, "label": label,
                        "uid": _uid(uid, filename, number)})
    if skipped:
        shown = ", ".join(f"line {n} ({why})" for n, why in skipped[:10])
        more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
        warn_rank_0(f"{filename}: skipped {len(skipped)} QQP rows, as Megatron-LM does: "
                    f"{shown}{more}")
    log_rank_0(f" >> processed {len(samples)} samples.")
    return samples


def _qqp_label(value: str, filename: str, number: int) -> int:
    try:
        label = int(value.strip())
    except ValueError:
        label = None
    if label not in QQP_LABELS:
        raise ValueError(f"{filename}:{number}: is_duplicate is {value!r}, expected 0 or 1")
    return label


READERS = {"MNLI": (read_mnli, 3), "QQP": (read_qqp, 2)}
"""Task -> (reader of one file, number of classes)."""


def glue_dataset(task: str, dataset_name: str, paths: Sequence[str], tokenizer,
                 max_seq_length: int) -> GLUEDataset:
    """The samples of every file in ``paths`` (Megatron's ``MNLIDataset``/``QQPDataset``)."""
    reader = READERS[task][0]
    samples = []
    for path in paths:
        samples.extend(reader(path))
    return GLUEDataset(task, dataset_name, samples, tokenizer, max_seq_length)


def dataset_name_from_path(task: str, path: str) -> str:
    """Megatron's name of a dev file in the results lines: the path after the task's
    directory, without ``.tsv``, ``/`` and ``_`` as ``-`` (``MNLI/dev_matched.tsv`` ->
    ``dev-matched``); the file name when the path does not name the task."""
    tail = path.split(task)[-1] if task in path else os.path.basename(path)
    if tail.endswith(".tsv"):
        tail = tail[:-len(".tsv")]
    return tail.strip("/").replace("/", "-").replace("_", "-")
