"""build_tokenizer, the padded vocabulary rule, SentencePiece, HuggingFace and Null tokenizers."""

from __future__ import annotations

import json

import pytest
import sentencepiece

from megatron.tokenizer.config import TokenizerConfig
from megatron.tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.tokenizer.huggingface import HuggingFaceTokenizer
from megatron.tokenizer.null import NullTokenizer


@pytest.mark.parametrize("orig, divisible, tp, padded", [
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (30524, 128, 1, 30592),
    (50304, 128, 1, 50304), (32005, 128, 8, 32768), (100, 1, 1, 100)])
def test_vocab_size_with_padding(orig, divisible, tp, padded):
    assert vocab_size_with_padding(orig, divisible, tp) == padded


def test_build_tokenizer_sets_padded_size(shared_data):
    tok = shared_data / "tokenizers"
    cfg = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tok / "gpt2-vocab.json"),
                          merge_file=str(tok / "gpt2-merges.txt"))
    assert build_tokenizer(cfg).padded_vocab_size == 50304
    assert build_tokenizer(cfg, tensor_model_parallel_size=2).padded_vocab_size == 50432


def test_build_tokenizer_errors():
    with pytest.raises(ValueError, match="needs --merge-file"):
        build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json"))
    with pytest.raises(ValueError, match="not supported"):
        build_tokenizer(TokenizerConfig(tokenizer_type="Nope"))


def test_sentencepiece_matches_library_and_megatron_specials(shared_data, corpus_texts):
    model = str(shared_data / "tokenizers" / "t5-spiece.model")
    cfg = TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)
    tok = build_tokenizer(cfg)
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    for text in corpus_texts[:8]:
        if not any(s in text for s in ("<CLS>", "<SEP>", "<EOD>", "<MASK>", "<pad>", "</s>")):
            assert tok.tokenize(text) == sp.encode_as_ids(text)
    # T5's model has <pad> 0 and </s> 1 and no bos; Megatron appends the rest after 32000.
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad, tok.eos) == (32000, 32001, 32002, 32003, 0, 1)
    assert tok.vocab_size == 32005 and tok.inv_vocab[32004] == "<BOS>"
    text = "a<SEP>b </s> c<EOD>"
    expected = (sp.encode_as_ids("a") + [32001] + sp.encode_as_ids("b ") + [1]
                + sp.encode_as_ids(" c") + [32002])
    assert tok.tokenize(text) == expected
    gpt = build_tokenizer(TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer",
                                          tokenizer_model=model))
    assert gpt.eod == 1 and gpt.tokenize(text) == sp.encode_as_ids(text)


def test_huggingface_tokenizer_json(tmp_path, shared_data):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = json.loads((shared_data / "tokenizers" / "gpt2-vocab.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in (shared_data / "tokenizers" / "gpt2-merges.txt")
              .read_text(encoding="utf-8").split("\n")[1:-1]]
    hf = Tokenizer(models.BPE(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    tok = HuggingFaceTokenizer(tmp_path)
    assert tok.vocab_size == 50257 and tok.eod == 50256
    assert tok.tokenize("Hello world") == [15496, 995]
    with pytest.raises(ValueError, match="no tokenizer.json"):
        HuggingFaceTokenizer(tmp_path / "missing")


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("5 6 7") == [5, 6, 7] and tok.tokenize("") == []
    assert tok.detokenize([5, 6]) == "5 6"
    with pytest.raises(NotImplementedError, match="NullTokenizer"):
        tok.vocab  # noqa: B018


def _tiny_sentencepiece(path, corpus_texts) -> str:
    """A small BPE SentencePiece model trained here, with Llama's unk/bos/eos ids 0/1/2."""
    import io
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_texts[:200]), model_writer=model, vocab_size=300,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    path.write_bytes(model.getvalue())
    return str(path)


def test_llama2_tokenizer_prepends_bos_and_ends_with_eos(tmp_path, corpus_texts):
    model = _tiny_sentencepiece(tmp_path / "tokenizer.model", corpus_texts)
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="Llama2Tokenizer",
                                          tokenizer_model=model))
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    text = "The quick brown fox."
    assert tok.tokenize(text) == [1] + sp.encode_as_ids(text)  # Megatron: bos=True, eos=False
    assert (tok.bos, tok.eod, tok.eos, tok.vocab_size) == (1, 2, 2, 300)
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.padded_vocab_size == 384
    with pytest.raises(ValueError, match="--tokenizer-model .* does not exist"):
        build_tokenizer(TokenizerConfig(tokenizer_type="Llama2Tokenizer",
                                        tokenizer_model=str(tmp_path / "missing.model")))
