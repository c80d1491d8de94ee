"""Tokenize a JSON-lines corpus into Megatron ``.bin``/``.idx`` datasets (Megatron-LM's flags).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 2

writes ``out/my-gpt2_text_document.{bin,idx}``, byte-identical to Megatron-LM's output for the
same input and tokenizer (``docs/FORMATS.md`` sections 2a and 2f). Differences from
Megatron-LM, all deliberate:

- ``--split-sentences`` splits and encodes in one run (no intermediate ``_ss`` file), offline
  (see ``megatron/tokenizer/sentences.py``);
- every key of ``--json-keys`` gets a finished ``.bin`` and ``.idx``;
- outputs are written under temporary names and renamed at the end: an error or interrupt
  leaves no partial file under a final name, and the temporary files a killed run could not
  remove (``kill -9``) are removed by the next run on the same ``--output-prefix``;
- a non-JSON line, a line that is not an object, or a missing key stops the run with
  ``file:line``; blank lines are skipped;
- ``--partitions P`` deals documents round-robin (or in blocks of 1,000,000 with
  ``--keep-sequential-samples``) into P datasets and merges them in order, which is Megatron's
  document order, without writing partition copies of the input; ``--input`` globs are sorted;
- memory stays bounded: at most a few batches are in flight, and the index arrays are numpy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import gzip
import json
import multiprocessing
import os
import re
import sys
import threading
import time
import zlib
from typing import IO, Iterator

import numpy as np

# Run from a checkout as `python tools/preprocess_data.py` (Megatron-LM's usage) too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.base import add_section, build_section  # noqa: E402
from megatron.tokenizer.config import TokenizerConfig  # noqa: E402
from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder, data_file_path, index_file_path, optimal_dtype)
from megatron.tokenizer import create_tokenizer  # noqa: E402

# A batch is the unit of work sent to a worker: big enough to amortise pickling and IPC,
# small enough that a few in flight per worker bound the memory.
BATCH_DOCS = 256
BATCH_BYTES = 1 << 20
IN_FLIGHT_PER_WORKER = 4
SEQUENTIAL_BLOCK = 1_000_000  # Megatron's --keep-sequential-samples block of lines


class InputError(ValueError):
    """Bad input data; the message starts with ``file:line``."""


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Megatron-LM's preprocess_data.py flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="JSON-lines file, or a glob of files (.gz allowed)")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each JSON object (default: text)")
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences (one sequence each)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="keep newlines between sentences when splitting")
    add_section(parser, TokenizerConfig, "tokenizer")
    group = parser.add_argument_group("tokenization")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each non-empty document")
    group.add_argument("--lang", default="english",
                       help="language of the Punkt sentence splitter (default: english)")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="output path prefix, without _{key}_{document|sentence}")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                       help="dataset format (only mmap exists)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True,
                       help="tokenizer worker processes (1 = tokenize in this process)")
    group.add_argument("--partitions", type=int, default=1,
                       help="number of datasets to deal documents into, merged at the end")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="with --partitions, deal blocks of 1,000,000 documents, not single ones")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="documents between progress lines (default: 1000)")
    args = parser.parse_args(argv)
    args.tokenizer = build_section(TokenizerConfig, args)
    for flag in ("workers", "partitions", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.tokenizer.tokenizer_type is None:
        parser.error("--tokenizer-type is required")
    if args.keep_newlines and not args.split_sentences:
        parser.error("--keep-newlines only applies with --split-sentences")
    return args


# ----------------------------------------------------------------------------------------------
# Reading: numbered lines of every input file, grouped in batches.

@dataclasses.dataclass
class Batch:
    """Lines of one input file: ``lines[i]`` is line ``linenos[i]`` (1-based) of ``path``."""

    path: str
    linenos: list[int]
    lines: list[bytes]


def input_files(pattern: str) -> list[str]:
    """The files of ``--input`` (a path or a glob), sorted for a deterministic order.

    Raises:
        ValueError: nothing matches, or a match is a directory or unreadable.
    """
    files = [pattern] if os.path.isfile(pattern) else sorted(glob.glob(pattern))
    if not files:
        raise ValueError(f"--input {pattern}: no such file (nor files matching it as a glob)")
    for path in files:
        # A directory matches its own name as a glob; opening it would fail mid-run.
        if os.path.isdir(path):
            raise ValueError(f"--input {pattern}: {path} is a directory; give a JSON-lines file "
                             f"or a glob of files, e.g. {os.path.join(path, '*.jsonl')}")
        if not os.access(path, os.R_OK):
            raise ValueError(f"--input {pattern}: {path} is not readable (permission denied)")
    return files


def _open_input(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_batches(files: list[str]) -> Iterator[Batch]:
    """Batches of non-blank lines, never spanning two files.

    Raises:
        InputError: a ``.gz`` input that is truncated or corrupt (named, with the last line
            read whole).
    """
    for path in files:
        with _open_input(path) as f:
            batch, size = Batch(path, [], []), 0
            lines = _lines_of(f, path)
            for lineno, line in lines:
                if not line.strip():
                    continue
                batch.linenos.append(lineno)
                batch.lines.append(line)
                size += len(line)
                if len(batch.lines) >= BATCH_DOCS or size >= BATCH_BYTES:
                    yield batch
                    batch, size = Batch(path, [], []), 0
            if batch.lines:
                yield batch


def _lines_of(f: IO[bytes], path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)``; gzip's errors on a damaged archive (EOFError, BadGzipFile,
    zlib.error) become an InputError naming the file instead of a bare traceback."""
    lineno = 0
    try:
        for lineno, line in enumerate(f, 1):
            yield lineno, line
    except (EOFError, OSError, zlib.error) as err:
        if not path.endswith(".gz"):
            raise
        raise InputError(f"{path}: corrupt or truncated compressed input after line {lineno} "
                         f"({type(err).__name__}: {err}); re-create or re-download it") from None


