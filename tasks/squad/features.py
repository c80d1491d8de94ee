"""SQuAD examples -> model features (Google's ``convert_examples_to_features``).

Each document word is split into WordPiece sub-tokens (the BERT tokenizer of
:mod:`megatron.tokenizer`); the question is cut to ``max_query_length`` sub-tokens; the
document is covered by spans of at most ``max_seq_length - len(query) - 3`` sub-tokens that
start ``doc_stride`` apart, and each span becomes one feature::

    [CLS] query [SEP] doc-span [SEP]      token types 0 ... 0 1 ... 1

A document token seen by several spans is "max context" in the span where it has the most
context on its shorter side (:func:`check_is_max_context`); only there may an answer start at
prediction time. Training labels are sub-token positions in the feature; 0 (``[CLS]``) for an
impossible question and for a span that does not hold the whole answer. The answer's sub-token
span is first tightened to the tokens of the answer text (:func:`improve_answer_span`: "1895"
inside the word "(1895-1943)." is its own sub-tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron.tokenizer.base import AbstractTokenizer
from tasks.squad.reader import Paragraph, SquadExample


@dataclasses.dataclass(frozen=True)
class DocSpan:
    """A window of the document's sub-tokens: ``start`` and ``length``."""

    start: int
    length: int


@dataclasses.dataclass
class SquadFeature:
    """One ``[CLS] query [SEP] doc-span [SEP]`` sequence (unpadded: ``len(input_ids)`` tokens).

    ``token_to_orig_map`` maps a feature position of a document token to its word index in the
    example's ``doc_tokens``; ``token_is_max_context`` says whether that position is the one
    where the token has the most context among the example's features.
    """

    unique_id: int
    example_index: int
    doc_span_index: int
    input_ids: list[int]
    token_type_ids: list[int]
    token_to_orig_map: dict[int, int]
    token_is_max_context: dict[int, bool]
    start_position: int | None = None
    end_position: int | None = None
    is_impossible: bool = False


@dataclasses.dataclass
class _TokenizedDoc:
    """A paragraph's sub-tokens and the maps between them and its words."""

    sub_tokens: list[int]
    tok_to_orig_index: list[int]
    orig_to_tok_index: list[int]


def tokenize_paragraph(paragraph: Paragraph, tokenizer: AbstractTokenizer) -> _TokenizedDoc:
    """WordPiece of every whitespace word (one batched call per paragraph)."""
    doc = _TokenizedDoc([], [], [])
    for i, pieces in enumerate(tokenizer.tokenize_batch(list(paragraph.doc_tokens))):
        doc.orig_to_tok_index.append(len(doc.sub_tokens))
        doc.tok_to_orig_index.extend([i] * len(pieces))
        doc.sub_tokens.extend(pieces)
    return doc


def improve_answer_span(doc_tokens: Sequence[int], start: int, end: int,
                        answer_tokens: Sequence[int]) -> tuple[int, int]:
    """The sub-span of ``doc_tokens[start:end+1]`` equal to the answer's own sub-tokens.

    Word-level offsets cover whole words: for the answer "1895" in the word "(1895-1943)." the
    span would be all of ``( 1895 - 1943 ) .``; the tightest span whose tokens are the answer's
    tokens is ``1895``. Without one, the word span stays (Google's ``_improve_answer_span``).
    """
    answer = list(answer_tokens)
    for new_start in range(start, end + 1):
        for new_end in range(end, new_start - 1, -1):
            if list(doc_tokens[new_start:new_end + 1]) == answer:
                return new_start, new_end
    return start, end


def doc_spans(num_tokens: int, max_tokens_for_doc: int, doc_stride: int) -> list[DocSpan]:
    """Windows of at most ``max_tokens_for_doc`` tokens, ``doc_stride`` apart, the last one
    ending at the document's end."""
    spans: list[DocSpan] = []
    start = 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens_for_doc)
        spans.append(DocSpan(start, length))
        if start + length == num_tokens:
            break
        start += min(length, doc_stride)
    return spans


def check_is_max_context(spans: Sequence[DocSpan], span_index: int, position: int) -> bool:
    """Whether ``spans[span_index]`` gives the token at ``position`` its most context.

    Score = min(left context, right context) + 0.01 x span length: a token in the middle of a
    span is better predicted than one at its edge (Google's ``_check_is_max_context``).
    """
    best_score, best_index = None, None
    for index, span in enumerate(spans):
        end = span.start + span.length - 1
        if not span.start <= position <= end:
            continue
        score = min(position - span.start, end - position) + 0.01 * span.length
        if best_score is None or score > best_score:
            best_score, best_index = score, index
    return span_index == best_index


