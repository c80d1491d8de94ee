"""Megatron's mmap indexed dataset (``MMIDIDX``): a ``.bin`` of raw tokens plus an ``.idx`` index.

Format (``docs/FORMATS.md`` section 2a), all little-endian, C order, no padding::

    .idx: magic b"MMIDIDX\\x00\\x00" | uint64 version=1 | uint8 dtype code | uint64 S | uint64 D
          | int32 lengths[S] | int64 byte pointers[S] | int64 document_indices[D] (| int8 modes[S])
    .bin: the tokens of every sequence, concatenated, in the dtype of the code.

Files written here are byte-identical to Megatron-LM's for the same sequences; files written by
Megatron-LM (any version since 2020) read here.
"""

from __future__ import annotations

import enum
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Iterable

import numpy as np

_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
_HEADER_SIZE = len(_INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
# Pointers are written in chunks of this many sequences so that finalize() never materialises
# an int64 array as long as the corpus.
_POINTER_CHUNK = 1 << 22


class DType(enum.IntEnum):
    """Token dtype codes stored in byte 17 of the ``.idx`` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype: Any) -> int:
        """The code of a numpy dtype (``np.uint16`` -> 8).

        Raises:
            ValueError: the dtype has no code in the format.
        """
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            raise ValueError(f"dtype {name} cannot be stored in an MMIDIDX dataset; "
                             f"use one of {list(cls.__members__)}")
        return int(cls[name])

    @classmethod
    def dtype_from_code(cls, code: int) -> type:
        """The numpy dtype class of a code (8 -> ``np.uint16``).

        Raises:
            ValueError: unknown code.
        """
        try:
            return getattr(np, cls(code).name)
        except ValueError:
            raise ValueError(f"unknown MMIDIDX dtype code {code}; known codes: "
                             f"{[int(c) for c in cls]}") from None

    @staticmethod
    def size(key: Any) -> int:
        """Bytes per item of a code or a numpy dtype."""
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            return np.dtype(DType.dtype_from_code(int(key))).itemsize
        return np.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: int | None) -> type:
        """The narrowest token dtype Megatron uses for a vocabulary size."""
        return optimal_dtype(cardinality)


def optimal_dtype(vocab_size: int | None) -> type:
    """Megatron's token dtype: ``np.uint16`` if ``vocab_size < 65500`` else ``np.int32``."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str | os.PathLike) -> str:
    """``{prefix}.bin``."""
    return str(prefix) + ".bin"


def index_file_path(prefix: str | os.PathLike) -> str:
    """``{prefix}.idx``."""
    return str(prefix) + ".idx"


class _GrowableArray:
    """An append-only numpy array with amortised doubling (no per-item Python objects)."""

    def __init__(self, dtype: Any, capacity: int = 1024) -> None:
        self._data = np.empty(capacity, dtype=dtype)
        self._size = 0

    def _reserve(self, extra: int) -> None:
        need = self._size + extra
        if need > len(self._data):
            grown = np.empty(max(need, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown

    def append(self, value: int) -> None:
        self._reserve(1)
        self._data[self._size] = value
        self._size += 1

    def extend(self, values: Iterable[int] | np.ndarray) -> None:
        values = np.asarray(values, dtype=self._data.dtype).reshape(-1)
        self._reserve(len(values))
        self._data[self._size : self._size + len(values)] = values
        self._size += len(values)

    def view(self) -> np.ndarray:
        """The filled part (a view: do not keep it across appends)."""
        return self._data[: self._size]

    def __len__(self) -> int:
        return self._size


def _as_numpy(seq: Any, dtype: Any) -> np.ndarray:
    if hasattr(seq, "detach"):  # a torch tensor (torch is not imported: preprocessing is
        seq = seq.detach().cpu().numpy()  # faster to start without it)
    return np.asarray(seq, dtype=dtype).reshape(-1)


class IndexedDatasetBuilder:
    """Streams sequences into ``bin_path`` and writes the ``.idx`` at :meth:`finalize`.

    Memory is O(number of sequences) in compact numpy arrays (4 bytes per sequence, 8 per
    document), never the tokens.

    Args:
        bin_path: the ``.bin`` file to write.
        dtype: token dtype (see :func:`optimal_dtype`).
        multimodal: also record one int8 mode per sequence (core >= 2024 extension).
    """

    def __init__(self, bin_path: str | os.PathLike, dtype: Any = np.int32,
                 multimodal: bool = False) -> None:
        self.dtype = np.dtype(dtype).type
        DType.code_from_dtype(self.dtype)  # fail early on a dtype the format cannot store
        self.bin_path = str(bin_path)
        self._file = open(self.bin_path, "wb")  # noqa: SIM115 - closed in finalize()
        self.multimodal = multimodal
        self._lengths = _GrowableArray(np.int32)
        self._doc_idx = _GrowableArray(np.int64)
        self._doc_idx.append(0)
        self._modes = _GrowableArray(np.int8) if multimodal else None

    def add_item(self, seq: Any, mode: int = 0) -> None:
        """Append one sequence (np.ndarray, torch tensor or list of ids)."""
        array = _as_numpy(seq, self.dtype)
        self._file.write(array.tobytes(order="C"))
        self._lengths.append(array.size)
        if self._modes is not None:
            self._modes.append(mode)

    def add_document(self, tokens: Any, lengths: Iterable[int] | np.ndarray,
                     modes: Iterable[int] | None = None) -> None:
        """Append a document made of ``len(lengths)`` sequences whose tokens are concatenated.

        Raises:
            ValueError: ``sum(lengths)`` differs from the number of tokens.
        """
        array = _as_numpy(tokens, self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != array.size:
            raise ValueError(f"{self.bin_path}: add_document got {array.size} tokens but "
                             f"lengths summing to {int(lengths.sum())}")
        self._file.write(array.tobytes(order="C"))
        self._lengths.extend(lengths)
        if self._modes is not None:
            self._modes.extend(np.zeros(len(lengths)) if modes is None else modes)
        self._doc_idx.append(len(self._lengths))

    def end_document(self) -> None:
        """Mark a document boundary after the sequences added so far."""
        self._doc_idx.append(len(self._lengths))

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append a whole finished dataset ``prefix`` (its ``.bin`` is copied, not loaded).

        Raises:
            ValueError: the other dataset has another dtype or multimodal setting, or its
                files are inconsistent (see :meth:`_IndexReader.check_against_bin`).
        """
        index = _IndexReader(index_file_path(prefix), self.multimodal)
        # A corrupt or mismatched component must not be copied into the merged dataset.
        index.check_against_bin(data_file_path(prefix), os.path.getsize(data_file_path(prefix)))
        if index.dtype != self.dtype:
            raise ValueError(f"{index_file_path(prefix)}: dtype {np.dtype(index.dtype).name} "
                             f"differs from the builder's {np.dtype(self.dtype).name}")
        offset = len(self._lengths)
        self._lengths.extend(index.sequence_lengths)
        # The other index starts with 0, which equals our current last boundary + offset.
        self._doc_idx.extend(offset + index.document_indices[1:])
        if self._modes is not None:
            self._modes.extend(index.sequence_modes)
        with open(data_file_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._file, length=16 << 20)
        del index

    def finalize(self, idx_path: str | os.PathLike) -> None:
        """Close the ``.bin`` and write the ``.idx`` (atomically: temp file, then rename)."""
        self._file.close()
        tmp = f"{idx_path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            _write_index(f, self.dtype, self._lengths.view(), self._doc_idx.view(),
                         None if self._modes is None else self._modes.view())
        os.replace(tmp, idx_path)

    # Old names (Megatron-LM <= 23.06).
    add_doc = add_document

    def merge_file_(self, prefix: str | os.PathLike) -> None:
        """Old name of :meth:`add_index`."""
        self.add_index(prefix)


def _write_index(f, dtype: Any, lengths: np.ndarray, doc_idx: np.ndarray,
                 modes: np.ndarray | None) -> None:
    f.write(_INDEX_MAGIC)
    f.write(struct.pack("<Q", _INDEX_VERSION))
    f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
    f.write(struct.pack("<Q", len(lengths)))
    f.write(struct.pack("<Q", len(doc_idx)))
    f.write(lengths.astype("<i4", copy=False).tobytes(order="C"))
    itemsize = np.dtype(dtype).itemsize
    start = 0  # byte offset of the first sequence of the chunk
    for beg in range(0, len(lengths), _POINTER_CHUNK):
        chunk = lengths[beg : beg + _POINTER_CHUNK].astype(np.int64) * itemsize
        ends = np.cumsum(chunk)
        pointers = ends - chunk + start  # exclusive prefix sum: first pointer = 0
        f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
        start += int(ends[-1])
    f.write(doc_idx.astype("<i8", copy=False).tobytes(order="C"))
    if modes is not None:
        f.write(modes.astype(np.int8, copy=False).tobytes(order="C"))


class _IndexReader:
    """Memory-maps an ``.idx`` file and exposes its arrays as zero-copy numpy views."""

    def __init__(self, idx_path: str, multimodal: bool = False) -> None:
        self.path = idx_path
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER_SIZE)
        if header[: len(_INDEX_MAGIC)] != _INDEX_MAGIC:
            raise ValueError(f"{idx_path}: not an MMIDIDX index (magic {header[:9]!r}, expected "
                             f"{_INDEX_MAGIC!r}); was it written by Megatron's mmap builder?")
        if len(header) < _HEADER_SIZE:
            raise ValueError(f"{idx_path}: truncated header ({len(header)} of {_HEADER_SIZE} bytes)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != _INDEX_VERSION:
            raise ValueError(f"{idx_path}: index version {version} is not supported (expected 1)")
        try:
            self.dtype = DType.dtype_from_code(header[17])
        except ValueError as err:
            raise ValueError(f"{idx_path}: {err}") from None
        self.dtype_size = np.dtype(self.dtype).itemsize
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        s, d = self.sequence_count, self.document_count
        expected = _HEADER_SIZE + 12 * s + 8 * d + (s if multimodal else 0)
        if file_size < expected:
            raise ValueError(f"{idx_path}: truncated index: {file_size} bytes, the header "
                             f"({s} sequences, {d} document boundaries) needs {expected}")
        self._mmap = np.memmap(idx_path, mode="r", order="C") if file_size else None
        buf = memoryview(self._mmap) if self._mmap is not None else b""
        offset = _HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, np.int32, count=s, offset=offset)
        offset += 4 * s
        self.sequence_pointers = np.frombuffer(buf, np.int64, count=s, offset=offset)
        offset += 8 * s
        self.document_indices = np.frombuffer(buf, np.int64, count=d, offset=offset)
        offset += 8 * d
        self.sequence_modes = (np.frombuffer(buf, np.int8, count=s, offset=offset)
                               if multimodal else None)

    def check_against_bin(self, bin_path: str, bin_size: int) -> None:
        """Check the index is consistent in itself and with its ``.bin`` of ``bin_size`` bytes.

        Vectorised over chunks of sequences (0.1-0.2 s per ten million sequences on the
        shared cores, memory bounded by the chunk): document boundaries start at 0, never
        decrease and stay within the sequence count; no length is negative; every pointer is
        the byte offset the lengths before it give (the only layout Megatron-LM's builders
        write); the ``.bin`` holds exactly the bytes the lengths add up to, no fewer, no more.

        Raises:
            ValueError: naming the file, the first bad sequence (and its document) and the
                values found, or the two sizes that disagree.
        """
        self._check_document_indices()
        total = self._check_lengths_and_pointers()
        if total != bin_size:
            what = "truncated .bin" if bin_size < total else "the .bin holds more data"
            raise ValueError(
                f"{bin_path}: {bin_size} bytes, but {self.path} describes {total} "
                f"({self.sequence_count} sequences of {np.dtype(self.dtype).name} tokens): "
                f"{what}, or the .idx belongs to another dataset; rebuild both files together "
                "(tools/preprocess_data.py)")

    def _check_document_indices(self) -> None:
        doc_idx, s = self.document_indices, self.sequence_count
        if len(doc_idx) == 0:
            return
        if doc_idx[0] != 0:
            raise ValueError(f"{self.path}: corrupt index: the document boundaries must start "
                             f"at sequence 0, found {int(doc_idx[0])}")
        bad = np.flatnonzero((np.diff(doc_idx) < 0) | (doc_idx[1:] > s))
        if len(bad):
            j = int(bad[0])
            raise ValueError(
                f"{self.path}: corrupt index: document {j} spans sequences "
                f"[{int(doc_idx[j])}, {int(doc_idx[j + 1])}), which is not a non-decreasing "
                f"range within the {s} sequences")

    def _document_of(self, sequence: int) -> str:
        if len(self.document_indices) == 0:
            return ""
        doc = int(np.searchsorted(self.document_indices, sequence, side="right")) - 1
        return f" (document {doc})"

    def _check_lengths_and_pointers(self) -> int:
        """Returns the bytes the lengths add up to, once every pointer matched them."""
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        expected_start = 0  # byte offset of the chunk's first sequence
        for beg in range(0, self.sequence_count, _POINTER_CHUNK):
            chunk = lengths[beg : beg + _POINTER_CHUNK]
            negative = np.flatnonzero(chunk < 0)
            if len(negative):
                i = beg + int(negative[0])
                raise ValueError(f"{self.path}: corrupt index: sequence {i}"
                                 f"{self._document_of(i)} has a negative length "
                                 f"({int(lengths[i])} tokens)")
            nbytes = chunk.astype(np.int64) * self.dtype_size
            ends = np.cumsum(nbytes) + expected_start
            starts = ends - nbytes
            wrong = np.flatnonzero(pointers[beg : beg + _POINTER_CHUNK] != starts)
            if len(wrong):
                i = beg + int(wrong[0])
                raise ValueError(
                    f"{self.path}: corrupt index: sequence {i}{self._document_of(i)} starts at "
                    f"byte {int(pointers[i])} of the .bin, but the lengths before it put it at "
                    f"byte {int(starts[wrong[0]])}")
            if len(ends):
                expected_start = int(ends[-1])
        return expected_start

    def bin_bytes_needed(self) -> int:
        """Bytes the ``.bin`` must hold for the last sequence to be readable."""
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype_size

    def __len__(self) -> int:
        return self.sequence_count


class IndexedDataset:
    """Reader of an MMIDIDX dataset ``{prefix}.idx`` + ``{prefix}.bin``.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the mmapped file when
    ``mmap=True``); ``ds[a:b]`` a list of sequences (contiguous slices only).

    Args:
        prefix: path prefix of the two files.
        mmap: memory-map the ``.bin`` (True) or read it with file reads (False).
        multimodal: the index carries per-sequence modes.

    Raises:
        ValueError: missing files, wrong magic/version/dtype code, truncated ``.idx``, an
            index inconsistent in itself (negative length, pointer or document boundary out of
            place) or with the ``.bin`` (shorter or longer than the lengths add up to); the
            message names the file and the first bad sequence.
    """

    def __init__(self, prefix: str | os.PathLike, mmap: bool = True,
                 multimodal: bool = False) -> None:
        self._open(str(prefix), mmap, multimodal)

    def _open(self, prefix: str, mmap: bool, multimodal: bool, check: bool = True) -> None:
        self.path_prefix, self.mmap, self.multimodal = prefix, mmap, multimodal
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"dataset file {path} does not exist (check --data-path; "
                                 "the prefix is given without .bin/.idx)")
        self.index = _IndexReader(idx_path, multimodal)
        bin_size = os.path.getsize(bin_path)
        if check:
            self.index.check_against_bin(bin_path, bin_size)
        self._bin_mmap = None
        if mmap and bin_size > 0:
            self._bin_mmap = np.memmap(bin_path, mode="r", order="C")
            self._bin_buffer = memoryview(self._bin_mmap)

    # Pickling re-opens the files (DataLoader workers) instead of copying the mapped data.
    def __getstate__(self) -> tuple[str, bool, bool]:
        return self.path_prefix, self.mmap, self.multimodal

    def __setstate__(self, state: tuple[str, bool, bool]) -> None:
        # Checked when first opened: data-loader workers need not repeat it.
        self._open(*state, check=False)

    def __len__(self) -> int:
        return len(self.index)

    def _read(self, pointer: int, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=self.index.dtype)
        if self._bin_mmap is not None:
            # Zero-copy view into the mapped file.
            return np.frombuffer(self._bin_buffer, dtype=self.index.dtype, count=count,
                                 offset=pointer)
        out = np.empty(count, dtype=self.index.dtype)
        with open(data_file_path(self.path_prefix), "rb", buffering=0) as f:
            f.seek(pointer)
            f.readinto(memoryview(out).cast("B"))
        return out

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, (int, np.integer)):
            pointer = int(self.index.sequence_pointers[idx])
            return self._read(pointer, int(self.index.sequence_lengths[idx]))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"{self.path_prefix}: slices must be contiguous (step 1), got {step}")
            if stop <= start:
                return []
            lengths = self.index.sequence_lengths[start:stop]
            flat = self._read(int(self.index.sequence_pointers[start]), int(lengths.sum()))
            return np.split(flat, np.cumsum(lengths)[:-1])
        raise TypeError(f"cannot index an IndexedDataset with {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``idx`` (to its end if length is None)."""
        seq_length = int(self.index.sequence_lengths[idx])
        if length is None:
            length = seq_length - offset
        if offset < 0 or length < 0 or offset + length > seq_length:
            raise IndexError(f"{self.path_prefix}: tokens [{offset}, {offset + length}) are out of "
                             f"sequence {idx} of length {seq_length}")
        pointer = int(self.index.sequence_pointers[idx]) + offset * self.index.dtype_size
        return self._read(pointer, length)

    def token_id_range(self, max_bytes: int | None = 512 << 20) -> tuple[int, int, bool]:
        """Smallest and largest token id of the ``.bin`` (once per dataset, not per sample).

        Reads every token when they take at most ``max_bytes`` (None: always), else
        evenly spaced chunks adding up to about ``max_bytes``: data made with another
        tokenizer has out-of-range ids all over, so a sample finds them. Reading 256 MiB of
        tokens from the page cache takes a fraction of a second.

        Args:
            max_bytes: bytes read at most.

        Returns:
            ``(min id, max id, whether every token was read)``; ``(0, -1, True)`` when empty.
        """
        itemsize = self.index.dtype_size
        total = self.index.bin_bytes_needed() // itemsize  # tokens
        if total == 0:
            return 0, -1, True
        chunk = (4 << 20) // itemsize
        if max_bytes is None or total * itemsize <= max_bytes:
            starts = range(0, total, chunk)
            exhaustive = True
        else:
            count = max(1, max_bytes // (chunk * itemsize))
            starts = np.linspace(0, total - chunk, count).astype(np.int64).tolist()
            exhaustive = False
        lo, hi = None, None
        for start in starts:
            tokens = self._read(int(start) * itemsize, min(chunk, total - int(start)))
            t_lo, t_hi = int(tokens.min()), int(tokens.max())
            lo = t_lo if lo is None else min(lo, t_lo)
            hi = t_hi if hi is None else max(hi, t_hi)
        return lo, hi, exhaustive

    @property
    def dtype(self) -> type:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 ``[S]`` token count of each sequence."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 ``[S]`` byte offset of each sequence in the ``.bin``."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 ``[D]`` document boundaries (sequence indices, first 0, last S)."""
        return self.index.document_indices

    @property
    def sequence_modes(self) -> np.ndarray | None:
        return self.index.sequence_modes

    # Old names.
    sizes = sequence_lengths
    pointers = sequence_pointers
    doc_idx = document_indices

    def get_doc_idx(self) -> np.ndarray:
        return self.document_indices

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(prefix: str | os.PathLike) -> bool:
        """Whether both ``{prefix}.idx`` and ``{prefix}.bin`` exist."""
        return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def infer_dataset_impl(prefix: str | os.PathLike) -> str | None:
    """``"mmap"`` if ``{prefix}.idx`` starts with the MMIDIDX magic, ``"legacy"`` for TNTIDX, else None."""
    path = Path(index_file_path(prefix))
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        magic = f.read(9)
    if magic == _INDEX_MAGIC:
        return "mmap"
    if magic[:8] == b"TNTIDX\x00\x00":
        return "legacy"
    return None


# Old names (Megatron-LM <= 23.06).
MMapIndexedDataset = IndexedDataset
MMapIndexedDatasetBuilder = IndexedDatasetBuilder


def make_builder(out_file: str | os.PathLike, impl: str = "mmap",
                 vocab_size: int | None = None) -> IndexedDatasetBuilder:
    """Old factory: an mmap builder with the dtype Megatron picks for ``vocab_size``."""
    if impl not in ("mmap", "infer"):
        raise ValueError(f"--dataset-impl {impl!r} is not supported; only 'mmap' exists")
    return IndexedDatasetBuilder(out_file, dtype=optimal_dtype(vocab_size))
