"""The zero-shot evaluation data, read as a stream: memory stays bounded by the chunk size
however large the file (users run the 500 MB WikiText-103 train split as well as the test file).

* WikiText-103 / PTB (Megatron-LM's ``_LMDataset``): the raw word-level file; T_o = the number
  of space-separated words of the stripped raw text; the text detokenized and tokenized as one
  (T tokens), cut into windows of ``seq_length + 1`` tokens starting every ``overlapping_eval``
  tokens, padded with EOD; every window after the first scores only its last
  ``overlapping_eval`` targets, so each of the T - 1 targets is scored exactly once.
* LAMBADA (``_LambadaDataset``): jsonl lines ``{"text": ...}``; one padded sequence per line,
  its target the last BPE token, or with ``--strict-lambada`` the last whole word (every one of
  its tokens must be predicted).

Pieces are tokenized separately once the text outgrows ``chunk_chars`` (default 4 M
characters, so WikiText-103's 1.3 MB test file is tokenized whole, as Megatron-LM does). They
are cut after a newline that ends a line and before one that starts a paragraph (``x\\n|\\nY``
or ``x\\n|Y``), where GPT-2's pre-tokenizer splits anyway: for ``GPT2BPETokenizer`` the ids are
those of the whole text. Tokenizers that treat the start of a text specially (SentencePiece's
leading ``▁``) differ by a token per piece on files above ``chunk_chars``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from tasks.zeroshot_gpt.detokenizer import ChunkDetokenizer, count_pair_closings

DEFAULT_CHUNK_CHARS = 4 * 2**20
# The end of a chunk of raw text: between two ASCII letters (no detokenizer rule spans it).
_LETTER_PAIR = re.compile(r"[A-Za-z](?=[A-Za-z])")
# Where detokenized text may be cut before tokenizing (see the module docstring).
_TOKENIZE_CUT = re.compile(r"\S\n(?=\S|\n\S)")


def check_data_file(path: str, flag: str = "--valid-data") -> None:
    """Raises ValueError naming ``flag`` and ``path`` if it is missing, not a file or empty."""
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: not a file")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{flag} {path}: the file is empty")


def read_text_chunks(path: str, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Iterator[str]:
    """The file's text (UTF-8, line ends kept as they are) in chunks of about ``chunk_chars``,
    each but the last ending between two ASCII letters.

    Raises:
        ValueError: the file is not UTF-8, naming it.
    """
    carry = ""
    try:
        with open(path, encoding="utf-8", newline="") as reader:
            while block := reader.read(chunk_chars):
                text = carry + block
                cut = _last_cut(text, _LETTER_PAIR)
                if cut is None:
                    carry = text
                    continue
                carry = text[cut:]
                yield text[:cut]
    except UnicodeDecodeError as err:
        raise ValueError(f"--valid-data {path}: not UTF-8 text ({err})") from None
    if carry:
        yield carry


def _last_cut(text: str, pattern: re.Pattern, start: int = 0) -> int | None:
    """The position just after the last match of ``pattern`` at or after ``start``."""
    cut = None
    # Only the tail is searched first: one match near the end is all that is needed.
    for begin in (max(start, len(text) - 65536), start):
        for match in pattern.finditer(text, begin):
            cut = match.end()
        if cut is not None:
            return cut
    return None


@dataclasses.dataclass
class WikitextScan:
    """The first pass over a word-level file: Megatron's T_o and what detokenizing needs."""

    num_original_tokens: int
    pair_closings: list[int]


