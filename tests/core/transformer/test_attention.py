"""Attention numerics in one process: the unfused path's scale inside the GEMM (fp16 overflow),
query-key layer scaling and softmax-in-fp32 as no-ops in full precision, fp32 probabilities
with half inputs, and what torch's SDPA computes for half inputs (documented in attention.py).

Legend: s sequence, b batch, np heads, hn head size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core import device
from megatron.core.transformer.attention import CoreAttention
from megatron.core.transformer.config import TransformerConfig

S, B, NP, HN = 8, 2, 2, 16
CONFIG = TransformerConfig(num_layers=24, hidden_size=NP * HN, num_attention_heads=NP,
                           hidden_dropout=0.0, attention_dropout=0.0)
HALF = [torch.float16, torch.bfloat16]


def _qkv(dtype, scale=1.0, seed=0, dev=None):
    """Three ``[s, b, np, hn]`` tensors, drawn in fp64 on the CPU, on ``dev`` (default: the
    compute device)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(S, B, NP, HN, generator=gen, dtype=torch.float64) * scale)
            .to(dtype).to(dev or device.get_device()) for _ in range(3)]


def _padding_mask():
    """``[b, 1, s, s]``, True = masked: sample 1 has 5 real tokens (keys 5.. masked; no query
    row is fully masked, so every output row is meaningful)."""
    mask = torch.zeros(B, 1, S, S, dtype=torch.bool, device=device.get_device())
    mask[1, :, :, 5:] = True
    return mask


def _attention(layer_number=24, attn_mask_type="causal", **kwargs):
    return CoreAttention(dataclasses.replace(CONFIG, **kwargs), layer_number, attn_mask_type)


@pytest.mark.parametrize("layer_scaling", [True, False])
def test_unfused_fp16_large_scores_stay_finite(layer_scaling):
    """|q.k| ~ 1e5 exceeds fp16's 65504 before the 1/sqrt(hn) (and 1/layer) scale: the scale
    must be applied inside the GEMM (baddbmm alpha), as Megatron does."""
    q, k, v = _qkv(torch.float16, scale=100.0)
    raw = torch.einsum("sbnd,tbnd->bnst", q.double(), k.double())
    assert raw.abs().max() > torch.finfo(torch.float16).max  # the premise of the test
    core = _attention(24, attention_backend="unfused",  # layer 24 of 24
                      apply_query_key_layer_scaling=layer_scaling,
                      attention_softmax_in_fp32=True)
    out = core(q, k, v, None)  # [s, b, np*hn]
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    ref = _attention(attention_backend="unfused")(q.float(), k.float(), v.float(), None)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    sdpa = _attention()(q, k, v, None)
    torch.testing.assert_close(out, sdpa, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, dict(rtol=1e-5, atol=1e-5)),
                                       (torch.float64, dict(rtol=1e-12, atol=1e-13))])
@pytest.mark.parametrize("attn_mask_type", ["causal", "padding"])
def test_layer_scaling_and_softmax_fp32_change_nothing_in_full_precision(dtype, tol,
                                                                         attn_mask_type):
    """Unfused with layer scaling == unfused without == SDPA (layer 3 > 1), outputs and
    gradients; fp64 must stay fp64 (an fp32 softmax would miss the 1e-12 tolerance)."""
    mask = _padding_mask() if attn_mask_type == "padding" else None
    variants = [dict(attention_backend="unfused"),
                dict(attention_backend="unfused", apply_query_key_layer_scaling=True),
                dict(attention_backend="unfused", attention_softmax_in_fp32=True),
                dict(attention_backend="auto", apply_query_key_layer_scaling=True,
                     attention_softmax_in_fp32=True)]
    results = []
    for kwargs in variants:
        q, k, v = (t.requires_grad_() for t in _qkv(dtype, scale=2.0))
        out = _attention(3, attn_mask_type, **kwargs)(q, k, v, mask)  # [s, b, np*hn]
        assert out.dtype == dtype
        out.backward(_qkv(dtype, seed=1)[0].flatten(2))  # any fixed upstream grad
        results.append((out, q.grad, k.grad, v.grad))
    for kwargs, got in zip(variants[1:], results[1:]):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, results[0]):
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name} with {kwargs}: {m}")


@pytest.mark.parametrize("dtype", HALF)
def test_softmax_in_fp32_with_half_inputs(dtype, monkeypatch):
    """--attention-softmax-in-fp32 (and layer scaling, which implies it) computes the
    probabilities in fp32 from half scores; without it the softmax runs in half. (PyTorch's
    softmax: with the masked-softmax fusion the fused kernel computes in fp32 whatever the flags,
    tests/fused_kernels.)"""
    seen = []
    softmax = torch.softmax

    def spy(x, *args, **kwargs):
        seen.append(x.dtype)
        return softmax(x, *args, **kwargs)

    monkeypatch.setattr(torch, "softmax", spy)
    q, k, v = _qkv(dtype, scale=2.0)
    ref = _attention(attention_backend="unfused")(q.float(), k.float(), v.float(), None)
    for kwargs, want in ((dict(attention_softmax_in_fp32=True), torch.float32),
                         (dict(apply_query_key_layer_scaling=True), torch.float32),
                         (dict(), dtype)):
        seen.clear()
        out = _attention(5, attention_backend="unfused", masked_softmax_fusion=False,
                         **kwargs)(q, k, v, None)
        assert seen == [want], kwargs
        assert out.dtype == dtype
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out.float(), ref, rtol=8 * eps, atol=8 * eps)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_sdpa_half_inputs_compute_in_fp32(dtype, dropout_p):
    """Why the SDPA path ignores the two flags: with half inputs torch's SDPA returns the fp32
    result rounded once (the CPU flash kernel accumulates in fp32; the math kernel, used with
    dropout, upcasts q, k, v). Within one ulp of the fp32 computation on the same inputs.
    (CPU kernels: CUDA's half kernels draw dropout differently from its fp32 ones.)"""
    cpu = torch.device("cpu")
    q, k, v = (t.permute(1, 2, 0, 3) for t in _qkv(dtype, 3.0, dev=cpu))  # [b, np, s, hn]
    torch.manual_seed(5)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                         dropout_p=dropout_p)
    torch.manual_seed(5)  # the same dropout mask: the math kernel draws it on fp32 scores
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, ref.to(dtype), rtol=eps, atol=eps)
