"""Every tokenizer's ``unique_identifiers`` are Megatron-Core's (``MegatronTokenizer.__init__``:
the class name, the ``tokenizer_path`` list as given, the options as strings), so the dataset
cache descriptions (and their md5 file names) are byte-identical to Megatron-Core's."""

from __future__ import annotations

import json

import pytest

from megatron.data.megatron_dataset import describe
from megatron.tokenizer import TokenizerConfig, create_tokenizer


def _tokenizer(**flags):
    return create_tokenizer(TokenizerConfig(**flags))


def test_gpt2_bpe_identifiers_and_description_text(shared_data):
    vocab = str(shared_data / "tokenizers" / "gpt2-vocab.json")
    merges = str(shared_data / "tokenizers" / "gpt2-merges.txt")
    tok = _tokenizer(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert tok.unique_identifiers == {"class": "_GPT2BPETokenizer",
                                      "tokenizer_path": [vocab, merges]}
    # The entry as Megatron-Core's json.dumps(..., indent=4) writes it inside description.txt.
    text = json.dumps({"random_seed": 1234, "tokenizer": tok}, indent=4, default=describe)
    assert text == ('{\n    "random_seed": 1234,\n    "tokenizer": {\n'
                    '        "class": "_GPT2BPETokenizer",\n        "tokenizer_path": [\n'
                    f'            "{vocab}",\n            "{merges}"\n        ]\n    }}\n}}')


@pytest.mark.parametrize("lower", [True, False])
def test_bert_identifiers(shared_data, lower):
    name = "bert-base-uncased-vocab.txt" if lower else "bert-base-cased-vocab.txt"
    vocab = str(shared_data / "tokenizers" / name)
    kind = "BertWordPieceLowerCase" if lower else "BertWordPieceCase"
    tok = _tokenizer(tokenizer_type=kind, vocab_file=vocab)
    assert tok.unique_identifiers == {"class": "_BertWordPieceTokenizer",
                                      "tokenizer_path": [vocab], "lower_case": str(lower),
                                      "vocab_extra_ids": "0"}


def test_sentencepiece_identifiers(shared_data):
    model = str(shared_data / "tokenizers" / "t5-spiece.model")
    tok = _tokenizer(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model,
                     vocab_extra_ids=3)
    assert tok.unique_identifiers == {"class": "_SentencePieceTokenizer",
                                      "tokenizer_path": [model], "vocab_extra_ids": "3"}
    gpt = _tokenizer(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model)
    assert gpt.unique_identifiers == {"class": "_GPTSentencePieceTokenizer",
                                      "tokenizer_path": [model], "vocab_extra_ids": "0"}


def test_null_tokenizer_identifiers():
    tok = _tokenizer(tokenizer_type="NullTokenizer", vocab_size=500)
    assert tok.unique_identifiers == {"class": "_NullTokenizer", "tokenizer_path": [None],
                                      "vocab_size": "500"}
