"""The element-wise fusions and the gradient-accumulation fusion keep the unfused numerics.

bias-dropout-add runs the same aten ops as the eager expression (TorchScript does not fuse on
CPU), so it is compared bit for bit; bias-gelu runs the C++ kernel on CPU (a polynomial exp, not
ATen's tanh), compared within 1e-6 (tests/fused_kernels/test_fused_bias_gelu.py checks it and its
TorchScript fallback in detail); the fused weight-gradient accumulation is one GEMM with beta = 1
instead of a GEMM and an add, compared to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_dropout import bias_dropout_add
from megatron.core.fusions.fused_bias_gelu import bias_gelu
from megatron.core.tensor_parallel import layers as tp_layers


def test_bias_gelu_equals_tanh_gelu_of_the_sum():
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(7, 3, 40, generator=gen)
    bias = torch.randn(40, generator=gen)
    grad = torch.randn(7, 3, 40, generator=gen)
    fused_in = [y.clone().requires_grad_(True), bias.clone().requires_grad_(True)]
    eager_in = [y.clone().requires_grad_(True), bias.clone().requires_grad_(True)]
    for _ in range(3):  # TorchScript's profiling runs specialise after the first calls
        for t in fused_in + eager_in:
            t.grad = None
        out = bias_gelu(*fused_in)
        out.backward(grad)
        ref = F.gelu(eager_in[0] + eager_in[1], approximate="tanh")
        ref.backward(grad)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused_in[0].grad, eager_in[0].grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused_in[1].grad, eager_in[1].grad, rtol=1e-6, atol=1e-6)


def test_bias_dropout_add_fused_draws_what_eager_draws():
    x, bias, residual = torch.randn(5, 2, 16), torch.randn(16), torch.randn(5, 2, 16)
    for training in (True, False):
        for _ in range(3):
            torch.manual_seed(11)
            fused = bias_dropout_add(x, bias, residual, 0.3, training, fused=True)
            torch.manual_seed(11)
            eager = bias_dropout_add(x, bias, residual, 0.3, training, fused=False)
            assert torch.equal(fused, eager)
    assert torch.equal(bias_dropout_add(x, None, residual, 0.0, True), residual + x)
    # p = 0 while training: no random numbers drawn, as eager dropout
    torch.manual_seed(5)
    bias_dropout_add(x, bias, residual, 0.0, True, fused=True)
    after_call = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_call, torch.rand(3))


def _linear_pair(fusion: bool) -> tp_layers.ColumnParallelLinear:
    torch.manual_seed(3)
    return tp_layers.ColumnParallelLinear(
        12, 10, tp_group=None, init_method=tp_layers.init_method_normal(0.02), bias=True,
        gradient_accumulation_fusion=fusion)


def test_gradient_accumulation_fusion_writes_main_grad():
    fused, plain = _linear_pair(True), _linear_pair(False)
    fused.weight.main_grad = torch.zeros_like(fused.weight)  # what the DDP buffer provides
    hook_calls = []
    fused.weight.register_post_accumulate_grad_hook(lambda p: hook_calls.append(p.grad))
    expected = torch.zeros_like(plain.weight)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):  # two micro-batches accumulate
        x = torch.randn(4, 3, 12, generator=gen)
        fused(x.clone().requires_grad_(True))[0].square().sum().backward()
        plain.weight.grad = None
        plain(x.clone().requires_grad_(True))[0].square().sum().backward()
        expected += plain.weight.grad
    assert fused.weight.grad is None  # no separate weight gradient tensor
    torch.testing.assert_close(fused.weight.main_grad, expected, rtol=1e-6, atol=1e-7)
    assert hook_calls == [None, None]  # the DDP hook still sees the weight as ready
    assert fused.bias.grad is not None


def test_gradient_accumulation_fusion_without_buffer_is_plain_autograd():
    fused, plain = _linear_pair(True), _linear_pair(False)
    x = torch.randn(6, 12)
    xf, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    fused(xf)[0].sum().backward()
    plain(xp)[0].sum().backward()
    torch.testing.assert_close(fused.weight.grad, plain.weight.grad)
    torch.testing.assert_close(fused.bias.grad, plain.bias.grad)
    torch.testing.assert_close(xf.grad, xp.grad)


def test_layernorm_module_fused_equals_torch_with_layernorm_1p():
    """transformer.LayerNorm through the fused kernel (with --apply-layernorm-1p's gamma - 1
    storage) against the same module on F.layer_norm: outputs and every gradient."""
    from megatron.core.transformer.layernorm import LayerNorm

    torch.manual_seed(0)
    x = torch.randn(5, 3, 48)
    grad = torch.randn(5, 3, 48)
    results = []
    for fused in (True, False):
        norm = LayerNorm(48, eps=1e-5, apply_layernorm_1p=True, fused=fused)
        torch.manual_seed(1)  # the same parameters on both sides
        with torch.no_grad():
            norm.weight.normal_(0, 0.1)
            norm.bias.normal_(0, 0.1)
        xi = x.clone().requires_grad_(True)
        out = norm(xi)
        out.backward(grad)
        results.append((out.detach(), xi.grad, norm.weight.grad, norm.bias.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