def scan_word_level_file(path: str, detokenizer: str,
                         chunk_chars: int = DEFAULT_CHUNK_CHARS) -> WikitextScan:
    """Count T_o = ``len(text.strip().split(" "))`` of the raw file, streaming.

    Raises:
        ValueError: the file is missing, empty or holds only whitespace.
    """
    check_data_file(path)
    spaces, leading_spaces, trailing_spaces, seen_text = 0, 0, 0, False

    def counted(chunks):
        nonlocal spaces, leading_spaces, trailing_spaces, seen_text
        for chunk in chunks:
            spaces += chunk.count(" ")
            stripped = chunk.rstrip()
            if not seen_text:
                head = chunk.lstrip()
                leading_spaces += chunk[:len(chunk) - len(head)].count(" ")
                seen_text = bool(head)
            trailing_spaces = chunk[len(stripped):].count(" ") + \
                (trailing_spaces if not stripped else 0)
            yield chunk

    chunks = counted(read_text_chunks(path, chunk_chars))
    closings: list[int] = []
    if detokenizer == "wiki":
        closings = count_pair_closings(chunks)
    else:
        for _ in chunks:  # the other detokenizers pair nothing: only count
            pass
    if not seen_text:
        raise ValueError(f"--valid-data {path}: the file holds only whitespace")
    return WikitextScan(spaces - leading_spaces - trailing_spaces + 1, closings)


def detokenized_tokens(path: str, detokenizer: str, scan: WikitextScan,
                       tokenize: Callable[[str], list[int]],
                       chunk_chars: int = DEFAULT_CHUNK_CHARS,
                       observe: Callable[[Iterator[str]], Iterator[str]] | None = None,
                       ) -> Iterator[list[int]]:
    """The token ids of the detokenized file, in pieces (their concatenation is the whole
    text's tokenization for GPT-2 BPE; see the module docstring). ``observe`` wraps the raw
    chunks (progress counting)."""
    detok = ChunkDetokenizer(detokenizer, scan.pair_closings or None)
    pending = ""
    chunks = read_text_chunks(path, chunk_chars)
    for chunk in observe(chunks) if observe is not None else chunks:
        pending += detok(chunk)
        if len(pending) < chunk_chars:
            continue
        cut = _last_cut(pending, _TOKENIZE_CUT)
        if cut is not None:
            yield tokenize(pending[:cut])
            pending = pending[cut:]
    if pending:
        yield tokenize(pending)


@dataclasses.dataclass
class Sample:
    """One sequence of ``seq_length + 1`` tokens and the mask of its scored targets."""

    tokens: np.ndarray  # [s + 1] int64
    mask: np.ndarray    # [s] int64: 1 = this target is scored


def lm_windows(pieces: Iterable[list[int]], seq_length: int, stride: int, pad: int,
               totals: dict) -> Iterator[Sample]:
    """Megatron-LM's overlapping windows over a token stream.

    Window ``i`` holds tokens ``[i * stride, i * stride + seq_length]``; after the first, only
    its last ``stride`` targets are scored. There are ``max(ceil((T - 1 - stride) / stride) + 1,
    1)`` windows. ``totals["num_tokenized_tokens"]`` is set to T once the stream ends.
    """
    buffer = np.zeros(0, dtype=np.int64)
    start, seen, index = 0, 0, 0   # absolute position of buffer[0]; tokens read; next window
    for piece in pieces:
        buffer = np.concatenate([buffer, np.asarray(piece, dtype=np.int64)])
        seen += len(piece)
        while index * stride + seq_length + 1 <= seen:
            yield _window(buffer, index * stride - start, index, seq_length, stride, pad)
            index += 1
        drop = index * stride - start
        buffer, start = buffer[drop:], start + drop
    totals["num_tokenized_tokens"] = seen
    num_windows = max(math.ceil(max(seen - 1 - stride, 0) / stride) + 1, 1)
    for index in range(index, num_windows):
        yield _window(buffer, index * stride - start, index, seq_length, stride, pad)


def _window(buffer: np.ndarray, offset: int, index: int, seq_length: int, stride: int,
            pad: int) -> Sample:
    tokens = buffer[offset:offset + seq_length + 1]
    mask = np.ones(seq_length + 1, dtype=np.int64)
    mask[len(tokens):] = 0
    tokens = np.concatenate([tokens, np.full(seq_length + 1 - len(tokens), pad, np.int64)])
    mask = mask[1:]
    if index > 0:
        mask[:seq_length - stride] = 0   # targets an earlier window already scored
    return Sample(tokens, mask)


