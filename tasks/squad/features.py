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

import numpy as np

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

    Positions ``doc_offset ..`` hold the window's document tokens; for each of them
    ``orig_index`` is its word in the example's ``doc_tokens`` and ``max_context`` whether this
    window gives it the most context among the example's windows. (Google's
    ``token_to_orig_map``/``token_is_max_context`` dicts, kept as arrays: SQuAD's training set
    has ~90k features of 384 tokens.)
    """

    unique_id: int
    example_index: int
    doc_span_index: int
    input_ids: np.ndarray
    """int32 ``[n]``."""
    doc_offset: int
    orig_index: np.ndarray
    """int32 ``[window length]``."""
    max_context: np.ndarray
    """bool ``[window length]``."""
    start_position: int | None = None
    end_position: int | None = None
    is_impossible: bool = False

    @property
    def token_type_ids(self) -> np.ndarray:
        """0 for ``[CLS] query [SEP]``, 1 for the window and its ``[SEP]``."""
        types = np.ones(len(self.input_ids), dtype=np.int8)
        types[:self.doc_offset] = 0
        return types

    def word_index(self, position: int) -> int | None:
        """The word of the document token at ``position`` (None: not a document token)."""
        i = position - self.doc_offset
        return int(self.orig_index[i]) if 0 <= i < len(self.orig_index) else None

    def is_max_context(self, position: int) -> bool:
        i = position - self.doc_offset
        return bool(self.max_context[i]) if 0 <= i < len(self.max_context) else False

    @property
    def token_to_orig_map(self) -> dict[int, int]:
        """Google's dict: feature position -> word index, for the document tokens."""
        return dict(zip(range(self.doc_offset, self.doc_offset + len(self.orig_index)),
                        self.orig_index.tolist()))

    @property
    def token_is_max_context(self) -> dict[int, bool]:
        """Google's dict: feature position -> max-context flag, for the document tokens."""
        return dict(zip(range(self.doc_offset, self.doc_offset + len(self.max_context)),
                        self.max_context.tolist()))


_PARAGRAPHS_PER_CALL = 512


@dataclasses.dataclass
class _TokenizedDoc:
    """A paragraph's sub-tokens and the maps between them and its words (int32 arrays: a
    training set's paragraphs are all held at once)."""

    sub_tokens: np.ndarray
    tok_to_orig_index: np.ndarray
    orig_to_tok_index: np.ndarray


def tokenize_paragraph(paragraph: Paragraph, tokenizer: AbstractTokenizer) -> _TokenizedDoc:
    """WordPiece of every whitespace word of one paragraph."""
    return tokenize_paragraphs([paragraph], tokenizer)[0]


def tokenize_paragraphs(paragraphs: Sequence[Paragraph],
                        tokenizer: AbstractTokenizer) -> list[_TokenizedDoc]:
    """WordPiece of every whitespace word of every paragraph, in batched tokenizer calls of
    many paragraphs (one call per paragraph costs more in call overhead than in tokenizing)."""
    docs = []
    for first in range(0, len(paragraphs), _PARAGRAPHS_PER_CALL):
        chunk = paragraphs[first:first + _PARAGRAPHS_PER_CALL]
        pieces = iter(tokenizer.tokenize_batch([w for p in chunk for w in p.doc_tokens]))
        for paragraph in chunk:
            sub_tokens, tok_to_orig, orig_to_tok = [], [], []
            for i in range(len(paragraph.doc_tokens)):
                word = next(pieces)
                orig_to_tok.append(len(sub_tokens))
                tok_to_orig.extend([i] * len(word))
                sub_tokens.extend(word)
            docs.append(_TokenizedDoc(*(np.asarray(a, dtype=np.int32)
                                        for a in (sub_tokens, tok_to_orig, orig_to_tok))))
    return docs


