"""The CPU fused kernels (megatron.fused_kernels._cpu) against their PyTorch references, forward
and backward, fp32/fp16/bf16, on odd shapes: one row, sequence lengths off every power of two,
rows longer than 2048, many batch x head rows, fully masked rows.

References compute in fp32 from the same (rounded) inputs; the kernels also compute in fp32, so
fp32 agrees to ~1e-6 and half precision to the rounding of the output (one ulp: 2^-8 relative
for bf16, 2^-11 for fp16) plus, in the backward, the rounding of the saved half probabilities.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import fused_softmax, kernels
from megatron.core.fusions.fused_layer_norm import fused_layer_norm


def _cpu_extension():
    try:
        return importlib.import_module(kernels.EXTENSIONS["cpu"])
    except ImportError as exc:  # the install step builds it: a missing one is a broken install
        pytest.fail(f"{kernels.EXTENSIONS['cpu']} is not built ({exc}); run scripts/bootstrap.sh "
                    "(pip install --no-build-isolation -e .)")


@pytest.fixture(scope="module")
def ext():
    return _cpu_extension()


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (forward rtol/atol, backward atol relative to the largest reference gradient)
TOL = {torch.float32: (1e-5, 1e-6, 1e-5), torch.float16: (2e-3, 1e-4, 4e-3),
       torch.bfloat16: (1.6e-2, 1e-3, 3e-2)}
# [b, np, sq, sk]: one row; odd lengths; a row longer than 2048; 1024 batch x head rows
SHAPES = [(1, 1, 1, 1), (2, 3, 37, 37), (1, 2, 3, 2053), (64, 16, 3, 19), (3, 2, 13, 29)]


def _reference(x, mask, causal, scale):
    """Megatron's semantics in fp32: scale, -10000 where masked, softmax, zero fully masked
    rows; returns fp32 probabilities (differentiable w.r.t. x)."""
    sq, sk = x.shape[-2:]
    scores = x.float() * scale
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1).view(1, 1, sq, sk)
    if mask is not None:
        scores = scores.masked_fill(mask, -10000.0)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(mask.all(-1, keepdim=True), 0.0)
    return probs


def _check(got, want, dtype, which):
    rtol, atol, grad_tol = TOL[dtype]
    if which == "forward":
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    else:
        scale = max(float(want.abs().max()), 1.0)  # gradients here are O(1); floor the noise
        assert float((got.float() - want.float()).abs().max()) <= grad_tol * scale


def _run_softmax(ext, shape, dtype, mask_kind, scale=0.7):
    del ext  # loaded through the fusion module (the path attention takes)
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    b, _, sq, sk = shape
    mask, causal = None, False
    if mask_kind == "causal":
        causal = sq <= sk
    elif mask_kind in ("mask_b", "mask_1"):
        mask = torch.rand(b if mask_kind == "mask_b" else 1, 1, sq, sk, generator=gen) < 0.3
        mask[..., 0, :] = True  # a fully masked row (a padding query)
    grad = torch.randn(shape, generator=gen).to(dtype)

    x_fused = x.clone().requires_grad_(True)
    got = fused_softmax.fused_scale_mask_softmax(x_fused, mask, causal, scale)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    got.backward(grad)

    x_ref = x.float().requires_grad_(True)
    want = _reference(x_ref, mask, causal, scale)
    want.backward(grad.float())
    _check(got.detach(), want.detach().to(dtype), dtype, "forward")
    _check(x_fused.grad, x_ref.grad, dtype, "backward")
    if mask is not None:  # Megatron's kernels: zeros, not a uniform row
        assert torch.all(got.detach()[..., 0, :] == 0)
        assert torch.all(x_fused.grad[..., 0, :] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scaled_softmax(ext, shape, dtype):
    _run_softmax(ext, shape, dtype, "none")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scaled_upper_triang_masked_softmax(ext, shape, dtype):
    _run_softmax(ext, shape, dtype, "causal")


@pytest.mark.parametrize("mask_kind", ["mask_b", "mask_1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scaled_masked_softmax(ext, shape, dtype, mask_kind):
    _run_softmax(ext, shape, dtype, mask_kind)


def test_causal_kernel_is_the_triangle_directly(ext):
    """The raw kernel's API is Megatron's: [attn_batches, sq, sk] in, exact zeros above the
    diagonal (never computed), rows summing to one."""
    x = torch.randn(5, 33, 33)
    probs = ext.scaled_upper_triang_masked_softmax_forward(x, 1.0)
    assert torch.all(probs.triu(1) == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, 33))
    torch.testing.assert_close(probs, torch.softmax(x.masked_fill(
        torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf")), -1))
    # Its backward reads only the lower triangle; the zeros above give the full formula's result
    # (up to the order of the vectorised sums) and exact zeros above the diagonal.
    grad = torch.randn(5, 33, 33)
    causal_grad = ext.scaled_upper_triang_masked_softmax_backward(grad, probs, 0.5)
    torch.testing.assert_close(causal_grad, ext.softmax_backward(grad, probs, 0.5))
    assert torch.all(causal_grad.triu(1) == 0)


def test_wrong_mask_shape_is_an_error(ext):
    with pytest.raises(RuntimeError, match="mask must be"):
        ext.scaled_masked_softmax_forward(torch.randn(2, 2, 3, 4),
                                          torch.zeros(2, 2, 3, 4, dtype=torch.bool), 1.0)


def test_float64_is_left_to_pytorch():
    assert fused_softmax.fused_scale_mask_softmax(torch.randn(1, 1, 2, 2, dtype=torch.float64),
                                                  None, True, 1.0) is None
    x = torch.randn(3, 4, dtype=torch.float64)
    assert fused_layer_norm(x, torch.ones(4, dtype=torch.float64),
                            torch.zeros(4, dtype=torch.float64), 1e-5) is None


# [rows..., h]: one row of one; odd h; a wide row; many rows
LN_SHAPES = [(1, 1), (3, 5, 769), (2, 4099), (1031, 33)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LN_SHAPES, ids=str)
def test_layer_norm(ext, shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    h = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + 1).to(dtype)
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(h, generator=gen)).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)

    args = [t.clone().requires_grad_(True) for t in (x, w, b)]
    got = fused_layer_norm(*args, 1e-5)
    assert got is not None and got.dtype == dtype
    got.backward(grad)
    refs = [t.float().requires_grad_(True) for t in (x, w, b)]
    want = F.layer_norm(refs[0], (h,), refs[1], refs[2], 1e-5)
    want.backward(grad.float())
    _check(got.detach(), want.detach().to(dtype), dtype, "forward")
    for a, r in zip(args, refs):
        _check(a.grad, r.grad, dtype, "backward")

    # The saved statistics are the row mean and 1 / sqrt(var + eps), in fp32.
    _, mean, invvar = ext.layer_norm_forward(x, w, b, 1e-5)
    xf = x.float().reshape(-1, h)
    torch.testing.assert_close(mean, xf.mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(invvar, (xf.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("rows", [1, 7, 64, 1031], ids=lambda r: f"rows{r}")
def test_layer_norm_backward_is_the_same_bits_for_any_thread_count(ext, rows):
    """The weight and bias gradients are sums over rows: their chunking follows the row count
    only, so 1, 2 and 3 threads give the same bits (and so do two runs)."""
    gen = torch.Generator().manual_seed(rows)
    x, grad = torch.randn(rows, 97, generator=gen), torch.randn(rows, 97, generator=gen)
    w, b = 1 + 0.1 * torch.randn(97, generator=gen), torch.zeros(97)
    _, mean, invvar = ext.layer_norm_forward(x, w, b, 1e-5)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 2):
            torch.set_num_threads(threads)
            results.append(ext.layer_norm_backward(grad, x, mean, invvar, w))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, o) for a, o in zip(results[0], other))


def test_kernels_run_on_several_threads(ext):
    """Rows are split over torch's thread pool; the result must not depend on the split."""
    x = torch.randn(8, 4, 64, 64)
    g = torch.randn(8, 4, 64, 64)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y = ext.scaled_softmax_forward(x, 0.5)
            results.append((y, ext.softmax_backward(g, y, 0.5)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