# LAMBADA ------------------------------------------------------------------------------------
def read_lambada_texts(path: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each non-blank jsonl line.

    Raises:
        ValueError: naming the file and line: not JSON, not an object, or no string "text".
    """
    check_data_file(path)
    with open(path, "rb") as reader:
        for number, raw in enumerate(reader, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"--valid-data {path}, line {number}: not UTF-8 ({err})") \
                    from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"--valid-data {path}, line {number}: not JSON ({err})") \
                    from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"--valid-data {path}, line {number}: no \"text\" string (each "
                                 "line must be a JSON object like {\"text\": \"...\"})")
            yield number, record["text"]


def lambada_context_and_target(text: str, tokenize: Callable[[str], list[int]],
                               strict: bool) -> tuple[list[int], list[int]]:
    """Megatron-LM's split: non-strict, the last BPE token of the tokenized text is the target;
    strict, the last whitespace-separated word (tokenized as ``" " + word``), the context
    being the text before that word's last occurrence, stripped."""
    if not strict:
        tokens = tokenize(text)
        return tokens[:-1], tokens[-1:]
    words = text.split()
    word = words[-1] if words else ""
    context = text[:text.rfind(word)].strip()
    return tokenize(context), tokenize(" " + word)


def lambada_samples(path: str, tokenize: Callable[[str], list[int]], strict: bool,
                    seq_length: int, pad: int) -> Iterator[Sample]:
    """One padded sample per line; the mask marks the target tokens.

    Raises:
        ValueError: naming the file and line: a bad line (see :func:`read_lambada_texts`), no
            context or no target, or more than ``seq_length + 1`` tokens.
    """
    for number, text in read_lambada_texts(path):
        context, target = lambada_context_and_target(text, tokenize, strict)
        where = f"--valid-data {path}, line {number}"
        if not context or not target:
            raise ValueError(f"{where}: the text needs at least one token of context before "
                             "its last word")
        tokens = context + target
        if len(tokens) > seq_length + 1:
            raise ValueError(f"{where}: {len(tokens)} tokens, more than --seq-length "
                             f"({seq_length}) + 1: evaluate with a longer --seq-length")
        mask = np.zeros(seq_length + 1, dtype=np.int64)
        mask[len(context):len(tokens)] = 1
        padded = np.full(seq_length + 1, pad, dtype=np.int64)
        padded[:len(tokens)] = tokens
        yield Sample(padded, mask[1:])


# Batching -----------------------------------------------------------------------------------
def micro_batches(samples: Iterable[Sample], micro_batch_size: int, seq_length: int,
                  pad: int) -> Iterator[dict[str, np.ndarray]]:
    """Stack samples into ``{"tokens": [b, s + 1], "mask": [b, s]}``; the last batch is filled
    with padding rows that score nothing (every batch has the same shape, as pipeline stages
    exchange fixed-size activations)."""
    rows: list[Sample] = []
    for sample in samples:
        rows.append(sample)
        if len(rows) == micro_batch_size:
            yield _stack(rows)
            rows = []
    if rows:
        filler = Sample(np.full(seq_length + 1, pad, np.int64), np.zeros(seq_length, np.int64))
        yield _stack(rows + [filler] * (micro_batch_size - len(rows)))


def _stack(rows: list[Sample]) -> dict[str, np.ndarray]:
    return {"tokens": np.stack([r.tokens for r in rows]), "mask": np.stack([r.mask for r in rows])}


def shard_steps(batches: Iterable[dict], per_step: int, dp_rank: int, dp_size: int,
                filler: dict) -> Iterator[list[dict]]:
    """Group micro-batches into steps of ``per_step * dp_size``; yield this data-parallel rank's
    ``per_step`` of each (micro-batch ``k`` of a step goes to rank ``k % dp_size``). The last step
    is completed with ``filler`` batches, so every rank runs the same number of steps."""
    step: list[dict] = []
    for batch in batches:
        step.append(batch)
        if len(step) == per_step * dp_size:
            yield step[dp_rank::dp_size]
            step = []
    if step:
        step += [filler] * (per_step * dp_size - len(step))
        yield step[dp_rank::dp_size]