def convert_examples_to_features(examples: Sequence[SquadExample], tokenizer: AbstractTokenizer,
                                 max_seq_length: int, doc_stride: int, max_query_length: int,
                                 is_training: bool) -> list[SquadFeature]:
    """Every example's features, numbered from 1000000000 as Google's (``unique_id``).

    Args:
        examples: from :func:`tasks.squad.reader.read_squad_examples` (read with the same
            ``is_training``).
        tokenizer: a BERT WordPiece tokenizer (``cls``, ``sep``, ``tokenize_batch``).
        max_seq_length: tokens per feature (``--seq-length``).
        doc_stride: ``--doc-stride``.
        max_query_length: ``--max-query-length``.
        is_training: compute ``start_position``/``end_position`` labels.

    Raises:
        ValueError: ``max_seq_length`` leaves no room for the document after the query.
    """
    max_tokens_for_doc = max_seq_length - max_query_length - 3
    if max_tokens_for_doc < 1:
        raise ValueError(f"--seq-length {max_seq_length} leaves no document tokens after "
                         f"--max-query-length {max_query_length} and [CLS]/[SEP]/[SEP]: raise "
                         "--seq-length or lower --max-query-length")
    queries = tokenizer.tokenize_batch([e.question_text for e in examples])
    docs: dict[int, _TokenizedDoc] = {}  # by id(paragraph): its questions share it
    features: list[SquadFeature] = []
    for example_index, (example, query) in enumerate(zip(examples, queries)):
        key = id(example.paragraph)
        if key not in docs:
            docs[key] = tokenize_paragraph(example.paragraph, tokenizer)
        features.extend(_example_features(
            example, example_index, query[:max_query_length], docs[key], tokenizer,
            max_seq_length, doc_stride, is_training, first_unique_id=1000000000 + len(features)))
    return features


def _answer_tokens(example: SquadExample, doc: _TokenizedDoc,
                   tokenizer: AbstractTokenizer) -> tuple[int, int]:
    """The answer's first and last sub-token in the document."""
    start = doc.orig_to_tok_index[example.start_position]
    if example.end_position < len(example.doc_tokens) - 1:
        end = doc.orig_to_tok_index[example.end_position + 1] - 1
    else:
        end = len(doc.sub_tokens) - 1
    return improve_answer_span(doc.sub_tokens, start, end,
                               tokenizer.tokenize(example.orig_answer_text))


def _example_features(example: SquadExample, example_index: int, query: list[int],
                      doc: _TokenizedDoc, tokenizer: AbstractTokenizer, max_seq_length: int,
                      doc_stride: int, is_training: bool,
                      first_unique_id: int) -> list[SquadFeature]:
    answer = None
    if is_training and not example.is_impossible:
        answer = _answer_tokens(example, doc, tokenizer)
    spans = doc_spans(len(doc.sub_tokens), max_seq_length - len(query) - 3, doc_stride)
    doc_offset = len(query) + 2  # [CLS] query [SEP]
    out = []
    for span_index, span in enumerate(spans):
        input_ids = [tokenizer.cls, *query, tokenizer.sep]
        token_to_orig_map, token_is_max_context = {}, {}
        for i in range(span.start, span.start + span.length):
            token_to_orig_map[len(input_ids)] = doc.tok_to_orig_index[i]
            token_is_max_context[len(input_ids)] = check_is_max_context(spans, span_index, i)
            input_ids.append(doc.sub_tokens[i])
        input_ids.append(tokenizer.sep)
        token_type_ids = [0] * doc_offset + [1] * (span.length + 1)
        feature = SquadFeature(first_unique_id + span_index, example_index, span_index,
                               input_ids, token_type_ids, token_to_orig_map,
                               token_is_max_context, is_impossible=example.is_impossible)
        if is_training:
            feature.start_position, feature.end_position = 0, 0  # [CLS]: no answer here
            if answer is not None and span.start <= answer[0] and \
                    answer[1] <= span.start + span.length - 1:
                feature.start_position = answer[0] - span.start + doc_offset
                feature.end_position = answer[1] - span.start + doc_offset
        out.append(feature)
    return out
