"""GPT2BPETokenizer ids equal the pure-Python reference BPE on real text."""

from __future__ import annotations

import json

import pytest

from bench.reference_gpt2 import ReferenceGPT2, byte_alphabet
from megatron.tokenizer.gpt2 import GPT2BPETokenizer, bytes_to_unicode


@pytest.fixture(scope="module")
def gpt2_files(shared_data):
    tok = shared_data / "tokenizers"
    return str(tok / "gpt2-vocab.json"), str(tok / "gpt2-merges.txt")


@pytest.fixture(scope="module")
def gpt2(gpt2_files):
    return GPT2BPETokenizer(*gpt2_files)


@pytest.fixture(scope="module")
def reference(gpt2_files):
    return ReferenceGPT2(*gpt2_files)


def test_vocab_and_eod(gpt2):
    assert gpt2.vocab_size == 50257
    assert gpt2.eod == 50256 == gpt2.vocab["<|endoftext|>"]
    assert gpt2.inv_vocab[50256] == "<|endoftext|>"


def test_byte_alphabet_matches_reference():
    assert bytes_to_unicode() == byte_alphabet()


def test_ids_equal_reference_on_corpus(gpt2, reference, corpus_texts):
    for text in corpus_texts:
        assert gpt2.tokenize(text) == reference.encode(text), text[:80]


def test_detokenize_round_trip(gpt2, reference, corpus_texts):
    for text in corpus_texts:
        ids = gpt2.tokenize(text)
        assert gpt2.detokenize(ids) == reference.decode(ids) == text


def test_special_string_is_plain_text(gpt2):
    # OpenAI's encoder (and Megatron's) never emits the EOD id from text.
    assert gpt2.eod not in gpt2.tokenize("a <|endoftext|> b")


def test_permuted_vocab_ids_are_mapped(tmp_path, gpt2_files, reference):
    """A vocab.json whose ids do not follow merge order (e.g. HF-trained) still gives its ids."""
    vocab_file, merge_file = gpt2_files
    vocab = json.loads(open(vocab_file, encoding="utf-8").read())
    shuffled = {t: (len(vocab) - 1 - i) for t, i in vocab.items()}  # reverse every id
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(shuffled), encoding="utf-8")
    tok = GPT2BPETokenizer(path, merge_file)
    text = "The quick brown fox's 12 jumps — naïve café!"
    expected = [len(vocab) - 1 - i for i in reference.encode(text)]
    assert tok.tokenize(text) == expected
    assert tok.tokenize_to_array(text).tolist() == expected
    assert tok.detokenize(expected) == text


def test_missing_eod_is_an_error(tmp_path, gpt2_files):
    vocab_file, merge_file = gpt2_files
    vocab = json.loads(open(vocab_file, encoding="utf-8").read())
    del vocab["<|endoftext|>"]
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ValueError, match="endoftext"):
        GPT2BPETokenizer(path, merge_file)


def _write_bpe(tmp_path, merges: list[tuple[str, str]]) -> tuple[str, str]:
    """A byte-level vocab.json + merges.txt: the 256 bytes, one id per new merge result, EOD."""
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


@pytest.mark.parametrize("merges, fast", [
    ([("a", "b"), ("ab", "c"), ("b", "c")], True),  # consistent: tiktoken kept
    # "abc": OpenAI merges (b, c) first and stops at [a, bc]; tiktoken merges a+bc -> abc
    ([("b", "c"), ("a", "b"), ("ab", "c")], False),
    ([("a", "b"), ("ab", "c"), ("b", "c"), ("a", "bc")], False),  # abc made twice
    ([("ab", "c"), ("a", "b")], False),  # "ab" used before a merge makes it
], ids=["consistent", "other-pair", "repeated-result", "order"])
def test_merges_that_are_not_rank_consistent(tmp_path, merges, fast):
    vocab_file, merge_file = _write_bpe(tmp_path, merges)
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    reference = ReferenceGPT2(vocab_file, merge_file)
    assert tok.uses_tiktoken is fast
    for text in ("abc", "xabcab abcbc cab", " abcabc\n\nbca  a b c ab bc"):
        assert tok.tokenize(text) == reference.encode(text), text
        assert tok.tokenize_to_array(text).tolist() == reference.encode(text)
        assert tok.detokenize(tok.tokenize(text)) == text


def test_gpt2_files_are_rank_consistent(gpt2):
    assert gpt2.uses_tiktoken  # the fast path: tiktoken
