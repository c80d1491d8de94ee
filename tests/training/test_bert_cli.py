"""``pretrain_bert.py`` as users run it: one CLI smoke run on a real sentence-split
dataset (a slice of the shared corpus through ``preprocess_data.py --split-sentences`` with the
WordPiece vocabulary), and the script's own flag handling (Megatron's default tokenizer, the
BERT flag checks that exit before any process group starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pretrain_bert

REPO = Path(__file__).resolve().parents[2]
_SLICE_CHARS = 120_000


@pytest.fixture(scope="module")
def bert_corpus(shared_data, tmp_path_factory) -> tuple[str, str]:
    """(dataset prefix, vocab file): the start of a Gutenberg novel, documents of a few
    paragraphs, split into sentences and tokenized with bert-base-uncased's vocabulary."""
    from tools import preprocess_data

    vocab = shared_data / "tokenizers" / "bert-base-uncased-vocab.txt"
    book = sorted((shared_data / "corpus" / "gutenberg").glob("*.txt"))[0]
    text = book.read_text(encoding="utf-8", errors="replace")[:_SLICE_CHARS]
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    docs = [" ".join(paragraphs[i:i + 6]) for i in range(0, len(paragraphs), 6)]
    out = tmp_path_factory.mktemp("bert_corpus")
    src = out / "book.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(out / "book"),
                               "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                               str(vocab), "--split-sentences", "--workers", "1"])
    assert rc == 0, f"preprocess_data exited {rc}"
    return str(out / "book_text_sentence"), str(vocab)


def _tiny_argv(prefix: str, vocab: str, extra: list[str] = ()) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-4",
            "--data-path", prefix, "--vocab-file", vocab, "--split", "90,10,0",
            "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "3",
            "--num-workers", "0", "--distributed-backend", "gloo", *extra]


def test_pretrain_bert_cli_trains_and_saves(bert_corpus, tmp_path):
    """The real script, one process, as ``python pretrain_bert.py ...`` (no --tokenizer-type:
    Megatron's BertWordPieceLowerCase default)."""
    prefix, vocab = bert_corpus
    save = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    argv = _tiny_argv(prefix, vocab, ["--save", str(save), "--save-interval", "3",
                                      "--data-cache-path", str(tmp_path / "cache")])
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_bert.py"), *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    train_lines = [line for line in out.splitlines() if line.startswith(" iteration ")]
    assert len(train_lines) == 3, out[-4000:]
    assert all("lm loss:" in line and "sop loss:" in line for line in train_lines)
    assert "> building BertWordPieceLowerCase tokenizer" in out, out[:2000]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert "validation loss at iteration 3" in out and "sop loss value" in out


def test_default_tokenizer_is_megatrons():
    argv = pretrain_bert.with_default_tokenizer(["--vocab-file", "v.txt"])
    assert argv[-2:] == ["--tokenizer-type", "BertWordPieceLowerCase"]
    given = ["--vocab-file=v.txt", "--tokenizer-type", "BertWordPieceCase"]
    assert pretrain_bert.with_default_tokenizer(given) == given
    assert pretrain_bert.with_default_tokenizer(["--mock-data"]) == ["--mock-data"]


@pytest.mark.parametrize("extra, message", [
    (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights"),
    (["--reset-position-ids"], "--reset-position-ids is a GPT dataset flag"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "m.txt"],
     "--tokenizer-type GPT2BPETokenizer: BERT needs a WordPiece vocabulary"),
    (["--num-experts", "4", "--ckpt-format", "torch_dist", "--save", "ckpt"],
     "--ckpt-format torch_dist with BERT and --num-experts"),
])
def test_bert_flag_errors_exit_early(extra, message, capsys):
    argv = pretrain_bert.with_default_tokenizer(
        _tiny_argv("no/such/prefix", "no/such/vocab.txt", extra))
    with pytest.raises(SystemExit) as exit_info:
        pretrain_bert.check_flags(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
