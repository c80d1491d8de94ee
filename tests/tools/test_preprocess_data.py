"""tools/preprocess_data.py writes Megatron-LM's exact files, and fails cleanly on bad input."""

from __future__ import annotations

import gzip
import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from bench.reference_gpt2 import ReferenceGPT2
from megatron.tokenizer.sentences import build_sentence_splitter, split_sentences
from tools import merge_datasets, preprocess_data

EOD = 50256


def megatron_dataset_bytes(docs: list[list[list[int]]], dtype_code: int,
                           np_dtype: str) -> tuple[bytes, bytes]:
    """(.bin, .idx) of ``docs`` (documents of sentences of ids), written from docs/FORMATS.md 2a
    with struct, independently of megatron.data."""
    sizes = [len(s) for doc in docs for s in doc]
    itemsize = np.dtype(np_dtype).itemsize
    pointers, offset = [], 0
    for size in sizes:
        pointers.append(offset)
        offset += size * itemsize
    doc_idx = [0]
    for doc in docs:
        doc_idx.append(doc_idx[-1] + len(doc))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    idx += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
    idx += struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(sizes)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    tokens = [t for doc in docs for s in doc for t in s]
    return np.array(tokens, dtype=np_dtype).tobytes(), idx


@pytest.fixture(scope="module")
def gpt2_args(shared_data) -> list[str]:
    tok = shared_data / "tokenizers"
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "gpt2-vocab.json"),
            "--merge-file", str(tok / "gpt2-merges.txt")]


@pytest.fixture(scope="module")
def reference(shared_data) -> ReferenceGPT2:
    tok = shared_data / "tokenizers"
    return ReferenceGPT2(str(tok / "gpt2-vocab.json"), str(tok / "gpt2-merges.txt"))


@pytest.fixture(scope="module")
def documents(shared_data) -> list[dict]:
    """120 real documents (paragraph runs of tinyshakespeare + a Gutenberg book), some empty."""
    paras = (shared_data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8").split("\n\n")
    paras += (shared_data / "corpus" / "gutenberg" / "pg84-0.txt").read_text(
        encoding="utf-8").split("\n\n")[200:300]
    docs = []
    for i in range(120):
        text = "" if i % 17 == 5 else "\n\n".join(paras[3 * i: 3 * i + 3])
        docs.append({"text": text, "title": f"Doc {i}: {paras[i][:30]}", "id": i})
    return docs


def write_jsonl(path: Path, docs: list[dict]) -> str:
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    return str(path)


def run(argv: list[str]) -> int:
    return preprocess_data.main([str(a) for a in argv])


def read(prefix: Path | str) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def expected_docs(reference, docs, key="text", eod=True, splitter=None):
    out = []
    for doc in docs:
        sentences = split_sentences(splitter, doc[key]) if splitter else [doc[key]]
        seqs = [ids for ids in (reference.encode(s) for s in sentences) if ids]
        if seqs and eod:
            seqs[-1] = seqs[-1] + [EOD]
        out.append(seqs)
    return out


def test_hand_computed_tiny_case(tmp_path):
    """Four documents, the third empty: lengths [16, 16, 3], doc_idx [0, 1, 2, 2, 3]."""
    docs = [{"text": " ".join(str(i) for i in range(15))},
            {"text": " ".join(str(i) for i in range(20, 35))},
            {"text": ""},
            {"text": "7 8"}]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    assert run(["--input", src, "--output-prefix", tmp_path / "out", "--tokenizer-type",
                "NullTokenizer", "--vocab-size", 100, "--append-eod", "--workers", 1]) == 0
    bin_bytes, idx = read(tmp_path / "out_text_document")
    header = b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8])  # uint16
    header += (3).to_bytes(8, "little") + (5).to_bytes(8, "little")
    body = b"".join(n.to_bytes(4, "little") for n in (16, 16, 3))
    body += b"".join(n.to_bytes(8, "little") for n in (0, 32, 64))
    body += b"".join(n.to_bytes(8, "little") for n in (0, 1, 2, 2, 3))
    assert idx == header + body and len(idx) == 34 + 12 * 3 + 8 * 5
    tokens = list(range(15)) + [100] + list(range(20, 35)) + [100, 7, 8, 100]
    assert bin_bytes == b"".join(t.to_bytes(2, "little") for t in tokens)


