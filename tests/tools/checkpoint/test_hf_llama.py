"""tools/checkpoint: HuggingFace ``LlamaForCausalLM`` (and Qwen2's q/k/v bias) import and
export on tiny random models made here from a config (nothing downloaded): an imported model
gives HF's logits (fp32, 1e-5) and greedy text in ours, ours -> HF gives ours, and HF -> ours ->
HF and ours -> HF -> ours are bitwise, through TP 2 (SwiGLU re-split, whole GQA groups)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.tools.checkpoint import helpers
from tools.checkpoint import convert

transformers = pytest.importorskip("transformers")
TOL = 1e-5
VOCAB = 300
FFN = 24


def _convert(src: Path, dst: Path, *flags: str) -> Path:
    assert convert.main(["--model-type", "GPT", "--load-dir", str(src), "--save-dir", str(dst),
                         *flags]) == 0
    return dst


def _ours(vocab: int, groups: int = 2, untied: bool = True, qkv_bias: bool = False,
          interleaved: bool = False, theta: int = 10000, qk_norm: bool = False):
    return helpers.gpt(num_layers=2, vocab=vocab, normalization="RMSNorm",
                       position_embedding_type="rope", num_query_groups=groups,
                       add_bias_linear=False, add_qkv_bias=qkv_bias, swiglu=True,
                       ffn_hidden_size=FFN, untie_embeddings_and_output_weights=untied,
                       layernorm_epsilon=1e-6, rotary_base=theta,
                       rotary_interleaved=interleaved, qk_layernorm=qk_norm)


def _our_args(model, **extra):
    c = model.config
    values = dict(add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
                  swiglu=True, group_query_attention=True, num_query_groups=c.num_query_groups,
                  add_qkv_bias=c.add_qkv_bias, qk_layernorm=c.qk_layernorm,
                  layernorm_epsilon=1e-6,
                  rotary_base=c.rotary_base, rotary_interleaved=c.rotary_interleaved,
                  make_vocab_size_divisible_by=128)
    return helpers.args_of(model, **{**values, **extra})


def _random_hf(directory: Path, qwen2: bool = False, tied: bool = False):
    torch.manual_seed(5)
    kind = transformers.Qwen2Config if qwen2 else transformers.LlamaConfig
    config = kind(vocab_size=VOCAB, hidden_size=helpers.HIDDEN, intermediate_size=FFN,
                  num_hidden_layers=2, num_attention_heads=helpers.HEADS, num_key_value_heads=2,
                  max_position_embeddings=helpers.MAX_POSITIONS, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                  tie_word_embeddings=tied)
    model = (transformers.Qwen2ForCausalLM if qwen2 else transformers.LlamaForCausalLM)(config)
    with torch.no_grad():  # the init leaves the norms at one and the biases at zero
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.eval().save_pretrained(directory)
    return model


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions)


def _greedy(model, ids: torch.Tensor, steps: int, vocab: int) -> torch.Tensor:
    for _ in range(steps):
        nxt = _logits(model, ids)[:, -1, :vocab].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("qwen2,tied", [(False, False), (True, True)])
def test_import_gives_the_hf_logits_and_greedy_text(tmp_path, qwen2, tied):
    hf = _random_hf(tmp_path / "hf", qwen2, tied)
    tp2 = _convert(tmp_path / "hf", tmp_path / "tp2", "--loader", "hf",
                   "--target-tensor-parallel-size", "2")
    back = _convert(tp2, tmp_path / "tp1")
    sd = helpers.shards(back / "iter_0000000")[(0, 0)]
    args = sd["args"]
    assert (args.position_embedding_type, args.normalization, args.swiglu,
            args.num_query_groups, args.rotary_base) == ("rope", "RMSNorm", True, 2, 500000)
    ours = _ours(args.padded_vocab_size, untied=not tied, qkv_bias=qwen2, theta=500000)
    ours.load_state_dict(sd["model"])
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (_logits(ours, ids)[..., :VOCAB] - theirs).abs().max() <= TOL
    prompt = ids[:1, :4]
    generated = hf.generate(prompt, max_new_tokens=8, do_sample=False,
                            attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(_greedy(ours, prompt, 8, VOCAB), generated)


def _tokenizer_json(directory: Path) -> None:
    """A word-level tokenizer.json of VOCAB tokens (its size tells the export the true vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "</s>", "bos_token": "<s>"}')


