"""tools/checkpoint: HuggingFace GPT-2 and MegatronBert export and import on tiny random models
built here (nothing downloaded): the exported model gives our logits (and, GPT, our greedy
text), an imported one gives its logits in our model, and ours -> HF -> ours is bitwise."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.tools.checkpoint import helpers
from tools.checkpoint import convert

transformers = pytest.importorskip("transformers")
LOGITS_TOL = 1e-4
GPT2_VOCAB = 50257


def _convert(src: Path, dst: Path, *flags: str, model_type: str = "GPT") -> Path:
    assert convert.main(["--model-type", model_type, "--load-dir", str(src), "--save-dir", str(dst),
                         *flags]) == 0
    return dst


def _our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions)


def _greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        nxt = _our_logits(model, ids)[:, -1, :GPT2_VOCAB].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.fixture(scope="module")
def gpt2_files(shared_data):
    tok = shared_data / "tokenizers"
    return tok / "gpt2-vocab.json", tok / "gpt2-merges.txt"


@pytest.mark.parametrize("untied", [False, True])
def test_export_gives_our_logits_and_greedy_text(tmp_path, gpt2_files, untied):
    vocab, merges = gpt2_files
    model = helpers.gpt(num_layers=2, vocab=50304, untie_embeddings_and_output_weights=untied)
    args = helpers.args_of(model, tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab),
                           merge_file=str(merges), make_vocab_size_divisible_by=128)
    helpers.save_single(tmp_path / "src", model, args)
    tp2 = _convert(tmp_path / "src", tmp_path / "tp2pp2", "--target-tensor-parallel-size", "2",
                   "--target-pipeline-parallel-size", "2")
    out = _convert(tp2, tmp_path / "hf", "--saver", "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == GPT2_VOCAB  # the padding rows dropped
    assert config["activation_function"] == "gelu_new"  # Megatron's fused (tanh) bias-GeLU
    assert (out / "model.safetensors").is_file()
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode("To be, or not to be: that is the question")])
    with torch.no_grad():
        theirs = hf(ids).logits
    ours = _our_logits(model, ids)[..., :GPT2_VOCAB]
    assert (ours - theirs).abs().max() <= LOGITS_TOL
    with torch.no_grad():
        generated = hf.generate(ids, max_new_tokens=8, do_sample=False,
                                attention_mask=torch.ones_like(ids), pad_token_id=50256)
    ours_text = tokenizer.decode(_greedy(model, ids, 8)[0])
    assert tokenizer.decode(generated[0]) == ours_text


def test_erf_gelu_maps_to_gelu(tmp_path):
    model = helpers.gpt(num_layers=2, bias_gelu_fusion=False)
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model, bias_gelu_fusion=False))
    out = _convert(tmp_path / "src", tmp_path / "hf", "--saver", "hf", "--keep-padded-vocab")
    assert json.loads((out / "config.json").read_text())["activation_function"] == "gelu"
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.randint(0, 255, (2, 9))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (_our_logits(model, ids) - theirs).abs().max() <= LOGITS_TOL


def _random_gpt2(directory: Path, activation: str = "gelu_new", tied: bool = True):
    torch.manual_seed(11)
    config = transformers.GPT2Config(vocab_size=300, n_positions=helpers.MAX_POSITIONS,
                                     n_embd=helpers.HIDDEN, n_layer=4, n_head=helpers.HEADS,
                                     activation_function=activation, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # GPT-2's init leaves biases and LayerNorms trivial: randomise all
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("activation,tied", [("gelu_new", True), ("gelu", False)])
def test_import_gives_the_hf_logits(tmp_path, activation, tied):
    hf = _random_gpt2(tmp_path / "hf", activation, tied)
    tp2 = _convert(tmp_path / "hf", tmp_path / "tp2pp2", "--loader", "hf",
                   "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    args = helpers.shards(tp2 / "iter_0000000")[(0, 0)]["args"]
    assert args.padded_vocab_size == 512  # 300 padded as Megatron pads: 128 x TP 2
    back = _convert(tp2, tmp_path / "tp1")
    sd = helpers.shards(back / "iter_0000000")[(0, 0)]
    ours = helpers.gpt(num_layers=4, vocab=512, untie_embeddings_and_output_weights=not tied,
                       bias_gelu_fusion=activation == "gelu_new")
    ours.load_state_dict(sd["model"])
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (_our_logits(ours, ids)[..., :300] - theirs).abs().max() <= LOGITS_TOL


def _as_weight_files(directory: Path, state: dict[str, torch.Tensor], layout: str) -> None:
    """``state`` as HF's Megatron converters write it (``pytorch_model.bin``, torch.save of the
    state dict) or as two shards with their ``*.index.json``."""
    from safetensors.torch import save_file
    state = {k: v.clone().contiguous() for k, v in state.items()}  # safetensors: no shared
    if layout == "bin":
        torch.save(state, directory / "pytorch_model.bin")
        return
    names = sorted(state)
    suffix, index = ("bin", "pytorch_model.bin.index.json") if layout == "bin-shards" else \
        ("safetensors", "model.safetensors.index.json")
    weight_map = {}
    for i, keys in enumerate([names[:len(names) // 2], names[len(names) // 2:]]):
        name = f"{'pytorch_model' if suffix == 'bin' else 'model'}-{i + 1:05d}-of-00002.{suffix}"
        part = {k: state[k] for k in keys}
        torch.save(part, directory / name) if suffix == "bin" else \
            save_file(part, str(directory / name))
        weight_map.update(dict.fromkeys(keys, name))
    (directory / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("layout", ["bin", "bin-shards", "safetensors-shards"])
def test_import_reads_pytorch_model_bin_and_sharded_indexes(tmp_path, layout):
    hf = _random_gpt2(tmp_path / "saved", tied=False)
    directory = tmp_path / layout
    hf.config.save_pretrained(directory)  # config.json only
    _as_weight_files(directory, hf.state_dict(), layout)
    out = _convert(directory, tmp_path / "tp1", "--loader", "hf")
    ours = helpers.gpt(num_layers=4, vocab=384, untie_embeddings_and_output_weights=True)
    ours.load_state_dict(helpers.shards(out / "iter_0000000")[(0, 0)]["model"])
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (_our_logits(ours, ids)[..., :300] - theirs).abs().max() <= LOGITS_TOL


def test_import_refuses_a_bin_that_would_run_code(tmp_path, capsys):
    hf = _random_gpt2(tmp_path / "saved")
    hf.config.save_pretrained(tmp_path / "bad")
    torch.save({"transformer.wte.weight": torch.zeros(2), "hook": os.system},
               tmp_path / "bad" / "pytorch_model.bin")
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--load-dir",
                         str(tmp_path / "bad"), "--save-dir", str(tmp_path / "out")]) == 2
    assert "pytorch_model.bin with torch.load(weights_only=True)" in capsys.readouterr().err


def test_missing_safetensors_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch):
    _random_gpt2(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bar
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails, as when not installed
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--load-dir",
                         str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pip install safetensors" in error, error


def test_round_trip_ours_hf_ours_is_bitwise(tmp_path):
    model = helpers.gpt(vocab=256)
    args = helpers.args_of(model, make_vocab_size_divisible_by=128)
    helpers.save_single(tmp_path / "src", model, args)
    hf = _convert(tmp_path / "src", tmp_path / "hf", "--saver", "hf", "--keep-padded-vocab")
    back = _convert(hf, tmp_path / "back", "--loader", "hf")
    source = helpers.flat_model(helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)])
    helpers.assert_same_tensors(
        source, helpers.flat_model(helpers.shards(back / "iter_0000000")[(0, 0)]))


def test_hf_export_refuses_what_gpt2_cannot_hold(tmp_path):
    model = helpers.gpt(num_layers=2)
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model, swiglu=True))
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "src"),
                         "--save-dir", str(tmp_path / "hf"), "--saver", "hf"]) == 2


def test_bert_export_import_gives_the_same_outputs(tmp_path):
    model = helpers.bert(num_layers=2, vocab=256, bias_gelu_fusion=False)
    args = helpers.args_of(model, bias_gelu_fusion=False, bert_binary_head=True,
                           make_vocab_size_divisible_by=128)
    helpers.save_single(tmp_path / "src", model, args)
    tp2 = _convert(tmp_path / "src", tmp_path / "tp2", "--target-tensor-parallel-size", "2",
                   model_type="BERT")
    out = _convert(tp2, tmp_path / "hf", "--saver", "hf", "--true-vocab-size", "255",
                   model_type="BERT")
    hf = transformers.MegatronBertForPreTraining.from_pretrained(out).eval()
    tokens = torch.randint(0, 255, (2, 12))
    types_ = torch.randint(0, 2, (2, 12))
    with torch.no_grad():
        ours_lm, ours_binary = model(tokens, torch.ones_like(tokens), types_)
        theirs = hf(tokens, token_type_ids=types_)
    assert (ours_lm[..., :255] - theirs.prediction_logits).abs().max() <= LOGITS_TOL
    assert (ours_binary - theirs.seq_relationship_logits).abs().max() <= LOGITS_TOL
    kept = _convert(tmp_path / "src", tmp_path / "hf_kept", "--saver", "hf",
                    "--keep-padded-vocab", model_type="BERT")
    back = _convert(kept, tmp_path / "back", "--loader", "hf", model_type="BERT")
    helpers.assert_same_tensors(
        helpers.flat_model(helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)]),
        helpers.flat_model(helpers.shards(back / "iter_0000000")[(0, 0)]))


def test_bert_with_two_gelu_forms_is_refused(tmp_path):
    model = helpers.bert(num_layers=2)
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model, bert_binary_head=True))
    assert convert.main(["--model-type", "BERT", "--load-dir", str(tmp_path / "src"),
                         "--save-dir", str(tmp_path / "hf"), "--saver", "hf"]) == 2


def test_post_ln_bert_exports_as_bert_for_pretraining_and_back(tmp_path):
    """--apply-residual-connection-post-layernorm (original BERT) -> BertForPreTraining, chosen
    from the checkpoint's args: its LayerNorms shift by one layer (hf_bert), the logits equal
    ours, and HF -> ours is bitwise."""
    model = helpers.bert(num_layers=3, vocab=256, bias_gelu_fusion=False,
                         apply_residual_connection_post_layernorm=True)
    args = helpers.args_of(model, bias_gelu_fusion=False, bert_binary_head=True,
                           make_vocab_size_divisible_by=128,
                           apply_residual_connection_post_layernorm=True)
    helpers.save_single(tmp_path / "src", model, args)
    tp2pp2 = _convert(tmp_path / "src", tmp_path / "tp2pp2", "--target-tensor-parallel-size", "2",
                      "--target-pipeline-parallel-size", "3", model_type="BERT")
    out = _convert(tp2pp2, tmp_path / "hf", "--saver", "hf", "--true-vocab-size", "255",
                   model_type="BERT")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bert" and config["architectures"] == ["BertForPreTraining"]
    hf = transformers.BertForPreTraining.from_pretrained(out).eval()
    tokens = torch.randint(0, 255, (2, 12))
    types_ = torch.randint(0, 2, (2, 12))
    padding = torch.ones_like(tokens)
    padding[1, 9:] = 0  # a padded sequence: the key masks must agree too
    with torch.no_grad():
        ours_lm, ours_binary = model(tokens, padding, types_)
        theirs = hf(tokens, attention_mask=padding, token_type_ids=types_)
    # At the real positions (padded query rows differ by design: Megatron's mask hides every
    # key from them, HF's only the padded keys; neither is ever predicted).
    real = padding.bool()
    assert (ours_lm[..., :255][real] - theirs.prediction_logits[real]).abs().max() <= LOGITS_TOL
    assert (ours_binary - theirs.seq_relationship_logits).abs().max() <= LOGITS_TOL
    kept = _convert(tmp_path / "src", tmp_path / "hf_kept", "--saver", "hf",
                    "--keep-padded-vocab", model_type="BERT")
    back = _convert(kept, tmp_path / "back", "--loader", "hf", model_type="BERT")
    back_sd = helpers.shards(back / "iter_0000000")[(0, 0)]
    assert back_sd["args"].apply_residual_connection_post_layernorm
    helpers.assert_same_tensors(
        helpers.flat_model(helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)]),
        helpers.flat_model(back_sd))


@pytest.mark.parametrize("post_ln, asked", [(False, "BertForPreTraining"),
                                            (True, "MegatronBertForPreTraining")])
def test_impossible_hf_bert_architecture_names_the_flag(tmp_path, capsys, post_ln, asked):
    model = helpers.bert(num_layers=2, bias_gelu_fusion=False,
                         apply_residual_connection_post_layernorm=post_ln)
    helpers.save_single(tmp_path / "src", model, helpers.args_of(
        model, bias_gelu_fusion=False, bert_binary_head=True,
        apply_residual_connection_post_layernorm=post_ln))
    assert convert.main(["--model-type", "BERT", "--load-dir", str(tmp_path / "src"),
                         "--save-dir", str(tmp_path / "hf"), "--saver", "hf",
                         "--hf-architecture", asked]) == 2
    error = capsys.readouterr().err
    assert "--apply-residual-connection-post-layernorm" in error and asked in error
    assert not (tmp_path / "hf").exists()  # refused before anything is written
