"""HuggingFaceTokenizer on broken inputs: a truncated tokenizer.json, a SentencePiece model given
as one, an eos_token that is not in the vocabulary; each named with its file and
--tokenizer-model, and refused while the flags are validated (before any model is built)."""

from __future__ import annotations

import shutil

import pytest

from megatron.config import parse_args
from megatron.tokenizer.huggingface import HuggingFaceTokenizer


@pytest.fixture
def tokenizer_dir(shared_data, tmp_path):
    source = shared_data / "megatron_llama_v013" / "hf"
    if not source.is_dir():
        pytest.skip(f"{source} is absent")
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(source / name, out / name)
    return out


def test_a_truncated_tokenizer_json_is_named(tokenizer_dir):
    file = tokenizer_dir / "tokenizer.json"
    file.write_text(file.read_text()[:500])
    with pytest.raises(ValueError, match="--tokenizer-model: .*tokenizer.json is not a "
                                         "HuggingFace tokenizer.json") as err:
        HuggingFaceTokenizer(tokenizer_dir)
    assert str(file) in str(err.value) and "truncated or corrupt" in str(err.value)


def test_a_sentencepiece_model_given_as_tokenizer_json_is_named(shared_data, tmp_path):
    model = shared_data / "tokenizers" / "t5-spiece.model"
    if not model.is_file():
        pytest.skip(f"{model} is absent")
    with pytest.raises(ValueError, match="--tokenizer-type Llama2Tokenizer") as err:
        HuggingFaceTokenizer(model)
    assert str(model) in str(err.value) and "--tokenizer-model" in str(err.value)


def test_an_eos_token_missing_from_the_vocabulary_is_named(tokenizer_dir):
    config = tokenizer_dir / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"eos_token": "</s>"', '"eos_token": "<eos>"'))
    with pytest.raises(ValueError) as err:
        HuggingFaceTokenizer(tokenizer_dir)
    text = str(err.value)
    assert "eos_token '<eos>'" in text and str(config) in text and "not in the vocabulary" in \
        text, text


def test_training_flags_refuse_the_missing_eos_before_any_model(tokenizer_dir, capsys):
    config = tokenizer_dir / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"eos_token": "</s>"', '"eos_token": "<eos>"'))
    with pytest.raises(SystemExit) as exc:
        parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                    "--seq-length", "8", "--max-position-embeddings", "8",
                    "--micro-batch-size", "1", "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", str(tokenizer_dir)], world_size=1)
    assert exc.value.code == 2
    assert "eos_token '<eos>'" in capsys.readouterr().err