def test_hf_to_ours_to_hf_is_bitwise(tmp_path):
    _random_hf(tmp_path / "hf")
    _tokenizer_json(tmp_path / "hf")
    tp2 = _convert(tmp_path / "hf", tmp_path / "tp2", "--loader", "hf",
                   "--target-tensor-parallel-size", "2")
    args = helpers.shards(tp2 / "iter_0000000")[(0, 0)]["args"]
    assert (args.tokenizer_type, args.tokenizer_model) == ("HuggingFaceTokenizer",
                                                           str((tmp_path / "hf").resolve()))
    out = _convert(tp2, tmp_path / "hf2", "--saver", "hf")  # the tokenizer's 300 rows
    assert (out / "tokenizer.json").is_file()
    from safetensors.torch import load_file
    first, second = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "hf", out))
    helpers.assert_same_tensors(dict(sorted(first.items())), dict(sorted(second.items())))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2


@pytest.mark.parametrize("interleaved", [False, True])
def test_export_gives_our_logits(tmp_path, interleaved):
    """--rotary-interleaved exports with each head's q/k rows permuted to HF's halves."""
    model = _ours(384, interleaved=interleaved)
    helpers.save_single(tmp_path / "src", model, _our_args(model))
    out = _convert(tmp_path / "src", tmp_path / "hf", "--saver", "hf", "--true-vocab-size",
                   str(VOCAB))
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (_logits(model, ids)[..., :VOCAB] - theirs).abs().max() <= TOL


def test_ours_to_hf_to_ours_is_bitwise_through_tp2(tmp_path):
    model = _ours(256, qkv_bias=True)
    helpers.save_single(tmp_path / "src", model, _our_args(model))
    tp2 = _convert(tmp_path / "src", tmp_path / "tp2", "--target-tensor-parallel-size", "2")
    hf = _convert(tp2, tmp_path / "hf", "--saver", "hf", "--keep-padded-vocab")
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    back = _convert(hf, tmp_path / "back", "--loader", "hf")
    source = helpers.flat_model(helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)])
    helpers.assert_same_tensors(
        source, helpers.flat_model(helpers.shards(back / "iter_0000000")[(0, 0)]))


@pytest.mark.parametrize("extra, flag", [
    ({"rotary_percent": 0.5}, "--rotary-percent"),
    ({"add_bias_linear": True}, "--disable-bias-linear"),
    ({"position_embedding_type": "learned_absolute"}, "rope")])
def test_export_refuses_what_llama_cannot_hold(tmp_path, capsys, extra, flag):
    model = _ours(256)
    helpers.save_single(tmp_path / "src", model, _our_args(model, **extra))
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "src"),
                         "--save-dir", str(tmp_path / "hf"), "--saver", "hf"]) == 2
    assert flag in capsys.readouterr().err


def _perturbed_qk_norms(model):
    with torch.no_grad():  # the init leaves them at one: a mix-up of q and k would not show
        for name, param in model.named_parameters():
            if "_layernorm" in name:
                param.add_(0.5 * torch.randn(param.shape, dtype=param.dtype))
    return model


