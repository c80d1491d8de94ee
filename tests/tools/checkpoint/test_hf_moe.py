"""--loader hf of HuggingFace MoE models (tiny random ones made here from configs; nothing
downloaded): Mixtral, Qwen2-MoE (shared expert with its sigmoid gate, a dense layer, q/k/v
bias, softmax before the top-k), Qwen3-MoE (q/k norms, renormalized top-k) and OLMoE (q/k norms
over the whole projection: --qk-layernorm-full-projection) give HF's logits in ours to 1e-5 in
fp32 and the same greedy text (ours also with the KV cache), through a TP=2 conversion and back
(OLMoE at TP=1: its TP=2 is refused by name)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.config import TransformerConfig
from megatron.text_generation.generation import generate_tokens
from tests.tools.checkpoint import helpers
from tools.checkpoint import convert

transformers = pytest.importorskip("transformers")
VOCAB, HIDDEN, HEADS = 96, 32, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _hf(kind: str):
    if kind == "mixtral":
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                          **COMMON), transformers.MixtralForCausalLM
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False,
            **COMMON), transformers.Qwen2MoeForCausalLM
    if kind == "olmoe":
        # Grouped keys too: the k norm spans num_key_value_heads x head_dim.
        return transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2,
                                        norm_topk_prob=False, **COMMON), \
            transformers.OlmoeForCausalLM
    return transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=24, head_dim=8,
                                       norm_topk_prob=True, **COMMON), \
        transformers.Qwen3MoeForCausalLM


def _random_hf(directory: Path, kind: str):
    torch.manual_seed(5)
    config, cls = _hf(kind)
    model = cls(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.eval().save_pretrained(directory)
    return model


def _ours(args) -> GPTModel:
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels, num_query_groups=args.num_query_groups,
        padded_vocab_size=args.padded_vocab_size,
        max_position_embeddings=args.max_position_embeddings, position_embedding_type="rope",
        rotary_base=args.rotary_base, normalization="RMSNorm",
        layernorm_epsilon=args.layernorm_epsilon, swiglu=True, add_bias_linear=False,
        add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        qk_layernorm_full_projection=getattr(args, "qk_layernorm_full_projection", False),
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=args.num_experts, moe_layer_freq=args.moe_layer_freq,
        moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate)
    return GPTModel(config, None).eval()


def _logits(model, ids):
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions)


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.mark.parametrize("kind", KINDS)
def test_import_gives_the_hf_logits_and_greedy_text(tmp_path, kind):
    hf = _random_hf(tmp_path / "hf", kind)
    flags = ["--model-type", "GPT"]
    tp = "1" if kind == "olmoe" else "2"  # OLMoE's whole-projection q/k norms: TP=1
    assert convert.main([*flags, "--load-dir", str(tmp_path / "hf"), "--save-dir",
                         str(tmp_path / "tp2"), "--loader", "hf",
                         "--target-tensor-parallel-size", tp]) == 0
    assert convert.main([*flags, "--load-dir", str(tmp_path / "tp2"), "--save-dir",
                         str(tmp_path / "tp1")]) == 0
    sd = helpers.shards(tmp_path / "tp1" / "iter_0000000")[(0, 0)]
    args = sd["args"]
    assert args.num_experts == 4 and args.moe_router_topk == 2
    assert getattr(args, "qk_layernorm_full_projection", False) == (kind == "olmoe")
    ours = _ours(args)
    ours.load_state_dict(sd["model"])
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (_logits(ours, ids)[..., :VOCAB] - theirs).abs().max() <= 1e-5
    prompt = ids[:1, :4]
    generated = hf.generate(prompt, max_new_tokens=6, do_sample=False,
                            attention_mask=torch.ones_like(prompt), pad_token_id=0)
    cached = generate_tokens(ours, [prompt[0].tolist()], 6, vocab_size=VOCAB,
                             max_sequence_length=64, greedy=True, stop_on_eod=False)
    for _ in range(6):
        nxt = _logits(ours, prompt)[:, -1, :VOCAB].argmax(-1, keepdim=True)
        prompt = torch.cat([prompt, nxt], dim=1)
    assert torch.equal(prompt, generated)
    assert cached == generated.tolist()  # our KV cache's tokens too


def test_olmoe_at_tp2_and_its_unconverted_forms_are_refused_by_name(tmp_path, capsys):
    _random_hf(tmp_path / "hf", "olmoe")
    code = convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "hf"),
                         "--save-dir", str(tmp_path / "out"), "--loader", "hf",
                         "--target-tensor-parallel-size", "2"])
    assert code != 0 and "--qk-layernorm-full-projection" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "clip_qkv": 8.0}))
    code = convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "hf"),
                         "--save-dir", str(tmp_path / "out"), "--loader", "hf"])
    assert code != 0 and "clip_qkv" in capsys.readouterr().err


@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_ours_to_hf_is_bitwise_and_back_gives_the_same_class(tmp_path, kind):
    _random_hf(tmp_path / "hf", kind)
    flags = ["--model-type", "GPT"]
    assert convert.main([*flags, "--load-dir", str(tmp_path / "hf"), "--save-dir",
                         str(tmp_path / "ours"), "--loader", "hf"]) == 0
    assert convert.main([*flags, "--load-dir", str(tmp_path / "ours"), "--save-dir",
                         str(tmp_path / "hf2"), "--saver", "hf", "--true-vocab-size",
                         str(VOCAB)]) == 0
    from safetensors.torch import load_file
    first, second = (load_file(str(d / "model.safetensors")) for d in
                     (tmp_path / "hf", tmp_path / "hf2"))
    helpers.assert_same_tensors(dict(sorted(first.items())), dict(sorted(second.items())))
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["model_type"] == kind
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        again = _random_hf(tmp_path / "hf3", kind)(ids).logits
        assert (hf(ids).logits - again).abs().max() <= 1e-6
    # ours -> HF -> ours is bitwise too.
    assert convert.main([*flags, "--load-dir", str(tmp_path / "hf2"), "--save-dir",
                         str(tmp_path / "ours2"), "--loader", "hf"]) == 0
    a, b = (helpers.flat_model(helpers.shards(d / "iter_0000000")[(0, 0)])
            for d in (tmp_path / "ours", tmp_path / "ours2"))
    helpers.assert_same_tensors(a, b)


def test_export_refuses_what_no_hf_class_holds():
    import argparse

    from tools.checkpoint.hf_moe import check_moe_exportable

    args = argparse.Namespace(position_embedding_type="rope", normalization="RMSNorm",
                              swiglu=True, add_bias_linear=False, num_experts=4,
                              moe_router_score_function="sigmoid", num_layers=2)
    with pytest.raises(ValueError, match="--moe-router-score-function"):
        check_moe_exportable(args)


def test_imported_olmoe_restores_its_q_k_norm_span_with_use_checkpoint_args(tmp_path):
    from megatron.config.core_configs import transformer_config
    from tests.tools.test_llama_serving import RUN, _config

    _random_hf(tmp_path / "hf", "olmoe")
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "hf"),
                         "--save-dir", str(tmp_path / "ours"), "--loader", "hf"]) == 0
    cfg = _config(["--load", str(tmp_path / "ours"), "--use-checkpoint-args",
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), *RUN])
    tc = transformer_config(cfg)
    assert tc.qk_layernorm and tc.qk_layernorm_full_projection and tc.num_moe_experts == 4
