"""MMIDIDX reader/builder against an independent writer that follows docs/FORMATS.md 2a byte
by byte."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch

from megatron.data.indexed_dataset import (DType, IndexedDataset, IndexedDatasetBuilder,
                                           MMapIndexedDataset, MMapIndexedDatasetBuilder,
                                           optimal_dtype)

CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
         7: np.float32, 8: np.uint16}


def write_reference(prefix, code: int, docs: list[list[list[int]]]) -> None:
    """Minimal foreign writer: docs = list of documents, each a list of sequences."""
    dtype = np.dtype(CODES[code]).newbyteorder("<")
    seqs = [s for doc in docs for s in doc]
    doc_idx = [0]
    for doc in docs:
        doc_idx.append(doc_idx[-1] + len(doc))
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(np.array(s, dtype=dtype).tobytes())
    ptrs, p = [], 0
    for s in seqs:
        ptrs.append(p)
        p += len(s) * dtype.itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(seqs)}i", *[len(s) for s in seqs]))
        f.write(struct.pack(f"<{len(seqs)}q", *ptrs))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


DOCS = [[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]], [[16] * 16], [],
        [[3, 2, 1]], [[5, 6], [7], []]]


@pytest.mark.parametrize("code", sorted(CODES))
@pytest.mark.parametrize("mmap", [True, False])
def test_reads_foreign_files_every_dtype(tmp_path, code, mmap):
    write_reference(tmp_path / "ref", code, DOCS)
    ds = IndexedDataset(tmp_path / "ref", mmap=mmap)
    seqs = [s for doc in DOCS for s in doc]
    assert len(ds) == len(seqs) and ds.dtype == CODES[code]
    assert ds.sequence_lengths.tolist() == [len(s) for s in seqs]
    assert ds.sizes is ds.sequence_lengths or (ds.sizes == ds.sequence_lengths).all()
    assert ds.document_indices.tolist() == [0, 1, 2, 2, 3, 6] == ds.doc_idx.tolist()
    size = np.dtype(CODES[code]).itemsize
    assert ds.pointers.tolist() == list(np.cumsum([0] + [len(s) * size for s in seqs[:-1]]))
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    assert ds.get(0, 3, 4).tolist() == [4, 5, 6, 7]
    assert ds.get(0, 14).tolist() == [15, 16]
    assert [x.tolist() for x in ds[2:5]] == [[3, 2, 1], [5, 6], [7]]
    with pytest.raises(ValueError):
        ds[0:4:2]


@pytest.mark.parametrize("code", sorted(CODES))
def test_builder_is_byte_identical_to_reference(tmp_path, code):
    write_reference(tmp_path / "ref", code, DOCS)
    b = IndexedDatasetBuilder(tmp_path / "out.bin", dtype=CODES[code])
    for doc in DOCS:
        for s in doc:
            b.add_item(torch.tensor(s) if code in (4, 5) else np.array(s))
        b.end_document()
    b.finalize(tmp_path / "out.idx")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


def test_add_document_and_megatron_example(tmp_path):
    # docs/FORMATS.md: lengths [16,16,3], doc_idx [0,1,2,2,3] for 4 docs, the 3rd empty.
    b = MMapIndexedDatasetBuilder(tmp_path / "x.bin", dtype=optimal_dtype(50257))
    b.add_document(list(range(16)), [16])
    b.add_doc(np.arange(16), [16])
    b.end_document()
    b.add_document([1, 2, 3], [3])
    b.finalize(tmp_path / "x.idx")
    ds = MMapIndexedDataset(tmp_path / "x")
    assert ds.sizes.tolist() == [16, 16, 3] and ds.doc_idx.tolist() == [0, 1, 2, 2, 3]
    assert (tmp_path / "x.idx").stat().st_size == 34 + 12 * 3 + 8 * 5
    assert ds.dtype == np.uint16
    with pytest.raises(ValueError, match="lengths"):
        IndexedDatasetBuilder(tmp_path / "y.bin").add_document([1, 2], [3])


def test_add_index_merge(tmp_path):
    write_reference(tmp_path / "a", 8, DOCS)
    write_reference(tmp_path / "b", 8, [[[9, 9]], [[8]]])
    b = IndexedDatasetBuilder(tmp_path / "m.bin", dtype=np.uint16)
    b.add_index(tmp_path / "a")
    b.merge_file_(tmp_path / "b")
    b.finalize(tmp_path / "m.idx")
    write_reference(tmp_path / "ref", 8, DOCS + [[[9, 9]], [[8]]])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"m{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    with pytest.raises(ValueError, match="dtype"):
        IndexedDatasetBuilder(tmp_path / "z.bin", dtype=np.int32).add_index(tmp_path / "a")


def test_optimal_dtype_and_codes():
    assert optimal_dtype(50257) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(None) == np.int32
    assert DType.code_from_dtype(np.uint16) == 8 and DType.dtype_from_code(7) == np.float32


def test_zero_copy_and_pickle(tmp_path):
    write_reference(tmp_path / "a", 4, DOCS)
    ds = IndexedDataset(tmp_path / "a")
    item = ds.get(0)
    assert not item.flags.owndata and not item.flags.writeable  # a view of the mapped file
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 200 and clone[0].tolist() == ds[0].tolist()
    assert IndexedDataset.exists(tmp_path / "a") and not IndexedDataset.exists(tmp_path / "nope")


def _corrupt(tmp_path, offset: int, data: bytes) -> str:
    write_reference(tmp_path / "c", 4, DOCS)
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[offset : offset + len(data)] = data
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    return str(tmp_path / "c")


@pytest.mark.parametrize("offset,data,match", [
    (0, b"TNTIDX\x00\x00\x00", "magic"),
    (9, struct.pack("<Q", 2), "version"),
    (17, bytes([9]), "dtype code"),
    (18, struct.pack("<Q", 1000), "truncated"),
])
def test_corrupt_index_errors(tmp_path, offset, data, match):
    prefix = _corrupt(tmp_path, offset, data)
    with pytest.raises(ValueError, match=match) as err:
        IndexedDataset(prefix)
    assert "c.idx" in str(err.value)


def test_truncated_files(tmp_path):
    write_reference(tmp_path / "t", 4, DOCS)
    idx = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(idx[:-5])
    with pytest.raises(ValueError, match="t.idx.*truncated"):
        IndexedDataset(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(idx[:20])
    with pytest.raises(ValueError, match="t.idx"):
        IndexedDataset(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(idx)
    binary = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(binary[:-4])
    with pytest.raises(ValueError, match="t.bin"):
        IndexedDataset(tmp_path / "t")
    with pytest.raises(ValueError, match="missing.idx"):
        IndexedDataset(tmp_path / "missing")


@pytest.mark.parametrize("mmap", [True, False])
def test_token_id_range_full_and_sampled(tmp_path, mmap):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 1000, size=3_000_000).astype(np.uint16)
    tokens[1_234_567] = 60_000
    b = IndexedDatasetBuilder(tmp_path / "d.bin", dtype=np.uint16)
    b.add_document(tokens, [1_000_000, 2_000_000])
    b.finalize(tmp_path / "d.idx")
    ds = IndexedDataset(tmp_path / "d", mmap=mmap)
    assert ds.token_id_range() == (0, 60_000, True)
    lo, hi, exhaustive = ds.token_id_range(max_bytes=1 << 20)  # one 4 MiB chunk at most
    assert not exhaustive and lo == 0 and 990 <= hi <= 60_000
    b = IndexedDatasetBuilder(tmp_path / "e.bin", dtype=np.int32)
    b.finalize(tmp_path / "e.idx")
    assert IndexedDataset(tmp_path / "e").token_id_range() == (0, -1, True)


# Offsets into the .idx of write_reference(..., DOCS): 6 sequences, 6 document boundaries.
_S, _D = 6, 6
_LENGTHS_AT, _POINTERS_AT, _DOCS_AT = 34, 34 + 4 * _S, 34 + 12 * _S


@pytest.mark.parametrize("offset,data,match", [
    # Sequence 3 (the [5, 6] of document 4) claims -2 tokens.
    (_LENGTHS_AT + 4 * 3, struct.pack("<i", -2),
     r"sequence 3 \(document 4\) has a negative length"),
    # Sequence 4 points past the end of the 152-byte .bin.
    (_POINTERS_AT + 8 * 4, struct.pack("<q", 4000),
     r"sequence 4 \(document 4\) starts at byte 4000"),
    # Sequence 1 points back into sequence 0.
    (_POINTERS_AT + 8 * 1, struct.pack("<q", 8),
     r"sequence 1 \(document 1\) starts at byte 8.*64"),
    # A length grown by one token: every pointer after it is off by 4 bytes.
    (_LENGTHS_AT + 4 * 1, struct.pack("<i", 17),
     r"sequence 2 \(document 3\) starts at byte 128.*byte 132"),
    (_DOCS_AT, struct.pack("<q", 1), "must start at sequence 0, found 1"),
    (_DOCS_AT + 8 * 3, struct.pack("<q", 1), r"document 2 spans sequences \[2, 1\)"),
    (_DOCS_AT + 8 * 5, struct.pack("<q", 7), r"document 4 spans sequences \[3, 7\).*6 sequences"),
])
def test_index_inconsistent_with_itself_names_file_and_sequence(tmp_path, offset, data, match):
    prefix = _corrupt(tmp_path, offset, data)
    with pytest.raises(ValueError, match=match) as err:
        IndexedDataset(prefix)
    assert "c.idx" in str(err.value)


def test_bin_longer_or_from_another_dataset(tmp_path):
    write_reference(tmp_path / "t", 4, DOCS)
    binary = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(binary + b"\x00" * 8)  # two int32 tokens too many
    with pytest.raises(ValueError, match=r"t.bin: 160 bytes, but .*t.idx describes 152.*more"):
        IndexedDataset(tmp_path / "t")
    # Same dtype, another corpus: the .idx of one paired with the .bin of the other.
    write_reference(tmp_path / "u", 4, DOCS + [[[1, 2, 3]]])
    (tmp_path / "t.bin").write_bytes((tmp_path / "u.bin").read_bytes())
    with pytest.raises(ValueError, match=r"t.bin: 164 bytes.*t.idx describes 152.*another"):
        IndexedDataset(tmp_path / "t")
    # The merge tool's add_index refuses the mismatched pair instead of copying it.
    with pytest.raises(ValueError, match="t.bin"):
        IndexedDatasetBuilder(tmp_path / "m.bin", dtype=np.int32).add_index(tmp_path / "t")


def test_consistent_files_still_load(tmp_path):
    """Empty documents, empty sequences, no documents at all, a builder-made multi-chunk index."""
    write_reference(tmp_path / "a", 8, [[], [[]], [[1]], [], [[], [2, 3]]])
    assert [x.tolist() for x in IndexedDataset(tmp_path / "a")[0:4]] == [[], [1], [], [2, 3]]
    write_reference(tmp_path / "empty", 8, [])
    assert len(IndexedDataset(tmp_path / "empty")) == 0


def test_index_check_spans_pointer_chunks(tmp_path, monkeypatch):
    """The check walks the sequences in chunks; a bad pointer in a later chunk is found, and a
    good index is accepted across chunk boundaries."""
    from megatron.data import indexed_dataset

    monkeypatch.setattr(indexed_dataset, "_POINTER_CHUNK", 4)
    b = IndexedDatasetBuilder(tmp_path / "k.bin", dtype=np.uint16)
    for i in range(11):
        b.add_item(np.arange(i % 3 + 1))
        b.end_document()
    b.finalize(tmp_path / "k.idx")
    assert len(IndexedDataset(tmp_path / "k")) == 11
    raw = bytearray((tmp_path / "k.idx").read_bytes())
    raw[34 + 4 * 11 + 8 * 9: 34 + 4 * 11 + 8 * 10] = struct.pack("<q", 3)
    (tmp_path / "k.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"sequence 9 \(document 9\) starts at byte 3"):
        IndexedDataset(tmp_path / "k")