def improve_answer_span(doc_tokens: Sequence[int], start: int, end: int,
                        answer_tokens: Sequence[int]) -> tuple[int, int]:
    """The sub-span of ``doc_tokens[start:end+1]`` equal to the answer's own sub-tokens.

    Word-level offsets cover whole words: for the answer "1895" in the word "(1895-1943)." the
    span would be all of ``( 1895 - 1943 ) .``; the tightest span whose tokens are the answer's
    tokens is ``1895``. Without one, the word span stays (Google's ``_improve_answer_span``).
    """
    answer = list(answer_tokens)
    doc = doc_tokens[start:end + 1]
    doc = doc.tolist() if isinstance(doc, np.ndarray) else list(doc)
    for new_start in range(len(doc)):
        for new_end in range(len(doc) - 1, new_start - 1, -1):
            if doc[new_start:new_end + 1] == answer:
                return start + new_start, start + new_end
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
    # A paragraph's questions share its tokens: each paragraph once, keyed by identity.
    paragraphs = list({id(e.paragraph): e.paragraph for e in examples}.values())
    docs = dict(zip(map(id, paragraphs), tokenize_paragraphs(paragraphs, tokenizer)))
    features: list[SquadFeature] = []
    for example_index, (example, query) in enumerate(zip(examples, queries)):
        features.extend(_example_features(
            example, example_index, query[:max_query_length], docs[id(example.paragraph)],
            tokenizer, max_seq_length, doc_stride, is_training,
            first_unique_id=1000000000 + len(features)))
    return features


def _answer_tokens(example: SquadExample, doc: _TokenizedDoc,
                   tokenizer: AbstractTokenizer) -> tuple[int, int]:
    """The answer's first and last sub-token in the document."""
    start = int(doc.orig_to_tok_index[example.start_position])
    if example.end_position < len(example.doc_tokens) - 1:
        end = int(doc.orig_to_tok_index[example.end_position + 1]) - 1
    else:
        end = len(doc.sub_tokens) - 1
    return improve_answer_span(doc.sub_tokens, start, end,
                               tokenizer.tokenize(example.orig_answer_text))


def max_context_spans(spans: Sequence[DocSpan], num_tokens: int) -> np.ndarray:
    """For every document token, the index of the span where it has max context
    (:func:`check_is_max_context` for all tokens at once; ties go to the first span)."""
    best_score = np.full(num_tokens, -np.inf)
    best_span = np.full(num_tokens, -1, dtype=np.int64)
    for index, span in enumerate(spans):
        positions = np.arange(span.start, span.start + span.length)
        end = span.start + span.length - 1
        score = np.minimum(positions - span.start, end - positions) + 0.01 * span.length
        better = score > best_score[positions]
        best_score[positions[better]] = score[better]
        best_span[positions[better]] = index
    return best_span


def _example_features(example: SquadExample, example_index: int, query: list[int],
                      doc: _TokenizedDoc, tokenizer: AbstractTokenizer, max_seq_length: int,
                      doc_stride: int, is_training: bool,
                      first_unique_id: int) -> list[SquadFeature]:
    answer = None
    if is_training and not example.is_impossible:
        answer = _answer_tokens(example, doc, tokenizer)
    spans = doc_spans(len(doc.sub_tokens), max_seq_length - len(query) - 3, doc_stride)
    best_span = max_context_spans(spans, len(doc.sub_tokens))
    sub_tokens, tok_to_orig = doc.sub_tokens, doc.tok_to_orig_index
    head = np.asarray([tokenizer.cls, *query, tokenizer.sep], dtype=np.int32)
    doc_offset = len(head)  # [CLS] query [SEP]
    out = []
    for span_index, span in enumerate(spans):
        window = slice(span.start, span.start + span.length)
        input_ids = np.concatenate([head, sub_tokens[window],
                                    np.asarray([tokenizer.sep], dtype=np.int32)])
        feature = SquadFeature(first_unique_id + span_index, example_index, span_index,
                               input_ids, doc_offset, tok_to_orig[window],
                               best_span[window] == span_index,
                               is_impossible=example.is_impossible)
        if is_training:
            feature.start_position, feature.end_position = 0, 0  # [CLS]: no answer here
            if answer is not None and span.start <= answer[0] and \
                    answer[1] <= span.start + span.length - 1:
                feature.start_position = answer[0] - span.start + doc_offset
                feature.end_position = answer[1] - span.start + doc_offset
        out.append(feature)
    return out
