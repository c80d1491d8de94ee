"""tools/checkpoint: the config.json of a Llama / Qwen export reads the same in every reader
(transformers 5's ``rope_parameters`` and the top-level ``rope_theta`` / ``rope_scaling`` /
``torch_dtype`` transformers 4.x reads), keeps the imported model's bos/eos, and HF -> ours ->
TP 2 -> TP 1 -> HF is bitwise with the true vocabulary (``args.true_vocab_size`` kept through
every conversion, so the export drops exactly the rows padding added)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.tools.checkpoint import helpers
from tools.checkpoint import convert

transformers = pytest.importorskip("transformers")

# What transformers 4.x's LlamaConfig / Qwen2Config read from config.json (4.40 - 4.57): a
# missing one silently takes its default (rope_theta 10000, bos 1, eos 2...).
KEYS_4X_READS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "hidden_act",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                 "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id", "torch_dtype")


def _convert(src: Path, dst: Path, *flags: str) -> Path:
    assert convert.main(["--model-type", "GPT", "--load-dir", str(src), "--save-dir", str(dst),
                         *flags]) == 0
    return dst


def _random_hf(directory: Path, vocab: int, qwen2: bool = False):
    torch.manual_seed(5)
    kind = transformers.Qwen2Config if qwen2 else transformers.LlamaConfig
    config = kind(vocab_size=vocab, hidden_size=helpers.HIDDEN, intermediate_size=24,
                  num_hidden_layers=2, num_attention_heads=helpers.HEADS, num_key_value_heads=2,
                  max_position_embeddings=helpers.MAX_POSITIONS, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = (transformers.Qwen2ForCausalLM if qwen2 else transformers.LlamaForCausalLM)(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.eval().save_pretrained(directory)
    return model


@pytest.mark.parametrize("qwen2", [False, True])
def test_export_config_is_read_alike_by_transformers_4_and_5(tmp_path, qwen2):
    _random_hf(tmp_path / "hf", 300, qwen2)
    ours = _convert(tmp_path / "hf", tmp_path / "ours", "--loader", "hf")
    out = _convert(ours, tmp_path / "back", "--saver", "hf")
    config = json.loads((out / "config.json").read_text())
    missing = [key for key in KEYS_4X_READS if key not in config]
    assert not missing, missing
    assert config["rope_theta"] == 500000.0 and config["rope_scaling"] is None
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "float32"
    read = transformers.AutoConfig.from_pretrained(out)  # the installed transformers
    assert read.rope_parameters["rope_theta"] == 500000.0
    assert (read.bos_token_id, read.eos_token_id, read.vocab_size) == (1, 2, 300)


def test_export_takes_bos_and_eos_from_the_exported_tokenizer(tmp_path):
    """The tokenizer that goes with the export names them (its ids win over recorded ones)."""
    from tokenizers import Tokenizer, models

    _random_hf(tmp_path / "hf", 300)
    ours = _convert(tmp_path / "hf", tmp_path / "ours", "--loader", "hf")
    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {"<unk>": 0, "<eos>": 3, "<bos>": 4, **{f"w{i}": i for i in (1, 2)},
             **{f"w{i}": i for i in range(5, 300)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text('{"eos_token": "<eos>", "bos_token": "<bos>"}')
    out = _convert(ours, tmp_path / "back", "--saver", "hf", "--tokenizer-dir", str(tok))
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (4, 3)


def test_true_vocabulary_survives_every_conversion_and_the_export_is_bitwise(tmp_path):
    """vocab 50304 -> TP 2 pads to 50432 -> TP 1 keeps 50432 rows -> HF: 50304 rows again."""
    from safetensors.torch import load_file

    _random_hf(tmp_path / "hf", 50304)
    tp2 = _convert(tmp_path / "hf", tmp_path / "tp2", "--loader", "hf",
                   "--target-tensor-parallel-size", "2")
    tp1 = _convert(tp2, tmp_path / "tp1")
    for ckpt in (tp2, tp1):
        args = helpers.shards(ckpt / "iter_0000000")[(0, 0)]["args"]
        assert (args.padded_vocab_size, args.true_vocab_size) == (50432, 50304)
    out = _convert(tp1, tmp_path / "back", "--saver", "hf")
    first, second = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "hf", out))
    helpers.assert_same_tensors(dict(sorted(first.items())), dict(sorted(second.items())))
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == \
        (50304, 1, 2)


def test_a_tp_change_names_the_divisor_that_loads_it(tmp_path, caplog):
    """TP 1 (50304 rows: GPT-2 padded by 128) -> TP 2 keeps 50304 rows, which the default 128
    x 2 would pad to 50432: the converter names --make-vocab-size-divisible-by 64, and a TP 2
    run passing it pads the tokenizer's vocabulary to exactly the checkpoint's rows."""
    from megatron.tokenizer import vocab_size_with_padding

    model = helpers.gpt(num_layers=2, vocab=50304)
    helpers.save_single(tmp_path / "src", model, helpers.args_of(
        model, make_vocab_size_divisible_by=128))
    with caplog.at_level("WARNING"):
        tp2 = _convert(tmp_path / "src", tmp_path / "tp2", "--target-tensor-parallel-size", "2")
    said = [r.getMessage() for r in caplog.records if "make-vocab-size-divisible-by 64" in
            r.getMessage()]
    assert len(said) == 1 and "--use-checkpoint-args" in said[0], caplog.text
    args = helpers.shards(tp2 / "iter_0000007")[(0, 0)]["args"]
    assert args.padded_vocab_size == vocab_size_with_padding(50257, 64, 2) == 50304
