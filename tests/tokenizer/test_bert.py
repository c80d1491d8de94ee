"""BERT WordPiece ids equal the pure-Python reference (Google's algorithm) on real text."""

from __future__ import annotations

import pytest

from megatron.tokenizer.bert import BertWordPieceTokenizer
from tests.tokenizer.reference_bert import ReferenceBert


@pytest.fixture(scope="module", params=[True, False], ids=["lower", "cased"])
def pair(request, shared_data):
    lower = request.param
    name = "bert-base-uncased-vocab.txt" if lower else "bert-base-cased-vocab.txt"
    path = str(shared_data / "tokenizers" / name)
    return BertWordPieceTokenizer(path, lower_case=lower), ReferenceBert(path, lower)


def test_ids_equal_reference_on_corpus(pair, corpus_texts):
    fast, reference = pair
    for text in corpus_texts:
        assert fast.tokenize(text) == reference.tokenize(text), text[:80]
    assert fast.tokenize_batch(corpus_texts[:3]) == [fast.tokenize(t) for t in corpus_texts[:3]]


def test_megatron_special_ids(shared_data):
    tok = BertWordPieceTokenizer(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt")
    # FORMATS.md 2c: [BOS] and [EOS] are appended; eod is [EOS].
    assert tok.vocab_size == 30524
    assert (tok.cls, tok.sep, tok.mask, tok.pad, tok.eod) == (101, 102, 103, 0, 30523)
    assert tok.bos_token_id == 30522 and tok.inv_vocab[30523] == "[EOS]"


def test_extra_ids(shared_data):
    tok = BertWordPieceTokenizer(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt",
                                 vocab_extra_ids=3)
    assert tok.vocab_size == 30527
    assert tok.additional_special_tokens_ids == [30524, 30525, 30526]


def test_detokenize_glues_word_pieces(shared_data):
    tok = BertWordPieceTokenizer(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt")
    assert tok.detokenize(tok.tokenize("Unaffable tokenization, sir!")) == "unaffable tokenization , sir !"


def test_missing_special_is_an_error(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\nhello\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"\[CLS\]"):
        BertWordPieceTokenizer(path)
