"""Sample building shared by the finetuning tasks (Megatron-LM's ``tasks/data_utils.py``):
text clean-up, ``[CLS] a [SEP] b [SEP]`` token/type/padding rows, and the sample dict.

A sample is ``{"text": int64 [s], "types": int64 [s], "padding_mask": int64 [s] (1 = real
token), "label": int, "uid": int}`` (RACE: ``[choices, s]`` rows); torch's default collation
turns a list of them into the batch :data:`tasks.forward_step.cross_entropy_forward_step`
reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np


def _not_utf8(filename: str, number: int, err: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{filename}:{number}: not UTF-8 text (byte {err.object[err.start]:#04x} "
                      f"at byte {err.start + 1} of the line: {err.reason}); task files are "
                      "read as UTF-8: re-encode it (iconv -f latin1 -t utf-8, say)")


def utf8_lines(filename: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file, line ends kept.

    Raises:
        ValueError: a line that is not UTF-8, naming the file, the line and the byte (a text
            mode ``open`` names only an offset into its internal buffer).
    """
    with open(filename, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(filename, number, err) from None


def read_utf8_text(filename: str) -> str:
    """A whole UTF-8 text file (a JSON document, say).

    Raises:
        ValueError: the file is not UTF-8, naming the file and the line of the first bad byte.
    """
    with open(filename, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        number = data.count(b"\n", 0, err.start) + 1
        raise _not_utf8(filename, number, UnicodeDecodeError(
            "utf-8", data[line_start:err.end], err.start - line_start, err.end - line_start,
            err.reason)) from None


def clean_text(text: str) -> str:
    """Megatron's ``clean_text``: newlines to spaces, whitespace runs to one space, and
    ``" . "`` to ``". "`` (three passes, so runs of periods shrink too)."""
    text = text.replace("\n", " ")
    text = re.sub(r"\s+", " ", text)
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def build_tokens_types_paddings_from_ids(text_a_ids: list[int], text_b_ids: list[int] | None,
                                         max_seq_length: int, cls_id: int, sep_id: int,
                                         pad_id: int) -> tuple[list[int], list[int], list[int]]:
    """``[CLS] a [SEP] b`` cut to ``max_seq_length - 1``, then a final ``[SEP]`` (when ``b``
    exists or the row was cut), padded to ``max_seq_length`` (Megatron's function: types are 0
    for ``[CLS] a [SEP]``, 1 for ``b`` and its ``[SEP]``, and ``pad_id`` on padding).

    Returns:
        ``(ids, types, paddings)``, each ``max_seq_length`` long.
    """
    ids = [cls_id, *text_a_ids, sep_id]
    types = [0] * len(ids)
    if text_b_ids is not None:
        ids += text_b_ids
        types += [1] * len(text_b_ids)
    paddings = [1] * len(ids)
    trimmed = len(ids) >= max_seq_length
    if trimmed:
        ids, types, paddings = (ids[:max_seq_length - 1], types[:max_seq_length - 1],
                                paddings[:max_seq_length - 1])
    if text_b_ids is not None or trimmed:
        ids.append(sep_id)
        types.append(0 if text_b_ids is None else 1)
        paddings.append(1)
    padding = max_seq_length - len(ids)
    ids += [pad_id] * padding
    types += [pad_id] * padding
    paddings += [0] * padding
    return ids, types, paddings


def build_tokens_types_paddings_from_text(text_a: str, text_b: str | None, tokenizer,
                                          max_seq_length: int):
    """Tokenize ``text_a`` (and ``text_b``), then
    :func:`build_tokens_types_paddings_from_ids` with the tokenizer's special ids."""
    a_ids = tokenizer.tokenize(text_a)
    b_ids = tokenizer.tokenize(text_b) if text_b is not None else None
    return build_tokens_types_paddings_from_ids(a_ids, b_ids, max_seq_length, tokenizer.cls,
                                                tokenizer.sep, tokenizer.pad)


def build_sample(ids, types, paddings, label: int, unique_id: int) -> dict:
    """Megatron's sample dict, as int64 arrays."""
    return {"text": np.array(ids, dtype=np.int64), "types": np.array(types, dtype=np.int64),
            "padding_mask": np.array(paddings, dtype=np.int64), "label": int(label),
            "uid": int(unique_id)}
