"""tools/train_tokenizer.py writes tokenizers that our tokenizer classes load and round-trip."""

from __future__ import annotations

import json

import pytest

from megatron.tokenizer.gpt2 import GPT2BPETokenizer
from megatron.tokenizer.spm import SentencePieceTokenizer
from tests.tokenizer.reference_gpt2 import ReferenceGPT2
from tools import train_tokenizer


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory):
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000]
    path = tmp_path_factory.mktemp("corpus") / "train.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in text.split("\n\n")),
                    encoding="utf-8")
    return path, text


def test_bpe_round_trip(tmp_path, corpus):
    path, text = corpus
    assert train_tokenizer.main(["--input", str(path), "--vocab-size", "600", "--type", "bpe",
                                 "--output-dir", str(tmp_path)]) == 0
    vocab, merges = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.vocab_size == 600 and tok.eod == 599
    sample = text[:20_000] + " naïve café 😀"
    ids = tok.tokenize(sample)
    assert ids == ReferenceGPT2(vocab, merges).encode(sample)  # OpenAI's algorithm, our files
    assert tok.detokenize(ids) == sample
    assert len(ids) < len(sample.encode()) * 0.6  # the merges compress


def test_sentencepiece_round_trip(tmp_path, corpus):
    path, text = corpus
    assert train_tokenizer.main(["--input", str(path), "--vocab-size", "400", "--type",
                                 "sentencepiece", "--output-dir", str(tmp_path)]) == 0
    tok = SentencePieceTokenizer(tmp_path / "tokenizer.model")
    sample = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert tok.detokenize(tok.tokenize(sample)) == " ".join(sample.split())
    assert tok.vocab_size > 400  # Megatron's <CLS> <SEP> <EOD> <MASK> (+<PAD>) appended


def test_bad_line_is_reported(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"txt": "x"}\n', encoding="utf-8")
    assert train_tokenizer.main(["--input", str(path), "--vocab-size", "300",
                                 "--output-dir", str(tmp_path / "o")]) == 1
    assert "bad.jsonl:2: missing key 'text'" in capsys.readouterr().err
