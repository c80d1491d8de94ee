"""The SQuAD JSON files -> :class:`SquadExample` (Google's ``read_squad_examples``).

The format (1.1 and 2.0)::

    {"version": "v2.0", "data": [{"title": ..., "paragraphs": [{"context": "...",
        "qas": [{"id": "...", "question": "...", "is_impossible": false,
                 "answers": [{"text": "...", "answer_start": 12}, ...]}]}]}]}

The context is split into words on whitespace only (space, tab, CR, LF and U+202F, as
``run_squad.py``), keeping for every character the index of its word, so that an answer's
character offsets become word positions. Every answer must be the context's text at
``answer_start``; a file where it is not is refused, naming the file, the qid and the JSON path
(the answer offsets are the training labels: a wrong one would silently teach the wrong span).
Where Google's recipe skips (a training answer whose whitespace-normalised text is not in the
words it covers: a non-breaking space inside the answer, for instance), the example is skipped,
logged and counted in :attr:`SquadFile.skipped`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from megatron.core.log import get_logger
from tasks.data_utils import read_utf8_text

VERSIONS = ("1.1", "2.0")
_logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Paragraph:
    """A context split into whitespace words, shared by its questions."""

    context: str
    doc_tokens: tuple[str, ...]
    """The whitespace-separated words of the context."""
    char_to_word_offset: tuple[int, ...]
    """For each character of the context, the index of its word (whitespace: the word before)."""


@dataclasses.dataclass(frozen=True)
class SquadExample:
    """One question on one paragraph.

    ``start_position``/``end_position`` are word indices of the (first) answer in
    ``paragraph.doc_tokens`` when the example was read for training; -1 for an impossible
    question, None when read for evaluation.
    """

    qas_id: str
    question_text: str
    paragraph: Paragraph
    answers: tuple[str, ...]
    """Every gold answer text (for the metric; empty for an impossible question)."""
    is_impossible: bool = False
    orig_answer_text: str | None = None
    start_position: int | None = None
    end_position: int | None = None

    @property
    def doc_tokens(self) -> tuple[str, ...]:
        return self.paragraph.doc_tokens


@dataclasses.dataclass
class SquadFile:
    """What :func:`read_squad_examples` read: the examples, the qids it skipped, and the raw
    ``data`` list (the official scripts' ``dataset``: the metric reads its gold answers)."""

    path: str
    examples: list[SquadExample]
    skipped: list[str]
    dataset: list


def is_whitespace(char: str) -> bool:
    """``run_squad.py``'s word separators (not Python's ``str.isspace``: a no-break space
    U+00A0 stays inside a word)."""
    return char in " \t\r\n" or ord(char) == 0x202F


def split_paragraph(context: str) -> Paragraph:
    """Whitespace words of ``context`` and each character's word index."""
    doc_tokens: list[str] = []
    char_to_word_offset: list[int] = []
    prev_is_whitespace = True
    for char in context:
        if is_whitespace(char):
            prev_is_whitespace = True
        else:
            if prev_is_whitespace:
                doc_tokens.append(char)
            else:
                doc_tokens[-1] += char
            prev_is_whitespace = False
        # Leading whitespace maps to -1, like run_squad.py; answers never start there.
        char_to_word_offset.append(len(doc_tokens) - 1)
    return Paragraph(context, tuple(doc_tokens), tuple(char_to_word_offset))


def read_squad_examples(path: str | os.PathLike, version: str, is_training: bool) -> SquadFile:
    """Read a SQuAD JSON file.

    Args:
        path: the file (``train-v1.1.json``, ``dev-v2.0.json``...).
        version: "1.1" or "2.0" (2.0 reads ``is_impossible``).
        is_training: keep the first answer's word span as the label (and skip, counting them,
            the answers ``run_squad.py`` skips); otherwise keep only the gold texts.

    Returns:
        The examples, the skipped qids and the raw ``data`` list.

    Raises:
        ValueError: an unreadable or malformed file: not JSON, a missing key (named with its
            JSON path and qid), an answer that is not the context's text at its
            ``answer_start``, an impossible question in a 1.1 run, a training question without
            an answer.
    """
    if version not in VERSIONS:
        raise ValueError(f"--squad-version {version!r}: choose one of {', '.join(VERSIONS)}")
    path = os.fspath(path)
    data = _load_json(path)
    examples: list[SquadExample] = []
    skipped: list[str] = []
    for a, article in enumerate(data):
        for p, para in enumerate(_field(article, "paragraphs", list, path, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            paragraph = split_paragraph(_field(para, "context", str, path, where))
            if not paragraph.doc_tokens:
                raise ValueError(f"{path}: {where}.context is empty: a question needs a "
                                 "paragraph to answer from")
            for q, qa in enumerate(_field(para, "qas", list, path, where)):
                example = _read_question(qa, paragraph, version, is_training, path,
                                         f"{where}.qas[{q}]")
                if example is None:
                    skipped.append(qa["id"])
                else:
                    examples.append(example)
    if skipped:
        _logger.warning("%s: skipped %d training question(s) whose answer is not in the "
                        "document words (as run_squad.py does): %s", path, len(skipped),
                        ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
    return SquadFile(path, examples, skipped, data)


def _load_json(path: str) -> list:
    try:
        content = json.loads(read_utf8_text(path))
    except OSError as err:
        raise ValueError(f"cannot read SQuAD file {path}: {err.strerror or err}") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not a SQuAD JSON file: {err}") from err
    if not isinstance(content, dict):
        raise ValueError(f"{path}: a SQuAD file is a JSON object with a \"data\" list, "
                         f"found a {type(content).__name__}")
    return _field(content, "data", list, path, "")


def _field(obj, key: str, kind: type, path: str, where: str, qid: str | None = None):
    """``obj[key]``, checked to be a ``kind``; errors name the file, the JSON path and qid."""
    at = f"{where}.{key}" if where else key
    of_qid = f" (question id {qid!r})" if qid is not None else ""
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: {where or 'top level'}{of_qid} should be a JSON object, "
                         f"found {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{path}: missing key {at!r}{of_qid}: not the SQuAD format "
                         "(data[].paragraphs[].context / qas[].id, question, answers[].text, "
                         "answer_start)")
    value = obj[key]
    # bool is an int in Python: refuse true/false where a number is expected.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{path}: {at}{of_qid} should be a {kind.__name__}, found "
                         f"{type(value).__name__} {value!r:.40}")
    return value


def _read_question(qa, paragraph: Paragraph, version: str, is_training: bool, path: str,
                   where: str) -> SquadExample | None:
    qid = _field(qa, "id", str, path, where)
    question = _field(qa, "question", str, path, where, qid)
    answers = _field(qa, "answers", list, path, where, qid)
    is_impossible = qa.get("is_impossible", False)
    if not isinstance(is_impossible, bool):
        raise ValueError(f"{path}: {where}.is_impossible (question id {qid!r}) should be true "
                         f"or false, found {is_impossible!r:.40}")
    if is_impossible and version == "1.1":
        raise ValueError(f"{path}: question id {qid!r} is_impossible: that is a SQuAD 2.0 "
                         "file; pass --squad-version 2.0")
    spans = [_answer_span(ans, paragraph, path, f"{where}.answers[{i}]", qid)
             for i, ans in enumerate(answers)]
    texts = tuple(text for text, _, _ in spans)
    if is_impossible:
        texts = ()  # 2.0 scores an impossible question against "" whatever "answers" holds
    if not is_training:
        return SquadExample(qid, question, paragraph, texts, is_impossible)
    if is_impossible:
        return SquadExample(qid, question, paragraph, (), True, "", -1, -1)
    if not spans:
        raise ValueError(f"{path}: {where} (question id {qid!r}) has no answer: a training "
                         "question needs one (or \"is_impossible\": true with "
                         "--squad-version 2.0)")
    # Like HF's squad processor, train on the first answer (SQuAD's training files have one).
    text, start, end = spans[0]
    covered = " ".join(paragraph.doc_tokens[start:end + 1])
    if covered.find(" ".join(text.split())) == -1:
        _logger.warning("%s: question id %r: could not find answer %r in %r", path, qid, text,
                        covered)
        return None
    return SquadExample(qid, question, paragraph, texts, False, text, start, end)


def _answer_span(answer, paragraph: Paragraph, path: str, where: str,
                 qid: str) -> tuple[str, int, int]:
    """An answer's text and its first/last word index, after checking it against the context."""
    text = _field(answer, "text", str, path, where, qid)
    start = _field(answer, "answer_start", int, path, where, qid)
    found = paragraph.context[start:start + len(text)] if start >= 0 else None
    if found != text or not text.strip():
        what = ("an empty answer text" if not text.strip() else
                f"the context holds {found!r} there" if found is not None else
                "a negative offset")
        raise ValueError(f"{path}: {where} (question id {qid!r}): answer {text!r} does not "
                         f"match the context at answer_start {start} ({what}); fix the "
                         "offset (character index of the answer in the context) or the text")
    first = paragraph.char_to_word_offset[start]
    last = paragraph.char_to_word_offset[start + len(text) - 1]
    return text, max(first, 0), last