@pytest.mark.parametrize("workers", [1, 2])
def test_gpt2_documents_byte_identical(tmp_path, gpt2_args, reference, documents, workers):
    src = write_jsonl(tmp_path / "in.jsonl", documents)
    argv = ["--input", src, "--output-prefix", tmp_path / "out", *gpt2_args, "--append-eod",
            "--workers", workers, "--json-keys", "text", "title"]
    assert run(argv) == 0
    for key in ("text", "title"):  # every key gets its finished .bin AND .idx
        expected = megatron_dataset_bytes(expected_docs(reference, documents, key), 8, "uint16")
        assert read(tmp_path / f"out_{key}_document") == expected, key
    # Nothing else (no temporary file) is left.
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin", "out_text_document.idx",
                                            "out_title_document.bin", "out_title_document.idx"]


def test_without_eod_and_gz_input(tmp_path, gpt2_args, reference, documents):
    src = tmp_path / "in.jsonl.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in documents[:30])
    assert run(["--input", src, "--output-prefix", tmp_path / "o", *gpt2_args, "--workers", 1]) == 0
    expected = megatron_dataset_bytes(expected_docs(reference, documents[:30], eod=False), 8, "uint16")
    assert read(tmp_path / "o_text_document") == expected


def test_split_sentences_one_run(tmp_path, gpt2_args, reference, documents):
    src = write_jsonl(tmp_path / "in.jsonl", documents[:40])
    assert run(["--input", src, "--output-prefix", tmp_path / "s", *gpt2_args, "--append-eod",
                "--split-sentences", "--workers", 2]) == 0
    splitter = build_sentence_splitter()
    docs = expected_docs(reference, documents[:40], splitter=splitter)
    assert sum(len(d) > 1 for d in docs) > 10  # really split
    assert read(tmp_path / "s_text_sentence") == megatron_dataset_bytes(docs, 8, "uint16")


def test_pre_split_list_values(tmp_path, gpt2_args, reference):
    docs = [{"text": ["First sentence.", "", " Second one."]}, {"text": []}]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    assert run(["--input", src, "--output-prefix", tmp_path / "l", *gpt2_args, "--append-eod",
                "--workers", 1]) == 0
    seqs = [reference.encode("First sentence."), reference.encode(" Second one.") + [EOD]]
    assert read(tmp_path / "l_text_document") == megatron_dataset_bytes([seqs, []], 8, "uint16")


@pytest.mark.parametrize("partitions", [2, 3])
def test_partitions_deal_round_robin(tmp_path, gpt2_args, reference, documents, partitions):
    src = write_jsonl(tmp_path / "in.jsonl", documents)
    assert run(["--input", src, "--output-prefix", tmp_path / "p", *gpt2_args, "--append-eod",
                "--partitions", partitions, "--workers", 2]) == 0
    docs = expected_docs(reference, documents)
    dealt = [d for p in range(partitions) for d in docs[p::partitions]]  # Megatron's order
    assert read(tmp_path / "p_text_document") == megatron_dataset_bytes(dealt, 8, "uint16")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "p_text_document.bin", "p_text_document.idx"]


def test_bert_int_dtype_and_eod(tmp_path, shared_data):
    vocab = shared_data / "tokenizers" / "bert-base-uncased-vocab.txt"
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "Hello World."}, {"text": ""}])
    assert run(["--input", src, "--output-prefix", tmp_path / "b", "--tokenizer-type",
                "BertWordPieceLowerCase", "--vocab-file", vocab, "--append-eod", "--workers", 1]) == 0
    docs = [[[7592, 2088, 1012, 30523]], []]  # hello world . [EOS]
    assert read(tmp_path / "b_text_document") == megatron_dataset_bytes(docs, 8, "uint16")


