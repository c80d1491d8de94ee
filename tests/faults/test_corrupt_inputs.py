"""Corrupt inputs: each refused before any work, naming the file and the line or
offset, leaving nothing half-written.

What other modules prove already is not repeated: the ``.idx``/``.bin`` checks (wrong magic,
version, dtype code, truncation, sizes disagreeing with the ``.bin``:
tests/data/test_indexed_dataset.py), a checksummed shard that is bit-flipped or emptied, a bad
tracker (tests/training/test_checkpoint_faults.py), a jsonl line that is not JSON or not text,
a missing tokenizer file for preprocess_data.py (tests/tools/test_preprocess_data.py). Here,
the gaps the injections found (each was a bug, now fixed):

* a checkpoint shard without a recorded sha256 (as Megatron-LM writes them) with a flipped bit in a
  tensor loaded silently: torch's zip reader does not check the CRC32 it records. Now checked;
* a ``vocab.json`` that is a JSON list, or has a non-integer id, failed with an AttributeError /
  TypeError naming no file; a JSON syntax error or a non-UTF-8 byte in ``vocab.json``,
  ``merges.txt`` or ``vocab.txt`` named no line (Python's "position 5000");
* a truncated or corrupt ``.jsonl.gz`` given to preprocess_data.py ended in a bare EOFError
  traceback;
* a finetuning task file (MNLI, QQP, RACE, SQuAD) with a non-UTF-8 byte named neither the file
  nor the line.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron.checkpointing import files as checkpoint_files
from megatron.training.checkpointing import CheckpointError
from megatron.tokenizer import TokenizerConfig, build_tokenizer
from tests.training.test_checkpoint_faults import _load, _model, _save
from tasks import finetune_sample_data as synthetic
from tools import preprocess_data


# Checkpoint shards ----------------------------------------------------------------------------
def _megatron_shard(tmp_path: Path) -> tuple[Path, Path, torch.nn.Module]:
    """A saved iteration-2 checkpoint with no checksum manifest (Megatron-LM's files)."""
    root = tmp_path / "run"
    model = _model(3)
    shard = _save(root, 2, model)
    checkpoint_files.manifest_path(shard).unlink()
    return root, shard, model


def test_a_flipped_bit_in_a_megatron_shard_without_checksum_is_refused(tmp_path):
    root, shard, model = _megatron_shard(tmp_path)
    data = bytearray(shard.read_bytes())
    at = bytes(data).find(model.weight.detach().numpy().tobytes())
    data[at + 77] ^= 0x10  # one bit of one weight
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as caught:
        _load(root)
    assert str(caught.value).startswith(
        f"corrupt or truncated checkpoint file {shard}: the bytes of its entry archive/data/")
    assert "do not match the CRC32 recorded when it was saved" in str(caught.value)
    # The way out the message names loads it, flipped bit and all.
    loaded = _model(99)
    assert _load(root, "--no-verify-checkpoint-checksums", model=loaded)[0] == 2
    assert int((loaded.weight != model.weight).sum()) == 1


@pytest.mark.parametrize("checksum", [True, False], ids=["with-sha256", "megatron-lm"])
@pytest.mark.parametrize("keep", [0.5, -1, -30], ids=["half", "last-byte", "end-record"])
def test_a_truncated_shard_is_refused_naming_it(tmp_path, checksum, keep):
    root = tmp_path / "run"
    shard = _save(root, 2)
    data = shard.read_bytes()
    if not checksum:
        checkpoint_files.manifest_path(shard).unlink()
    shard.write_bytes(data[:int(len(data) * keep)] if keep == 0.5 else data[:keep])
    with pytest.raises(CheckpointError,
                       match=f"^corrupt or truncated checkpoint file {re.escape(str(shard))}: "):
        _load(root)


def test_an_intact_megatron_shard_still_loads(tmp_path):
    root, _, model = _megatron_shard(tmp_path)
    loaded = _model(99)
    assert _load(root, model=loaded)[0] == 2
    assert torch.equal(loaded.weight, model.weight)


# Tokenizer files ------------------------------------------------------------------------------
@pytest.fixture
def gpt2_files(shared_data, tmp_path) -> tuple[Path, Path]:
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    shutil.copy(shared_data / "tokenizers" / "gpt2-vocab.json", vocab)
    shutil.copy(shared_data / "tokenizers" / "gpt2-merges.txt", merges)
    return vocab, merges


def _build(kind: str, **files) -> None:
    build_tokenizer(TokenizerConfig(tokenizer_type=kind, **files))


def _gpt2_error(vocab: Path, merges: Path) -> str:
    with pytest.raises(ValueError) as caught:
        _build("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    return str(caught.value)


@pytest.mark.parametrize("content, message", [
    (b'{"!": 0,,}', r"vocab\.json:1:9: not valid JSON \(Expecting property name"),
    (b"", r"vocab\.json:1:1: not valid JSON \(Expecting value\)"),
    (b'["!", "a"]', r"vocab\.json: expected a JSON object mapping tokens to ids, got a list"),
    (b'{"!": 0,\n "a": "1"}', r"vocab\.json: token 'a' has id '1'; ids must be non-negative"),
    (b'{"!": 0,\n "a": -4}', r"vocab\.json: token 'a' has id -4"),
    (b'{"!": 0,\n "\xff": 1}', r"vocab\.json:2: not UTF-8 text \(byte offset 11: invalid start"),
], ids=["syntax", "empty", "list", "string-id", "negative-id", "not-utf8"])
def test_a_malformed_vocab_json_names_the_file_and_place(gpt2_files, content, message):
    vocab, merges = gpt2_files
    vocab.write_bytes(content)
    error = _gpt2_error(vocab, merges)
    assert error.startswith("--tokenizer-type GPT2BPETokenizer: cannot load --vocab-file ")
    assert re.search(f"{re.escape(str(vocab.parent))}/{message}", error), error


@pytest.mark.parametrize("bad_line, message", [
    (b"\xc3\x28 e", r"merges\.txt:6: not UTF-8 text \(byte offset \d+: invalid continuation"),
    ("Ġ t h".encode(), r"merges\.txt:6: expected two tokens, got 'Ġ t h'"),
], ids=["not-utf8", "three-tokens"])
def test_a_malformed_merges_line_is_named(gpt2_files, bad_line, message):
    vocab, merges = gpt2_files
    lines = merges.read_bytes().split(b"\n")
    lines[5] = bad_line
    merges.write_bytes(b"\n".join(lines))
    error = _gpt2_error(vocab, merges)
    assert re.search(message, error), error


def test_bert_vocab_missing_or_not_utf8_is_named(shared_data, tmp_path):
    vocab = tmp_path / "vocab.txt"
    with pytest.raises(ValueError, match=f"--vocab-file {re.escape(str(vocab))} does not exist"):
        _build("BertWordPieceLowerCase", vocab_file=str(vocab))
    lines = (shared_data / "tokenizers" / "bert-base-uncased-vocab.txt").read_bytes().split(b"\n")
    lines[2000] = b"caf\xe9"  # latin-1, as a mis-converted file has it
    vocab.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=r"vocab\.txt:2001: not UTF-8 text \(byte offset \d+"):
        _build("BertWordPieceLowerCase", vocab_file=str(vocab))
    vocab.write_bytes(b"\n".join(lines[:2000] + lines[2001:]))  # the file itself was fine
    _build("BertWordPieceLowerCase", vocab_file=str(vocab))


# preprocess_data.py inputs --------------------------------------------------------------------
def _preprocess(src: Path, out: Path) -> int:
    return preprocess_data.main(["--input", str(src), "--output-prefix", str(out / "x"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                                 "--workers", "1"])


def _gzipped_lines(n: int) -> bytes:
    return gzip.compress(b"".join(b'{"text": "%d 1 2 3"}\n' % (i % 90) for i in range(n)))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_gzip_input_is_named_and_nothing_written(tmp_path, capsys, damage):
    data = _gzipped_lines(3000)
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(data[:len(data) // 2] if damage == "truncated"
                    else data[:10] + bytes(200) + data[210:])
    out = tmp_path / "out"
    out.mkdir()
    assert _preprocess(src, out) == 1
    err = capsys.readouterr().err
    assert re.search(rf"^preprocess_data\.py: error: {re.escape(str(src))}: corrupt or "
                     r"truncated compressed input after line \d+ \(", err, re.M), err
    assert os.listdir(out) == []


def test_an_invalid_utf8_byte_is_named_by_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "1 2"}\n\n{"text": "3 \xff 4"}\n{"text": "5"}\n')
    out = tmp_path / "out"
    out.mkdir()
    assert _preprocess(src, out) == 1
    assert f"{src}:3: not valid UTF-8 (invalid start byte)" in capsys.readouterr().err
    assert os.listdir(out) == []


def test_an_intact_gzip_input_still_converts(tmp_path):
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(_gzipped_lines(50))
    out = tmp_path / "out"
    out.mkdir()
    assert _preprocess(src, out) == 0
    assert sorted(os.listdir(out)) == ["x_text_document.bin", "x_text_document.idx"]
    assert (out / "x_text_document.bin").stat().st_size == 50 * 4 * 2  # 4 uint16 ids a line


# Task files ------------------------------------------------------------------------
def _with_latin1_byte(path: Path, line: int) -> Path:
    """``path`` with an 'é' written in Latin-1 (0xe9, invalid UTF-8) into line ``line``."""
    lines = path.read_bytes().split(b"\n")
    lines[line - 1] = lines[line - 1].replace(b" ", b" caf\xe9 ", 1)
    path.write_bytes(b"\n".join(lines))
    return path


def _random_bytes(path: Path) -> Path:
    # Seeded, and sure to hold a byte that starts no UTF-8 sequence (0xff) on its first line.
    path.write_bytes(b"\xff" + random.Random(0).randbytes(4000))
    return path


def _race_file(tmp_path: Path, line: int) -> str:
    directory = synthetic.write_race(tmp_path / "race", 6, seed=0)
    _with_latin1_byte(directory / "1.txt", line)
    return str(directory)


def _word_piece(tmp_path: Path):
    from megatron.tokenizer.bert import BertWordPieceTokenizer

    return BertWordPieceTokenizer(synthetic.write_vocab(tmp_path / "vocab.txt"))


def _squad_file(tmp_path: Path, line: int) -> Path:
    path = tmp_path / "train-v1.1.json"
    text = json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": []}]}, indent=1)
    path.write_text(text)
    return _with_latin1_byte(path, line)


@pytest.mark.parametrize("case", ["mnli_latin1", "mnli_random_bytes", "qqp_latin1",
                                  "race_latin1", "squad_latin1"])
def test_a_task_file_that_is_not_utf8_is_named_with_its_line(tmp_path, case):
    """Regression: tasks/main.py said only "'utf-8' codec can't decode byte 0xe9 in position
    718" (an offset into Python's read buffer), naming neither the file nor the line."""
    from tasks.glue.data import read_mnli, read_qqp
    from tasks.race.data import read_race_directory
    from tasks.squad.reader import read_squad_examples

    line, byte = (1, "0xff") if case == "mnli_random_bytes" else (3, "0xe9")
    readers = {
        "mnli_latin1": lambda: (read_mnli, _with_latin1_byte(
            synthetic.write_mnli(tmp_path / "train.tsv", 8, seed=1), line)),
        "mnli_random_bytes": lambda: (read_mnli, _random_bytes(tmp_path / "train.tsv")),
        "qqp_latin1": lambda: (read_qqp, _with_latin1_byte(
            synthetic.write_qqp(tmp_path / "train.tsv", 8, seed=1), line)),
        "race_latin1": lambda: (lambda d: read_race_directory(d, _word_piece(tmp_path), 8, 32),
                                _race_file(tmp_path, line)),
        "squad_latin1": lambda: (lambda p: read_squad_examples(p, "1.1", True),
                                 _squad_file(tmp_path, line)),
    }
    read, path = readers[case]()
    where = Path(path) / "1.txt" if case == "race_latin1" else path
    with pytest.raises(ValueError, match=re.escape(f"{where}:{line}: not UTF-8 text (byte {byte}")
                       + r".* re-encode it"):
        read(str(path))