@pytest.mark.parametrize("interleaved", [False, True])
def test_qk_layernorm_exports_as_qwen3(tmp_path, interleaved):
    """--qk-layernorm is Qwen3's q_norm / k_norm: our logits from HF, and back bitwise."""
    model = _perturbed_qk_norms(_ours(384, interleaved=interleaved, qk_norm=True))
    helpers.save_single(tmp_path / "src", model, _our_args(model))
    out = _convert(tmp_path / "src", tmp_path / "hf", "--saver", "hf", "--true-vocab-size",
                   str(VOCAB))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    hf = transformers.Qwen3ForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (_logits(model, ids)[..., :VOCAB] - theirs).abs().max() <= TOL
    if interleaved:
        return  # imports back as a non-interleaved model (permuted rows): not bitwise
    back = _convert(_convert(out, tmp_path / "tp2", "--loader", "hf",
                             "--target-tensor-parallel-size", "2"), tmp_path / "tp1")
    sd = helpers.shards(back / "iter_0000000")[(0, 0)]
    assert sd["args"].qk_layernorm
    source = helpers.flat_model(helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)])
    # The vocabulary rows past the true 300 come back as fresh padding: compare the real ones.
    helpers.assert_same_tensors({k: v[:VOCAB] for k, v in source.items()},
                                {k: v[:VOCAB] for k, v in helpers.flat_model(sd).items()})


def test_qk_layernorm_with_qkv_bias_is_refused(tmp_path, capsys):
    model = _ours(256, qkv_bias=True, qk_norm=True)
    helpers.save_single(tmp_path / "src", model, _our_args(model))
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "src"),
                         "--save-dir", str(tmp_path / "hf"), "--saver", "hf"]) == 2
    assert "--qk-layernorm with --add-qkv-bias" in capsys.readouterr().err


WINDOW = 8
"""The tiny Mistral's sliding window: shorter than its 32 positions, so that it matters."""


def _random_mistral(directory: Path):
    torch.manual_seed(6)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=helpers.HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=helpers.HEADS, num_key_value_heads=2,
        max_position_embeddings=helpers.MAX_POSITIONS, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sliding_window=WINDOW, tie_word_embeddings=False)
    model = transformers.MistralForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.eval().save_pretrained(directory)
    return model


def _warnings(records, text: str) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING
            and text in r.getMessage()]


def test_mistral_import_is_exact_inside_its_window(tmp_path, megatron_log):
    """Mistral's weights are Llama's; its sliding window is dropped (Megatron attends to the
    whole sequence, as Megatron-LM's loader does): HF's logits inside the window, not past it.
    The import says so, records the window and keeps seq_length within it."""
    hf = _random_mistral(tmp_path / "hf")
    tp2 = _convert(tmp_path / "hf", tmp_path / "tp2", "--loader", "hf",
                   "--target-tensor-parallel-size", "2")
    said = _warnings(megatron_log, "sliding window of 8 tokens")
    assert len(said) == 1 and "--seq-length <= 8" in said[0], said
    back = _convert(tp2, tmp_path / "tp1")
    sd = helpers.shards(back / "iter_0000000")[(0, 0)]
    args = sd["args"]
    assert (args.sliding_window, args.seq_length, args.max_position_embeddings) == (
        WINDOW, WINDOW, helpers.MAX_POSITIONS)
    ours = _ours(args.padded_vocab_size)
    ours.load_state_dict(sd["model"])
    ids = torch.randint(0, VOCAB, (2, 2 * WINDOW))
    with torch.no_grad():
        theirs = hf(ids).logits
    mine = _logits(ours, ids)[..., :VOCAB]
    assert (mine[:, :WINDOW] - theirs[:, :WINDOW]).abs().max() <= TOL
    assert (mine[:, WINDOW:] - theirs[:, WINDOW:]).abs().max() > 1e-2  # the window matters


