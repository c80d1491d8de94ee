"""A transformer layer at TP = 2 and 4 against TP = 1 (both attention paths, float64), the
dropout streams, and attention against a hand-written reference that reads the checkpoint's
[np, 3, hn] QKV row order. Tensors are made on ``device.get_device()``, with the parameters."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron.core import comm, device
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer.attention import CoreAttention, SelfAttention, causal_mask
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layer import TransformerLayer
from tests.core.tp_helpers import assert_same_params_and_grads
from tests.multiprocess import run_distributed

DT = torch.float64
CONFIG = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                           hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DT)


def _rand(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=DT).to(device.get_device())


def _run_layer(config, group, rank, mask=None, seed=7):
    torch.manual_seed(seed)
    layer = TransformerLayer(config, 2, group)
    # (Replicated biases and LayerNorm affine perturbed so their gradients are exercised.)
    with torch.no_grad():
        for i, (name, p) in enumerate(layer.named_parameters()):
            if not p.tensor_model_parallel:
                p.add_(0.1 * _rand(*p.shape, seed=100 + i))
    x = _rand(6, 2, 16, seed=1).requires_grad_()
    model_parallel_manual_seed(123, rank)
    out = layer(x, mask)
    out.backward(_rand(6, 2, 16, seed=2))
    return layer, x, out


def _check_layer_equivalence(group, rank):
    reset_mask = causal_mask(6, device.get_device()).repeat(2, 1, 1, 1)
    reset_mask[1, :, 3:, :3] = True  # sample 1: two documents (reset attention mask)
    variants = [dict(), dict(attention_backend="unfused"),
                dict(attention_backend="unfused", apply_query_key_layer_scaling=True),
                dict(apply_residual_connection_post_layernorm=True, openai_gelu=True),
                dict(hidden_dropout=0.3)]  # residual dropout: same draws as TP = 1
    for kwargs in variants:
        config = dataclasses.replace(CONFIG, **kwargs)
        for mask in (None, reset_mask):
            ref, x_ref, out_ref = _run_layer(config, None, 0, mask)
            par, x_par, out_par = _run_layer(config, group, rank, mask)
            torch.testing.assert_close(out_par, out_ref, rtol=1e-7, atol=1e-9)
            torch.testing.assert_close(x_par.grad, x_ref.grad, rtol=1e-7, atol=1e-9)
            assert_same_params_and_grads(ref, par, group)


def _check_attention_dropout_differs(group, rank):
    """Attention dropout draws from the per-TP-rank stream; the default stream stays in step."""
    outs = []
    for backend in ("auto", "unfused"):
        config = dataclasses.replace(CONFIG, attention_dropout=0.5, attention_backend=backend)
        core = CoreAttention(config, 1).train()
        q = torch.ones(5, 1, 1, 4, dtype=DT, device=device.get_device())
        v = _rand(5, 1, 1, 4, seed=3)  # identical on every rank
        model_parallel_manual_seed(99, rank)
        out = core(q, q, v, None)
        outs.append(comm.all_gather_list(out, group))
        states = comm.all_gather_list(torch.get_rng_state().double(), group)
        assert all(torch.equal(states[0], s) for s in states)
    return [all(not torch.equal(o[0], o[r]) for r in range(1, len(o))) for o in outs]


def _layer_checks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    _check_layer_equivalence(group, rank)
    return _check_attention_dropout_differs(group, rank)


@pytest.mark.parametrize("tp", [2, 4])
def test_layer_matches_tp1(tp):
    results = run_distributed(tp, _layer_checks)
    assert results[0] == [True, True], "attention dropout masks must differ between TP ranks"


def test_qkv_rows_are_per_head_q_k_v():
    """Full QKV weight rows in Megatron's version >= 2.0 order [np, 3, hn]."""
    config = dataclasses.replace(CONFIG, add_bias_linear=False)
    torch.manual_seed(0)
    attn = SelfAttention(config, 1, None)
    x = _rand(5, 2, 16, seed=4)
    out, _ = attn(x, None)
    np_, hn = 4, 4
    w = attn.query_key_value.weight.view(np_, 3, hn, 16)
    q, k, v = (torch.einsum("sbh,ndh->bnsd", x, w[:, i]) for i in range(3))
    probs = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(hn)).masked_fill(
        causal_mask(5, x.device), float("-inf")), -1)
    ctx = (probs @ v).permute(2, 0, 1, 3).reshape(5, 2, 16)  # [s, b, np*hn]
    torch.testing.assert_close(out, ctx @ attn.dense.weight.t())


def test_sdpa_matches_unfused_with_padding_mask():
    torch.manual_seed(0)
    q, k, v = (_rand(5, 2, 3, 4, seed=s) for s in (5, 6, 7))
    mask = torch.zeros(2, 1, 5, 5, dtype=torch.bool, device=device.get_device())
    mask[1, :, :, 3:] = True
    mask[1, :, 3:, :] = True  # padded queries: fully masked rows stay finite
    outs = [CoreAttention(dataclasses.replace(CONFIG, attention_backend=b), 1, "padding")(
        q, k, v, mask) for b in ("auto", "unfused")]
    assert torch.isfinite(outs[0]).all()
    # Fully masked (padded) query rows are garbage either way (the unfused path averages V
    # uniformly, SDPA's additive mask keeps the raw scores); every other row must agree.
    torch.testing.assert_close(outs[0][:, 0], outs[1][:, 0])
    torch.testing.assert_close(outs[0][:3, 1], outs[1][:3, 1])