def test_large_vocab_uses_int32(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "70000 1 2"}])
    assert run(["--input", src, "--output-prefix", tmp_path / "n", "--tokenizer-type",
                "NullTokenizer", "--vocab-size", 70000, "--append-eod", "--workers", 1]) == 0
    expected = megatron_dataset_bytes([[[70000, 1, 2, 70000]]], 4, "int32")
    assert read(tmp_path / "n_text_document") == expected


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", r"in\.jsonl:3: not valid JSON \(.*column 2\)"),
    ('{"text": "cut short"', r"in\.jsonl:3: not valid JSON \(.*at the end of the line\)"),
    ('{"title": "no text"}', r"in\.jsonl:3: missing key\(s\) \['text'\]"),
    ('["a list"]', r"in\.jsonl:3: expected a JSON object"),
    ('{"text": 5}', r"in\.jsonl:3: key 'text' is a int"),
    # JSON escapes of half a surrogate pair: not text (was silently encoded as U+FFFD)
    ('{"text": "ok \\ud800 bad"}', r"in\.jsonl:3: key 'text' holds a lone surrogate U\+D800 at character 3"),
    ('{"text": ["fine", "x\\uDC00"]}', r"in\.jsonl:3: key 'text' holds a lone surrogate U\+DC00"),
])
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_input_names_file_and_line(tmp_path, capsys, gpt2_args, bad_line, message, workers):
    lines = ['{"text": "fine"}', "", bad_line, '{"text": "never reached"}']
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    assert run(["--input", tmp_path / "in.jsonl", "--output-prefix", out / "x", *gpt2_args,
                "--workers", workers]) == 1

    assert re.search(message, capsys.readouterr().err)
    assert os.listdir(out) == []  # no half-written file under any name


def test_surrogates_in_utf8_bytes_and_valid_pairs(tmp_path, capsys, gpt2_args, reference):
    good = '{"text": "emoji \\ud83d\\ude00 pair"}\n'.encode()  # a valid pair: one character
    (tmp_path / "in.jsonl").write_bytes(good + b'{"text": "raw \xed\xa0\x80 bytes"}\n')
    assert run(["--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "o", *gpt2_args,
                "--workers", 1]) == 1
    assert "in.jsonl:2: key 'text' holds a lone surrogate U+D800" in capsys.readouterr().err
    (tmp_path / "in.jsonl").write_bytes(good)
    assert run(["--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "o", *gpt2_args,
                "--workers", 1]) == 0
    docs = [[reference.encode("emoji \U0001F600 pair")]]
    assert read(tmp_path / "o_text_document") == megatron_dataset_bytes(docs, 8, "uint16")


