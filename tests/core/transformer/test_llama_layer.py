"""Llama-style layer pieces against hand-written float64 references of one layer:
RMSNorm, the SwiGLU and squared-ReLU MLPs, RoPE (halves and interleaved, partial rotary),
grouped-query attention reading Megatron's [G, np/G + 2, hn] QKV rows, the QKV bias without
the other biases; and KV-cache generation with RoPE + GQA equal to recomputation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import device
from megatron.core.inference_params import InferenceParams
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layer import TransformerLayer
from megatron.core.transformer.layernorm import RMSNorm
from megatron.core.transformer.rotary import RotaryEmbedding

DT = torch.float64
S, B, H, NP, HN = 6, 2, 32, 4, 8
LLAMA = dict(num_layers=2, hidden_size=H, num_attention_heads=NP, ffn_hidden_size=24,
             hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DT,
             normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             num_query_groups=2, add_bias_linear=False, layernorm_epsilon=1e-6)


def _rand(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=DT).to(device.get_device())


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope_ref(t, positions, rot, base, interleaved):
    """Rotate pairs of t [s, b, n, hn] by position * base^(-2i/rot), written out pair by pair."""
    out = t.clone()
    for i in range(rot // 2):
        theta = positions.to(DT) * base ** (-2.0 * i / rot)  # [s, b]
        a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + rot // 2)
        cos, sin = torch.cos(theta)[..., None], torch.sin(theta)[..., None]
        out[..., a] = t[..., a] * cos - t[..., c] * sin
        out[..., c] = t[..., c] * cos + t[..., a] * sin
    return out


def _layer_ref(layer, x, cfg, positions):
    """The layer written from its parameters: pre-norm, grouped attention, gated MLP."""
    p = dict(layer.named_parameters())
    norm = (lambda t, name: _rms(t, p[name + ".weight"], cfg.layernorm_epsilon)) \
        if cfg.normalization == "RMSNorm" else \
        (lambda t, name: F.layer_norm(t, t.shape[-1:], p[name + ".weight"],
                                      p[name + ".bias"], cfg.layernorm_epsilon))
    g, hn, np_ = cfg.num_query_groups, cfg.kv_channels, cfg.num_attention_heads
    ln = norm(x, "input_layernorm")
    qkv = ln @ p["self_attention.query_key_value.weight"].T
    if "self_attention.query_key_value.bias" in p:
        qkv = qkv + p["self_attention.query_key_value.bias"]
    qkv = qkv.view(S, B, g, np_ // g + 2, hn)  # rows [G, np/G + 2, hn]
    q = qkv[:, :, :, :-2].reshape(S, B, np_, hn)
    k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [s, b, g, hn]
    if cfg.qk_layernorm and cfg.qk_layernorm_full_projection:  # all heads at once (OLMoE)
        q = norm(q.reshape(S, B, -1), "self_attention.q_layernorm").view(S, B, np_, hn)
        k = norm(k.reshape(S, B, -1), "self_attention.k_layernorm").view(S, B, g, hn)
    elif cfg.qk_layernorm:  # each head over its hn channels, before RoPE
        q, k = norm(q, "self_attention.q_layernorm"), norm(k, "self_attention.k_layernorm")
    if cfg.position_embedding_type == "rope":
        rot = int(hn * cfg.rotary_percent)
        q = _rope_ref(q, positions, rot, cfg.rotary_base, cfg.rotary_interleaved)
        k = _rope_ref(k, positions, rot, cfg.rotary_base, cfg.rotary_interleaved)
    ctx = torch.empty(S, B, np_, hn, dtype=DT)
    future = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
    for head in range(np_):
        grp = head // (np_ // g)
        scores = torch.einsum("sbd,tbd->bst", q[:, :, head], k[:, :, grp]) / math.sqrt(hn)
        probs = torch.softmax(scores.masked_fill(future, -math.inf), -1)
        ctx[:, :, head] = torch.einsum("bst,tbd->sbd", probs, v[:, :, grp])
    attn = ctx.reshape(S, B, np_ * hn) @ p["self_attention.dense.weight"].T
    if "self_attention.dense.bias" in p:
        attn = attn + p["self_attention.dense.bias"]
    h1 = x + attn
    ln2 = norm(h1, "post_attention_layernorm")
    fc1 = ln2 @ p["mlp.dense_h_to_4h.weight"].T
    f = cfg.ffn_hidden_size
    if cfg.swiglu:
        act = F.silu(fc1[..., :f]) * fc1[..., f:]  # [gate; up] rows at TP = 1
    elif cfg.squared_relu:
        act = F.relu(fc1) ** 2
    else:
        act = F.gelu(fc1)
    return h1 + act @ p["mlp.dense_4h_to_h.weight"].T


@pytest.mark.parametrize("changes", [
    {},
    {"rotary_interleaved": True, "rotary_percent": 0.5, "rotary_base": 100},
    {"num_query_groups": 1, "add_qkv_bias": True},  # multi-query, Qwen2's QKV bias
    {"num_query_groups": NP, "swiglu": False, "squared_relu": True},  # MHA
    {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute"},
    {"qk_layernorm": True},
    {"qk_layernorm": True, "normalization": "LayerNorm", "num_query_groups": NP},
    {"qk_layernorm": True, "qk_layernorm_full_projection": True},
])
@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_layer_equals_reference(changes, backend):
    cfg = TransformerConfig(**{**LLAMA, **changes, "attention_backend": backend})
    torch.manual_seed(3)
    layer = TransformerLayer(cfg, 1, None)
    with torch.no_grad():  # norm weights and QKV bias away from their init
        for i, (name, p) in enumerate(layer.named_parameters()):
            if p.dim() == 1:
                p.add_(0.1 * _rand(*p.shape, seed=50 + i))
    assert ("self_attention.query_key_value.bias" in dict(layer.named_parameters())) == \
        bool(changes.get("add_qkv_bias"))
    x = _rand(S, B, H, seed=1)
    positions = torch.arange(S).view(S, 1).expand(S, B) + torch.tensor([0, 5])  # [s, b]
    rotary = None
    if cfg.position_embedding_type == "rope":
        rope = RotaryEmbedding(cfg.kv_channels, cfg.rotary_percent, cfg.rotary_interleaved,
                               cfg.rotary_base)
        # Per-sample angles (offsets 0 and 5): the layer takes any [s, b, 1, rot] angles.
        rotary = rope.table(16, x.device)[positions].unsqueeze(2)  # [s, b, 1, rot]
    got = layer(x, None, rotary_pos_emb=rotary)
    # RoPE angles are fp32 (Megatron's): ~1e-7 relative on angles up to ~10 radians.
    torch.testing.assert_close(got, _layer_ref(layer, x, cfg, positions), rtol=1e-5, atol=1e-5)


def test_rmsnorm_half_computes_in_fp32():
    norm = RMSNorm(64, eps=1e-5, params_dtype=torch.float16)
    x = (300 * torch.randn(3, 64, dtype=torch.float32)).to(torch.float16)  # x^2 overflows fp16
    out = norm(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    ref = _rms(x.double(), 1.0, 1e-5)
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_rmsnorm_marks_its_weight_for_sequence_parallelism():
    norm = RMSNorm(8, sequence_parallel=True)
    assert norm.weight.sequence_parallel and not norm.weight.tensor_model_parallel


def test_generation_with_the_cache_equals_recomputation():
    torch.manual_seed(11)
    cfg = TransformerConfig(**{**LLAMA, "padded_vocab_size": 64, "max_position_embeddings": 16,
                               "init_method_std": 0.3, "rotary_percent": 0.5})
    model = GPTModel(cfg, None).eval()
    ids = torch.randint(0, 64, (B, 10), device=device.get_device())
    positions = torch.arange(10, device=device.get_device()).expand(B, 10)
    with torch.no_grad():
        full = model(ids, positions)  # [b, s, V]
        cache = InferenceParams(B, 16)
        steps = [(0, 6), (6, 7), (7, 8), (8, 10)]  # prompt, single tokens, two at once
        for start, end in steps:
            got = model(ids[:, start:end], positions[:, start:end], inference_params=cache)
            cache.sequence_len_offset = end
            torch.testing.assert_close(got, full[:, start:end], rtol=1e-10, atol=1e-10)
        # Only the G key/value heads are cached.
        keys, _ = cache.key_value_memory_dict[1]
        assert keys.shape == (16, B, cfg.num_query_groups, cfg.kv_channels)
        # The angles follow the sequence and the cache offset, not position_ids (Megatron-LM):
        # ids restarting mid-sequence (--reset-position-ids) leave the logits unchanged.
        restarted = torch.cat([positions[:, :4], positions[:, :6]], dim=1)
        torch.testing.assert_close(model(ids, restarted), full, rtol=1e-10, atol=1e-10)
        cos, sin = model.language_model.rotary_pos_emb(1, 6, min_length=16,
                                                       dtype=torch.float64)
        angles = model.language_model.rotary_pos_emb.table(16, cos.device)[6]
        torch.testing.assert_close(cos[0, 0, 0], torch.cos(angles).double())
        torch.testing.assert_close(sin[0, 0, 0], torch.sin(angles).double())


@pytest.mark.parametrize("changes", [{}, {"add_qkv_bias": True, "num_query_groups": 1},
                                     {"add_bias_linear": True, "normalization": "LayerNorm"},
                                     {"qk_layernorm": True},
                                     {"qk_layernorm": True, "normalization": "LayerNorm"},
                                     {"qk_layernorm": True, "qk_layernorm_full_projection": True,
                                      "normalization": "LayerNorm"}])
def test_parameter_count_and_flops(changes):
    from megatron.core.flops import num_floating_point_operations, num_parameters

    cfg = TransformerConfig(**{**LLAMA, **changes, "padded_vocab_size": 64,
                               "max_position_embeddings": 16})
    assert num_parameters(cfg) == sum(p.numel() for p in GPTModel(cfg, None).parameters())
    # Megatron-LM core_v0.13's formula (causal attention counted in full, as 23.06):
    # 12 B s L h^2 [(1 + G/np + s/h) hp/h + 3/2 f/h (SwiGLU)] + 6 B s V h.
    b, s, h, f, hp = 2, 16, H, cfg.ffn_hidden_size, cfg.kv_channels * NP
    g = cfg.num_query_groups
    megatron = 12 * b * s * 2 * h * h * ((1 + g / NP + s / h) * hp / h + 1.5 * f / h) \
        + 6 * b * s * 64 * h
    assert num_floating_point_operations(cfg, b, s) == pytest.approx(megatron)
