"""The CUDA path of RMSNorm, ATen's ``F.rms_norm`` (:func:`rms_norm_aten`), computes Megatron's
RMSNorm: half-precision rows normalized in fp32, rounded, then times the weight. Its numerics
are checked on the CPU against Megatron's ops (:func:`rms_norm_reference`); on a GPU the module
itself takes that path."""

from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.layernorm import RMSNorm, rms_norm_aten, rms_norm_reference


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_aten_rms_norm_equals_megatrons_ops(dtype):
    gen = torch.Generator().manual_seed(0)
    scale = 300.0 if dtype == torch.float16 else 1.0  # fp16: x^2 overflows unless upcast
    x = (scale * torch.randn(4, 3, 64, generator=gen)).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype).requires_grad_()
    grad = torch.randn(4, 3, 64, generator=gen).to(dtype)
    results = []
    for fn in (rms_norm_aten, rms_norm_reference):
        out = fn(x, weight, 1e-5)
        gx, gw = torch.autograd.grad(out, (x, weight), grad)
        results.append((out, gx, gw))
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 1e-2)
    for got, want in zip(*results):
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale)
    # The normalized rows are rounded to the input dtype before the weight multiplies.
    assert torch.equal(results[0][0], rms_norm_aten(x, torch.ones_like(weight), 1e-5) * weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the ATen path is RMSNorm's on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_on_cuda_equals_megatrons_ops(dtype):
    norm = RMSNorm(256, params_dtype=dtype, device=torch.device("cuda"))
    x = torch.randn(64, 256, device="cuda").to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, norm.eps),
                               rtol=tol, atol=tol)
