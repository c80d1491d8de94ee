"""The fused (bias +) SwiGLU: bit-equal to the plain ops forward and backward, and the MLP
keeps fc1's output alone for it (not silu(gate) besides), Megatron's activation memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.mlp import MLP


def _plain(y, bias):
    if bias is not None:
        y = y + bias
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_equal_the_plain_ops(dtype, with_bias):
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(5, 3, 16, generator=gen).to(dtype)
    bias = torch.randn(16, generator=gen).to(dtype) if with_bias else None
    grad = torch.randn(5, 3, 8, generator=gen).to(dtype)
    outs = []
    for fn in (bias_swiglu, _plain):
        leaves = [t.clone().requires_grad_() for t in (y, bias) if t is not None]
        out = fn(leaves[0], leaves[1] if with_bias else None)
        out.backward(grad)
        outs.append((out, *(t.grad for t in leaves)))
    for got, want in zip(*outs):
        assert torch.equal(got, want)


def _saved_bytes(mlp: MLP, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for the MLP's backward."""
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = mlp(x)
    del out
    return sum(storages.values())


@pytest.mark.parametrize("bias", [False, True])
def test_mlp_keeps_a_third_less_for_the_swiglu(bias):
    s, b, h, f = 8, 2, 16, 64
    x = torch.randn(s, b, h, requires_grad=True)
    saved = {}
    for fused in (True, False):
        cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2,
                                ffn_hidden_size=f, swiglu=True, add_bias_linear=bias,
                                bias_swiglu_fusion=fused, params_dtype=torch.float32)
        torch.manual_seed(0)
        saved[fused] = _saved_bytes(MLP(cfg, None), x)
    # The plain ops keep silu(gate), [s, b, f] in fp32, besides fc1's output [s, b, 2f]; the
    # fusion keeps the [2f] bias it adds again in the backward.
    assert saved[False] - saved[True] == s * b * f * 4 - (2 * f * 4 if bias else 0)
    torch.manual_seed(0)
    mlps = [MLP(TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2,
                                  ffn_hidden_size=f, swiglu=True, add_bias_linear=bias,
                                  bias_swiglu_fusion=fused), None) for fused in (True, False)]
    mlps[1].load_state_dict(mlps[0].state_dict())
    outs = [m(x)[0] for m in mlps]
    assert torch.equal(outs[0], outs[1])
