"""The CPU RMS-norm kernel (megatron.fused_kernels._cpu ``rms_norm_forward/backward``) against a
float64 reference of Megatron's RMSNorm, forward, input gradient and weight gradient, fp32/fp16/
bf16, on odd shapes; and against the PyTorch path (``rms_norm_reference``, Megatron-LM's PyTorch
RMSNorm) in the same dtype: the kernel's error is at most twice that path's plus one ulp, the
check ``bench/check_kernels.py`` applies on every device.

The kernel rounds as Megatron's PyTorch RMSNorm does (x * rstd in fp32, rounded to the input's
dtype, times the weight, rounded again), so the half-precision forward differs from the exact
value by up to two roundings (within the layer-norm tests' tolerances); the gradients sum in fp32
and round once.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.fusions import kernels
from megatron.core.fusions.fused_layer_norm import fused_rms_norm
from megatron.core.transformer.layernorm import RMSNorm, rms_norm_reference
from tests.fused_kernels.conftest import CPU_EXTENSION
from tests.fused_kernels.test_fused_kernels import DTYPES, TOL, _check

# [rows..., h]: one row of one; odd h; a wide row; many rows; a model's row ([s, b, h])
SHAPES = [(1, 1), (3, 5, 769), (2, 4099), (1031, 33), (16, 2, 512)]
EPS = 1e-5


@pytest.fixture(scope="module")
def ext(cpu_extension_built):
    import importlib

    return importlib.import_module(CPU_EXTENSION)


def _inputs(shape, dtype, seed=None):
    gen = torch.Generator().manual_seed(sum(shape) if seed is None else seed)
    h = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    w = (1 + 0.2 * torch.randn(h, generator=gen)).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return x, w, grad


def _fwd_bwd(fn, x, w, grad):
    """(y, dx, dw) of ``fn(x, w)`` under ``grad``."""
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fn(xl, wl)
    y.backward(grad)
    return y.detach(), xl.grad, wl.grad


def _kernel(x, w):
    out = fused_rms_norm(x, w, EPS)
    assert out is not None, "the kernel did not run"
    return out


def _float64_reference(x, w, grad):
    return _fwd_bwd(lambda x_, w_: rms_norm_reference(x_, w_, EPS), x.double(), w.double(),
                    grad.double())


def _error(got, want) -> float:
    """Largest deviation relative to the reference's largest value, floored at 1 as ``_check``
    does (a one-element row's input gradient is a cancellation to ~1e-6: noise only)."""
    return float((got.double() - want).abs().max()) / max(float(want.abs().max()), 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_against_float64(ext, shape, dtype):
    x, w, grad = _inputs(shape, dtype)
    got = _fwd_bwd(_kernel, x, w, grad)
    assert got[0].dtype == dtype and got[0].shape == x.shape
    assert got[1].dtype == dtype and got[2].dtype == dtype and got[2].shape == w.shape
    want = _float64_reference(x, w, grad)
    _check(got[0], want[0].to(dtype), dtype, "forward")
    _check(got[1], want[1], dtype, "backward")
    _check(got[2], want[2], dtype, "backward")
    # No worse than Megatron's PyTorch RMSNorm in the same dtype (twice its error, plus an ulp).
    eager = _fwd_bwd(lambda x_, w_: rms_norm_reference(x_, w_, EPS), x, w, grad)
    for name, g, e, r in zip(("y", "dx", "dw"), got, eager, want):
        assert _error(g, r) <= 2 * _error(e, r) + torch.finfo(dtype).eps, (name, _error(g, r),
                                                                          _error(e, r))


def test_statistic_is_the_inverse_root_mean_square(ext):
    x, w, _ = _inputs((7, 3, 130), torch.bfloat16)
    _, rstd = ext.rms_norm_forward(x, w, EPS)
    want = (x.double().pow(2).mean(-1) + EPS).rsqrt().reshape(-1)
    assert rstd.dtype == torch.float32 and rstd.shape == (21,)
    torch.testing.assert_close(rstd.double(), want, rtol=1e-6, atol=0)


def test_half_precision_rounds_as_megatron(ext):
    """bf16: x * rstd is rounded to bf16 before the weight multiplies (Megatron's
    ``_norm(x.float()).type_as(x) * weight``), not once after (ATen's F.rms_norm): with the
    same rstd the kernel's forward is the PyTorch path's bit for bit, except where the two rstd
    differ in their last bit (a different summation order)."""
    x, w, _ = _inputs((64, 1000), torch.bfloat16, seed=3)
    got = ext.rms_norm_forward(x, w, EPS)[0]
    want = rms_norm_reference(x, w, EPS)
    assert float((got.float() - want.float()).abs().max()) <= 1e-2
    assert (got == want).float().mean() > 0.99
    once = (x.float() * (x.float().pow(2).mean(-1, keepdim=True) + EPS).rsqrt()
            * w.float()).to(torch.bfloat16)
    assert (got != once).any()  # the other rounding is distinguishable at this size


def test_non_contiguous_input(ext):
    """A transposed [b, s, h] view (h still last) and a strided h: the same as contiguous."""
    x, w, grad = _inputs((5, 9, 64), torch.float32)
    want = _fwd_bwd(_kernel, x.transpose(0, 1).contiguous(), w, grad.transpose(0, 1))
    got = _fwd_bwd(_kernel, x.transpose(0, 1), w, grad.transpose(0, 1))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    wide = torch.randn(6, 128)
    strided = wide[:, ::2]
    got = _fwd_bwd(_kernel, strided, w, torch.ones(6, 64))
    want = _fwd_bwd(_kernel, strided.contiguous(), w, torch.ones(6, 64))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 7, 1031], ids=lambda r: f"rows{r}")
