"""tools/train_tokenizer.py writes tokenizers that our tokenizer classes load and round-trip."""

from __future__ import annotations

import json

import pytest

from bench.reference_gpt2 import ReferenceGPT2
from megatron.tokenizer.gpt2 import GPT2BPETokenizer
from megatron.tokenizer.spm import SentencePieceTokenizer
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


@pytest.fixture(scope="module")
def trained_2000(corpus, tmp_path_factory):
    path, _ = corpus
    out = tmp_path_factory.mktemp("bpe2000")
    assert train_tokenizer.main(["--input", str(path), "--vocab-size", "2000", "--type", "bpe",
                                 "--output-dir", str(out)]) == 0
    return str(out / "vocab.json"), str(out / "merges.txt")


@pytest.fixture(scope="module")
def other_text(shared_data):
    """200 KB of text the tokenizer was not trained on."""
    book = (shared_data / "corpus" / "gutenberg" / "pg1342-0.txt").read_text(encoding="utf-8")
    return book[100_000:300_000]


def test_trained_bpe_equals_reference_on_200kb(trained_2000, other_text):
    vocab, merges = trained_2000
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.uses_tiktoken  # train_tokenizer.py's merges are rank-consistent
    assert tok.tokenize(other_text) == ReferenceGPT2(vocab, merges).encode(other_text)


def test_reordered_merges_fall_back_to_exact_bpe(tmp_path, trained_2000, other_text):
    """Merges edited by hand (here: the first moved after 600 others) break tiktoken's
    ranking by merged token; the load-time check switches to pair-ranked BPE."""
    vocab, merges_file = trained_2000
    lines = open(merges_file, encoding="utf-8").read().split("\n")
    header, merges = lines[0], lines[1:-1]
    merges = merges[1:600] + merges[:1] + merges[600:]
    (tmp_path / "merges.txt").write_text("\n".join([header, *merges, ""]), encoding="utf-8")
    tok = GPT2BPETokenizer(vocab, tmp_path / "merges.txt")
    assert not tok.uses_tiktoken
    reference = ReferenceGPT2(vocab, str(tmp_path / "merges.txt")).encode(other_text)
    assert tok.tokenize(other_text) == reference
    ranks = tok._encoding.encode_ordinary(other_text)  # what tiktoken alone would give:
    assert tok._rank_to_id[ranks].tolist() != reference  # other ids