# ----------------------------------------------------------------------------------------------
# Encoding (in worker processes): a batch of lines -> token arrays per key.

@dataclasses.dataclass
class EncodedKey:
    """One key's documents of a batch: all tokens, the non-empty sequence lengths, and how many
    sequences each document has (0 for an empty document)."""

    tokens: np.ndarray
    seq_lengths: np.ndarray  # int64 [num sequences]
    seqs_per_doc: np.ndarray  # int64 [num docs]


@dataclasses.dataclass
class EncodedBatch:
    num_bytes: int
    keys: dict[str, EncodedKey]


class Encoder:
    """Per-process tokenizer and splitter; ``encode`` turns a :class:`Batch` into arrays."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dtype: type = np.int32
        self.tokenizer = None
        self.splitter = None

    def initialize(self) -> None:
        """Build the tokenizer (and splitter); forked workers inherit them ready-made."""
        self.tokenizer = create_tokenizer(self.args.tokenizer)
        try:
            self.eod = self.tokenizer.eod if self.args.append_eod else None
        except NotImplementedError as err:
            raise ValueError(f"--append-eod: {err}") from None
        if self.args.split_sentences:
            from megatron.tokenizer.sentences import build_sentence_splitter
            self.splitter = build_sentence_splitter(self.args.lang, self.args.keep_newlines)

    def _sentences(self, value: object, where: str, key: str, may_have_surrogates: bool
                   ) -> list[str]:
        if isinstance(value, list):  # pre-split by the user: one sequence per string
            if not all(isinstance(s, str) for s in value):
                raise InputError(f"{where}: key {key!r} is a list with non-string items")
            if may_have_surrogates:
                for s in value:
                    _check_no_surrogate(s, where, key)
            return value
        if not isinstance(value, str):
            raise InputError(f"{where}: key {key!r} is a {type(value).__name__}, expected a "
                             "string or a list of strings")
        if may_have_surrogates:
            _check_no_surrogate(value, where, key)
        if self.splitter is not None:
            from megatron.tokenizer.sentences import split_sentences
            return split_sentences(self.splitter, value)
        return [value]

    def _parse(self, line: bytes, where: str) -> dict:
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as err:
            # err.colno counts from the last newline, the line's own one included when the
            # line is cut short: report the offset within the line instead.
            text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
            length = len(text.rstrip("\r\n"))  # err.pos counts characters, not bytes
            at = "at the end of the line" if err.pos >= length else f"column {err.pos + 1}"
            raise InputError(f"{where}: not valid JSON ({err.msg}, {at})") from None
        except UnicodeDecodeError as err:
            raise InputError(f"{where}: not valid UTF-8 ({err.reason})") from None
        if not isinstance(doc, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        missing = [k for k in self.args.json_keys if k not in doc]
        if missing:
            raise InputError(f"{where}: missing key(s) {missing} (the line has {sorted(doc)[:10]}; "
                             "see --json-keys)")
        return doc

    def _tokenize(self, text: str, where: str, key: str) -> list[int]:
        try:
            return self.tokenizer.tokenize(text)
        except ValueError as err:  # e.g. NullTokenizer on text that is not ids
            raise InputError(f"{where}: key {key!r} cannot be tokenized: {err}") from None

    def encode(self, batch: Batch) -> EncodedBatch:
        """Raises InputError on a bad line."""
        out = {k: ([], [], []) for k in self.args.json_keys}  # tokens, seq lengths, seqs/doc
        for lineno, line in zip(batch.linenos, batch.lines):
            where = f"{batch.path}:{lineno}"
            doc = self._parse(line, where)
            # A lone surrogate can only come from a "\\udXXX" escape or from UTF-8-encoded
            # surrogate bytes (0xED 0xA0..0xBF, which json.loads lets through): look only then.
            may_have_surrogates = b"\\u" in line or b"\xed" in line
            for key, (tokens, seq_lengths, seqs_per_doc) in out.items():
                lengths = []
                for sentence in self._sentences(doc[key], where, key, may_have_surrogates):
                    ids = self._tokenize(sentence, where, key)
                    if ids:  # Megatron drops empty sentences
                        tokens.extend(ids)
                        lengths.append(len(ids))
                if lengths and self.eod is not None:
                    tokens.append(self.eod)
                    lengths[-1] += 1
                seq_lengths.extend(lengths)
                seqs_per_doc.append(len(lengths))
        keys = {k: EncodedKey(np.array(t, dtype=self.dtype), np.array(s, dtype=np.int64),
                              np.array(d, dtype=np.int64)) for k, (t, s, d) in out.items()}
        return EncodedBatch(sum(len(line) for line in batch.lines), keys)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_no_surrogate(text: str, where: str, key: str) -> None:
    """Raises InputError on a lone surrogate (not Unicode text: no tokenizer can encode it)."""
    match = _SURROGATE.search(text)
    if match is not None:
        raise InputError(f"{where}: key {key!r} holds a lone surrogate U+{ord(match.group()):04X} "
                         f"at character {match.start()} (not valid Unicode: a \\u escape of "
                         "half a surrogate pair?)")


_ENCODER: Encoder | None = None


def _init_worker(encoder: Encoder) -> None:
    global _ENCODER
    _ENCODER = encoder


def _encode_in_worker(batch: Batch) -> EncodedBatch:
    return _ENCODER.encode(batch)


# ----------------------------------------------------------------------------------------------
# Writing: one builder per (partition, key), temp names, rename at the end.

class Outputs:
    """Builders for every partition and key; finished files appear only on :meth:`commit`."""

    def __init__(self, args: argparse.Namespace, dtype: type) -> None:
        level = "sentence" if args.split_sentences else "document"
        self.final = {k: f"{args.output_prefix}_{k}_{level}" for k in args.json_keys}
        tag = f"tmp{os.getpid()}"
        self.part_prefixes = {k: [f"{p}.{tag}-part{i}" for i in range(args.partitions)]
                              for k, p in self.final.items()}
        self.merged = {k: f"{p}.{tag}" for k, p in self.final.items()}
        self.dtype = dtype
        for prefix in self.final.values():
            os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        remove_interrupted_temps(self.final.values())
        self.builders = {k: [IndexedDatasetBuilder(data_file_path(p), dtype) for p in prefixes]
                         for k, prefixes in self.part_prefixes.items()}

    def add(self, key: str, partition: int, tokens: np.ndarray, lengths: np.ndarray) -> None:
        self.builders[key][partition].add_document(tokens, lengths)

    def commit(self) -> list[str]:
        """Finalize, merge partitions, rename to the final names; returns the final prefixes."""
        for key, builders in self.builders.items():
            for builder, prefix in zip(builders, self.part_prefixes[key]):
                builder.finalize(index_file_path(prefix))
            source = self.part_prefixes[key][0]
            if len(builders) > 1:
                merged = IndexedDatasetBuilder(data_file_path(self.merged[key]), self.dtype)
                for prefix in self.part_prefixes[key]:
                    merged.add_index(prefix)
                merged.finalize(index_file_path(self.merged[key]))
                source = self.merged[key]
            os.replace(data_file_path(source), data_file_path(self.final[key]))
            os.replace(index_file_path(source), index_file_path(self.final[key]))
        self.cleanup()
        return list(self.final.values())

    def cleanup(self) -> None:
        """Remove every temporary file (safe to call twice)."""
        temps = [p for prefixes in self.part_prefixes.values() for p in prefixes]
        for prefix in temps + list(self.merged.values()):
            for path in (data_file_path(prefix), index_file_path(prefix)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)


def _temp_name(final_prefix: str) -> re.Pattern:
    """Names :class:`Outputs` gives the temporary files of ``final_prefix`` (the writer's pid
    is group 1)."""
    return re.compile(re.escape(os.path.basename(final_prefix))
                      + r"\.tmp(\d+)(?:-part\d+)?\.(?:bin|idx)")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_interrupted_temps(final_prefixes) -> int:
    """Remove the temporary files a killed run (``kill -9``, the OOM killer: no cleanup ran)
    left beside these outputs; returns how many. Those of a writer still running on this
    machine are left alone (a second run on the same prefix)."""
    removed = 0
    for final in final_prefixes:
        directory = os.path.dirname(os.path.abspath(final))
        name = _temp_name(final)
        for entry in os.listdir(directory):
            found = name.fullmatch(entry)
            if found is None or (int(found.group(1)) != os.getpid()
                                 and _running(int(found.group(1)))):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, entry))
                removed += 1
    if removed:
        print(f"Removed {removed} temporary file(s) of an interrupted run", file=sys.stderr,
              flush=True)
    return removed


# ----------------------------------------------------------------------------------------------
# Driver.

class Progress:
    """Megatron's progress line every ``interval`` documents, and the final summary."""

    def __init__(self, interval: int) -> None:
        self.interval, self.docs, self.bytes = interval, 0, 0
        self.start = time.perf_counter()

    def _rates(self) -> tuple[float, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return self.docs / elapsed, self.bytes / elapsed / 2**20

    def document(self) -> None:
        self.docs += 1
        if self.docs % self.interval == 0:
            docs_s, mb_s = self._rates()
            print(f"Processed {self.docs} documents ({docs_s:.1f} docs/s, {mb_s:.2f} MB/s).",
                  file=sys.stderr, flush=True)

    def summary(self, outputs: list[str]) -> None:
        docs_s, mb_s = self._rates()
        elapsed = time.perf_counter() - self.start
        print(f"Done: {self.docs} documents, {self.bytes / 2**20:.2f} MB in {elapsed:.2f} s "
              f"({docs_s:.1f} docs/s, {mb_s:.2f} MB/s). Wrote {', '.join(outputs)} (.bin/.idx).",
              file=sys.stderr, flush=True)


def _encoded_batches(args: argparse.Namespace, encoder: Encoder,
                     files: list[str]) -> Iterator[EncodedBatch]:
    """Encoded batches in input order, in this process or in a pool of ``--workers``."""
    if args.workers == 1:
        yield from map(encoder.encode, read_batches(files))
        return
    # Pool.imap reads its input eagerly; the semaphore keeps at most a few batches in flight.
    slots = threading.Semaphore(IN_FLIGHT_PER_WORKER * args.workers)

    def throttled() -> Iterator[Batch]:
        for batch in read_batches(files):
            slots.acquire()
            yield batch

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(args.workers, initializer=_init_worker, initargs=(encoder,)) as pool:
        for encoded in pool.imap(_encode_in_worker, throttled(), chunksize=1):
            slots.release()
            yield encoded


def _partition(doc_index: int, args: argparse.Namespace) -> int:
    if args.keep_sequential_samples:
        return (doc_index // SEQUENTIAL_BLOCK) % args.partitions
    return doc_index % args.partitions


def write_batch(encoded: EncodedBatch, outputs: Outputs, progress: Progress,
                args: argparse.Namespace) -> None:
    """Hand each document of a batch to its partition's builders."""
    keys = list(encoded.keys.items())
    num_docs = len(keys[0][1].seqs_per_doc)
    # Document d of a key: sequences seq_start[d]:seq_start[d+1], tokens tok_start[...].
    starts = {}
    for key, enc in keys:
        seq_start = np.concatenate([[0], np.cumsum(enc.seqs_per_doc)])
        tok_start = np.concatenate([[0], np.cumsum(enc.seq_lengths)])
        starts[key] = (seq_start.tolist(), tok_start[seq_start].tolist())
    progress.bytes += encoded.num_bytes  # first, so the progress lines of this batch count it
    for d in range(num_docs):
        partition = _partition(progress.docs, args)
        for key, enc in keys:
            seq_start, tok_start = starts[key]
            outputs.add(key, partition, enc.tokens[tok_start[d]:tok_start[d + 1]],
                        enc.seq_lengths[seq_start[d]:seq_start[d + 1]])
        progress.document()


def preprocess(args: argparse.Namespace) -> list[str]:
    """Run the whole conversion; returns the output prefixes.

    Raises:
        InputError: a bad input line (no output file is left behind).
        ValueError: bad flags or files.
    """
    startup = time.perf_counter()
    files = input_files(args.input)
    print(f"Opening {args.input} ({len(files)} file(s))", flush=True)
    # Built once here: it fails on bad tokenizer files before any output exists, and the
    # forked workers inherit it instead of each loading the files again.
    encoder = Encoder(args)
    encoder.initialize()
    tokenizer = encoder.tokenizer
    encoder.dtype = dtype = optimal_dtype(tokenizer.vocab_size)
    if "Bert" in args.tokenizer.tokenizer_type and not args.split_sentences:
        print("Are you sure you don't want to split sentences? (BERT expects sentence-level data)",
              file=sys.stderr)
    outputs = Outputs(args, dtype)
    try:
        print(f"Time to startup: {time.perf_counter() - startup:.2f} s", flush=True)
        progress = Progress(args.log_interval)
        for encoded in _encoded_batches(args, encoder, files):
            write_batch(encoded, outputs, progress, args)
        prefixes = outputs.commit()
    except BaseException:
        outputs.cleanup()
        raise
    progress.summary(prefixes)
    return prefixes


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)
    try:
        preprocess(args)
    except ValueError as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