def test_weight_gradient_is_the_same_bits_for_any_thread_count(ext, rows):
    x, w, grad = _inputs((rows, 97), torch.float32)
    _, rstd = ext.rms_norm_forward(x, w, EPS)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(ext.rms_norm_backward(grad, x, rstd, w))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, o) for a, o in zip(results[0], other))


@pytest.mark.parametrize("one_p", [False, True], ids=["gamma", "layernorm_1p"])
def test_module_kernel_equals_pytorch_path(one_p):
    """RMSNorm with the kernel against ``fused=False``: the output and the stored parameter's
    gradient (``--apply-layernorm-1p`` stores gamma - 1; the kernel gets weight + 1)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 3, 48, generator=gen)
    grad = torch.randn(4, 3, 48, generator=gen)
    results = []
    for fused in (True, False):
        norm = RMSNorm(48, eps=EPS, apply_layernorm_1p=one_p, fused=fused,
                       device=torch.device("cpu"))
        with torch.no_grad():
            norm.weight.copy_(0.1 * torch.randn(48, generator=torch.Generator().manual_seed(1)))
        xl = x.clone().requires_grad_(True)
        y = norm(xl)
        y.backward(grad)
        results.append((y.detach(), xl.grad, norm.weight.grad, type(y.grad_fn).__name__))
    (y_k, dx_k, dw_k, fn_k), (y_p, dx_p, dw_p, fn_p) = results
    if kernels.preferred("rms_norm", "cpu") is not None:
        assert "FusedRMSNorm" in fn_k
    assert "FusedRMSNorm" not in fn_p
    for g, e in ((y_k, y_p), (dx_k, dx_p), (dw_k, dw_p)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_inputs_no_kernel_covers_are_left_to_pytorch():
    x = torch.randn(3, 4, dtype=torch.float64)
    assert fused_rms_norm(x, torch.ones(4, dtype=torch.float64), EPS) is None
    # bf16 activations with an fp32 weight: PyTorch's type promotion (an fp32 output) stays.
    assert fused_rms_norm(x.bfloat16(), torch.ones(4), EPS) is None
    norm = RMSNorm(4, device=torch.device("cpu"))
    assert norm(x.bfloat16()).dtype == torch.float32


def test_wrong_weight_shape_is_an_error(ext):
    with pytest.raises(RuntimeError, match=r"weight must be \[4\]"):
        ext.rms_norm_forward(torch.randn(2, 4), torch.ones(5), EPS)
    with pytest.raises(RuntimeError, match="one dtype"):
        ext.rms_norm_forward(torch.randn(2, 4), torch.ones(4, dtype=torch.bfloat16), EPS)