def test_mistral_exports_back_with_its_window(tmp_path):
    """HF -> ours (TP 2) -> HF: MistralForCausalLM with the same window, weights bitwise; as
    --hf-architecture LlamaForCausalLM it is the whole-sequence model Megatron computes."""
    hf = _random_mistral(tmp_path / "hf")
    tp2 = _convert(tmp_path / "hf", tmp_path / "tp2", "--loader", "hf",
                   "--target-tensor-parallel-size", "2")
    out = _convert(tp2, tmp_path / "hf2", "--saver", "hf", "--true-vocab-size", str(VOCAB))
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"]) == (["MistralForCausalLM"], WINDOW)
    from safetensors.torch import load_file
    first, second = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "hf", out))
    helpers.assert_same_tensors(dict(sorted(first.items())), dict(sorted(second.items())))
    ids = torch.randint(0, VOCAB, (2, 2 * WINDOW))
    exported = transformers.MistralForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, hf(ids).logits)
    llama = _convert(tp2, tmp_path / "llama", "--saver", "hf", "--true-vocab-size",
                     str(VOCAB), "--hf-architecture", "LlamaForCausalLM")
    sd = helpers.shards(_convert(tp2, tmp_path / "tp1") / "iter_0000000")[(0, 0)]
    ours = _ours(sd["args"].padded_vocab_size)
    ours.load_state_dict(sd["model"])
    with torch.no_grad():
        theirs = transformers.LlamaForCausalLM.from_pretrained(llama).eval()(ids).logits
    assert (_logits(ours, ids)[..., :VOCAB] - theirs).abs().max() <= TOL


def test_a_llama_style_model_exports_as_mistral_without_a_window(tmp_path, capsys):
    model = _ours(384)
    helpers.save_single(tmp_path / "src", model, _our_args(model))
    out = _convert(tmp_path / "src", tmp_path / "hf", "--saver", "hf", "--true-vocab-size",
                   str(VOCAB), "--hf-architecture", "MistralForCausalLM")
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"]) == (["MistralForCausalLM"], None)
    hf = transformers.MistralForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, VOCAB, (2, 2 * WINDOW))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (_logits(model, ids)[..., :VOCAB] - theirs).abs().max() <= TOL
    biased = _ours(256, qkv_bias=True)  # Qwen2's q/k/v bias: not Mistral's
    helpers.save_single(tmp_path / "qwen2", biased, _our_args(biased))
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "qwen2"),
                         "--save-dir", str(tmp_path / "no"), "--saver", "hf",
                         "--hf-architecture", "MistralForCausalLM"]) == 2
    assert "this GPT exports as Qwen2ForCausalLM" in capsys.readouterr().err


class _FreshOptimizer:
    """What load_checkpoint asks of an optimizer it does not load (--finetune)."""

    def reload_model_params(self) -> None:
        pass


def test_loading_a_mistral_import_past_its_window_warns(tmp_path, megatron_log):
    """A run whose sequences can be longer than the recorded window hears it at load:
    training by --seq-length, a weights-only tool by --max-position-embeddings."""
    import pretrain_gpt
    from megatron.config.cli import build_parser, parse_flags
    from megatron.config.validate import validate
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.initialize import apply_checkpoint_args

    _random_mistral(tmp_path / "hf")
    ckpt = _convert(tmp_path / "hf", tmp_path / "ckpt", "--loader", "hf")
    run = ["--load", str(ckpt), "--use-checkpoint-args", "--finetune", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--micro-batch-size", "1",
           "--train-iters", "1", "--lr", "1e-4", "--use-cpu-initialization"]

    def load(optimizer, seq_length: int | None = None) -> list[str]:
        flags = parse_flags(build_parser(), run)
        apply_checkpoint_args(flags)
        if seq_length is not None:  # as the flags of a run without --use-checkpoint-args
            flags.data.seq_length = seq_length
        cfg = validate(flags, world_size=1)
        megatron_log.clear()
        load_checkpoint([pretrain_gpt.model_provider(cfg)], optimizer, None, cfg)
        return _warnings(megatron_log, "sliding window of 8 tokens")

    assert load(_FreshOptimizer()) == []  # training at the import's seq_length: the window
    said = load(_FreshOptimizer(), seq_length=2 * WINDOW)
    assert len(said) == 1 and "up to 16 tokens (--seq-length)" in said[0], said
    said = load(None)  # generation: up to max_position_embeddings
    assert len(said) == 1 and "up to 32 tokens (--max-position-embeddings)" in said[0], said