@pytest.mark.parametrize("flag", ["--vocab-file", "--merge-file"])
def test_missing_tokenizer_file_is_one_line(tmp_path, capsys, gpt2_args, flag):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    args = list(gpt2_args)
    missing = tmp_path / "nowhere" / "file.txt"
    args[args.index(flag) + 1] = str(missing)
    assert run(["--input", src, "--output-prefix", tmp_path / "o", *args, "--workers", 1]) == 1
    err = capsys.readouterr().err
    assert err == f"preprocess_data.py: error: {flag} {missing} does not exist " \
                  "(--tokenizer-type GPT2BPETokenizer)\n"
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_missing_tokenizer_file_exit_code(tmp_path, shared_data):
    """As a user runs it: exit status 1 and one line on stderr, no traceback."""
    import subprocess
    import sys

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    tool = Path(preprocess_data.__file__)
    proc = subprocess.run([sys.executable, str(tool), "--input", src, "--output-prefix",
                           str(tmp_path / "o"), "--tokenizer-type", "BertWordPieceLowerCase",
                           "--vocab-file", str(tmp_path / "vocab.txt"), "--workers", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"preprocess_data.py: error: --vocab-file {tmp_path / 'vocab.txt'} "
                                   "does not exist (--tokenizer-type BertWordPieceLowerCase)")


@pytest.mark.parametrize("case", ["directory", "glob-with-directory", "missing"])
def test_bad_input_path_is_one_line(tmp_path, capsys, case):
    """--input a directory (a glob matches a directory's own name) or a missing file: one
    line naming the path, exit 1, no output."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"text": "1 2"}\n', encoding="utf-8")
    (tmp_path / "corpus" / "sub.jsonl").mkdir()
    given = {"directory": tmp_path / "corpus", "glob-with-directory": tmp_path / "corpus" / "*",
             "missing": tmp_path / "none.jsonl"}[case]
    expected = {"directory": f"{given}: {given} is a directory",
                "glob-with-directory": f"{given}: {tmp_path / 'corpus' / 'sub.jsonl'} is a "
                                       "directory",
                "missing": f"{given}: no such file"}[case]
    assert run(["--input", given, "--output-prefix", tmp_path / "o", "--tokenizer-type",
                "NullTokenizer", "--vocab-size", 10, "--workers", 1]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"preprocess_data.py: error: --input {expected}") and \
        err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["corpus"]


def test_untokenizable_text_names_line(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "1 2"}\n{"text": "1 x"}\n', encoding="utf-8")
    assert run(["--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "o",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", 10, "--workers", 1]) == 1
    assert "in.jsonl:2: key 'text' cannot be tokenized" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_progress_lines(tmp_path, capsys, gpt2_args, documents):
    src = write_jsonl(tmp_path / "in.jsonl", documents)
    assert run(["--input", src, "--output-prefix", tmp_path / "o", *gpt2_args, "--workers", 1,
                "--log-interval", 50]) == 0
    err = capsys.readouterr().err

    assert len(re.findall(r"Processed (50|100) documents \([\d.]+ docs/s, [\d.]+ MB/s\)\.", err)) == 2
    assert "Done: 120 documents" in err


def test_merge_datasets(tmp_path, gpt2_args, reference, documents):
    parts = tmp_path / "parts"
    parts.mkdir()
    for i, chunk in enumerate((documents[:10], documents[10:25], documents[25:30])):
        src = write_jsonl(tmp_path / f"in{i}.jsonl", chunk)
        assert run(["--input", src, "--output-prefix", parts / f"c{i}", *gpt2_args, "--append-eod",
                    "--workers", 1]) == 0
    assert merge_datasets.main(["--input", str(parts), "--output-prefix", str(tmp_path / "m")]) == 0
    expected = megatron_dataset_bytes(expected_docs(reference, documents[:30]), 8, "uint16")
    assert read(tmp_path / "m") == expected
    os.remove(parts / "c1_text_document.idx")
    assert merge_datasets.main(["--input", str(parts), "--output-prefix", str(tmp_path / "m2")]) == 1


def test_temporary_files_of_a_killed_run_are_removed_by_the_next(tmp_path):
    """Regression: ``kill -9`` leaves no cleanup to run, and its temporary output
    (6.4 MB in the report) stayed beside the prefix for good. The killed run reads a FIFO the
    test holds open, so the kill lands while its temporary files exist; the next run on the
    same prefix removes them, and leaves only its finished outputs."""
    import signal
    import subprocess
    import sys
    import time

    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    flags = ["--output-prefix", str(out / "corpus"), "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "100", "--workers", "1", "--partitions", "2"]
    killed = subprocess.Popen([sys.executable, preprocess_data.__file__, "--input", str(fifo),
                               *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with open(fifo, "w") as writer:  # blocks until the tool opens its input
            writer.write('{"text": "1 2 3"}\n')
            writer.flush()
            deadline = time.monotonic() + 120  # hang bound: a Python start-up on a busy machine
            while len([p for p in out.glob("*.tmp*")] if out.exists() else []) < 2:
                assert time.monotonic() < deadline and killed.poll() is None, "no temp file"
                time.sleep(0.05)
            killed.send_signal(signal.SIGKILL)
            killed.wait(timeout=60)
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    left = sorted(p.name for p in out.iterdir())
    assert left and all(".tmp" in name for name in left), left
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "4 5"}])
    assert run(["--input", src, *flags]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["corpus_text_document.bin",
                                                     "corpus_text_document.idx"]


def test_a_running_writers_temporary_files_are_left_alone(tmp_path):
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {f"x_text_document.tmp{os.getppid()}-part0.bin": True,  # a live writer: kept
             f"x_text_document.tmp{dead.pid}.idx": False,
             "x_text_document.bin": True, "y_text_document.tmp1.bin": True}  # not ours
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert preprocess_data.remove_interrupted_temps([str(tmp_path / "x_text_document")]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, kept in names.items()
                                                                 if kept)
