"""The fused bias + tanh-GeLU (megatron.core.fusions.fused_bias_gelu) on CPU: the C++ kernel
forward and backward (grad_y and grad_bias) against ``F.gelu(y + b, approximate="tanh")``
autograd and against the float64 function, fp32/bf16/fp16, odd shapes, extreme values,
determinism, and the TorchScript fallback.

Tolerances: fp32 within 1e-6 relative or 1e-6 absolute of float64 and of ATen's fp32 values
(ATen's own error near 0, where 1 + tanh(u) cancels, is of that order), grad_y within 5e-6 of
ATen's (whose 1 - tanh(u)^2 is off by up to ~3e-6); the bias gradient, a sum over the rows,
within 1e-6 x the row count (absolute, per unit of gradient).
bf16/fp16: within the output's rounding (half an ulp: 2^-8 relative for bf16, 2^-11 for fp16)
of the float64 function of the same rounded inputs (the kernel computes in fp32 and rounds once),
and within the roundings eager adds of eager's values.
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import fused_bias_gelu, kernels
from megatron.core.fusions.fused_bias_gelu import bias_gelu

EXTENSION = kernels.EXTENSIONS["cpu"]
HALF_ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # half an ulp, relative
# [..., f]: f off every multiple of 8/16, one row, one column, 3-D, a row longer than 2048
SHAPES = [(1, 1), (1, 37), (5, 3, 13), (3, 2, 4, 29), (17, 2053), (64, 7)]


@pytest.fixture(scope="module", autouse=True)
def extension_built(cpu_extension_built):
    assert fused_bias_gelu._cpu_kernel(torch.zeros(2, 3), torch.zeros(3)) is not None


def _inputs(shape, dtype, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    y = (torch.randn(shape, generator=gen) * scale).to(dtype)
    bias = torch.randn(shape[-1], generator=gen).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return y, bias, grad


def _run(fn, y, bias, grad):
    """(out, grad_y, grad_bias) of fn(y, bias) with upstream gradient ``grad``."""
    y, bias = y.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    out = fn(y, bias)
    out.backward(grad)
    return out.detach(), y.grad, bias.grad


def _eager(y, bias):
    return F.gelu(y + bias, approximate="tanh")


def _float64(y, bias, grad):
    """The function and its gradients in float64, from the same (rounded) inputs."""
    return _run(_eager, y.double(), bias.double(), grad.double())


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_aten_and_float64(shape):
    y, bias, grad = _inputs(shape, torch.float32)
    out, grad_y, grad_bias = _run(bias_gelu, y, bias, grad)
    assert out.grad_fn is None and grad_y.dtype == torch.float32
    ref = _run(_eager, y, bias, grad)
    exact = _float64(y, bias, grad)
    rows = y.numel() // shape[-1]
    # ATen's gradient, 1 - tanh(u)^2 in fp32, is off by up to ~3e-6 itself: 5e-6 against it
    aten_atol = (1e-6, 5e-6, 1e-6 * rows)
    for got, want, best, atol, exact_atol in zip((out, grad_y, grad_bias), ref, exact, aten_atol,
                                                 (1e-6, 1e-6, 1e-6 * rows)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=atol)
        torch.testing.assert_close(got.double(), best, rtol=1e-6, atol=exact_atol)


def test_the_kernel_path_ran_and_saves_y_and_bias():
    y, bias, _ = _inputs((4, 3, 24), torch.float32)
    y.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = bias_gelu(y, bias)
    assert type(out.grad_fn).__name__ == "_BiasGeLUKernelBackward"
    assert len(saved) == 2 and saved[0] is y and saved[1] is bias  # Megatron's: y and the bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 37), (5, 3, 13), (17, 2053)])
def test_half_precision_within_its_rounding(shape, dtype):
    y, bias, grad = _inputs(shape, dtype)
    got = _run(bias_gelu, y, bias, grad)
    exact = _float64(y, bias, grad)
    rows = y.numel() // shape[-1]
    for g, want, atol in zip(got, exact, (1e-6, 1e-6, 1e-5 * rows)):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), want, rtol=HALF_ULP[dtype], atol=atol)
    # Eager rounds y + b to the storage dtype before the GeLU (the kernel does not): they differ
    # by at most eager's rounding of the sum (half an ulp of x, times |gelu'| <= 1.13) and of its
    # output, plus the kernel's rounding of its output.
    ours, eager = got[0].double(), _eager(y, bias).double()
    x = y.double() + bias.double()
    bound = HALF_ULP[dtype] * (eager.abs() + ours.abs() + 1.13 * x.abs()) + 1e-6
    assert ((ours - eager).abs() <= bound).all()


def test_extreme_values_behave_as_aten():
    values = [float("-inf"), -1e20, -1e13, -1e4, -100.0, -10.0, -5.0, -3.0, -1e-30, 0.0, 1e-30,
              3.0, 100.0, 1e4, 1e13, 1e20, float("inf"), float("nan")]
    y = torch.tensor(values).repeat(3, 1)  # [3, 18]: the vector loop and its remainder
    bias = torch.zeros(y.shape[-1])
    grad = torch.ones_like(y)
    got = _run(bias_gelu, y, bias, grad)
    ref = _run(_eager, y, bias, grad)
    for g, want in zip(got[:2], ref[:2]):
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6, equal_nan=True)
        assert torch.equal(g.isnan(), want.isnan()) and torch.equal(g.isinf(), want.isinf())
    # the same bits where the GeLU is -0 (x < -9.7) or x itself (x > 1e3), infinities included
    exact = ~ref[0].isnan() & ((y < -9.7) | (y > 1e3))
    assert torch.equal(got[0][exact], ref[0][exact])
    assert torch.equal(got[0][exact].signbit(), ref[0][exact].signbit())
    # a NaN anywhere in a column reaches its bias gradient, as the eager sum
    assert torch.equal(got[2].isnan(), ref[2].isnan())


def test_large_negative_inputs_give_no_subnormals():
    y = torch.linspace(-12.0, -4.0, 4001).view(1, -1)
    out, grad_y, _ = _run(bias_gelu, y, torch.zeros(y.shape[-1]), torch.ones_like(y))
    tiny = torch.finfo(torch.float32).tiny
    for t in (out, grad_y):
        assert not ((t != 0) & (t.abs() < tiny)).any()
    assert (out[y < -9.7] == 0).all() and (grad_y[y < -9.7] == 0).all()


def test_deterministic_and_independent_of_the_thread_count():
    y, bias, grad = _inputs((300, 2, 45), torch.float32, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first, second = _run(bias_gelu, y, bias, grad), _run(bias_gelu, y, bias, grad)
        torch.set_num_threads(1)
        single = _run(bias_gelu, y, bias, grad)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_non_contiguous_input_and_frozen_bias():
    y, bias, grad = _inputs((6, 40), torch.float32, seed=4)
    y_t = y.t().contiguous().t()  # the same values, column-major
    assert not y_t.is_contiguous()
    y_t.requires_grad_(True)
    out = bias_gelu(y_t, bias)  # bias does not require grad
    out.backward(grad)
    ref = _run(_eager, y, bias, grad)
    torch.testing.assert_close(out.detach(), ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y_t.grad, ref[1], rtol=1e-6, atol=5e-6)


def test_kernel_rejects_mismatched_inputs():
    ext = importlib.import_module(EXTENSION)
    with pytest.raises(RuntimeError, match="bias \\[f\\]"):
        ext.bias_gelu_forward(torch.zeros(2, 3), torch.zeros(4))
    with pytest.raises(RuntimeError, match="share one dtype"):
        ext.bias_gelu_forward(torch.zeros(2, 3), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="grad must have"):
        ext.bias_gelu_backward(torch.zeros(2, 4), torch.zeros(2, 3), torch.zeros(3))


def test_fallback_when_the_extension_is_unimportable(monkeypatch):
    y, bias, grad = _inputs((7, 3, 40), torch.float32, seed=5)
    kernel = _run(bias_gelu, y, bias, grad)
    monkeypatch.setitem(sys.modules, EXTENSION, None)  # import now raises ImportError
    kernels.reset()
    try:
        assert fused_bias_gelu._cpu_kernel(y, bias) is None
        probe = bias_gelu(y.clone().requires_grad_(True), bias)
        assert type(probe.grad_fn).__name__ == "_BiasGeLUBackward"
        for _ in range(3):  # TorchScript specialises after its profiling runs: all of them agree
            fallback = _run(bias_gelu, y, bias, grad)
            ref = _run(_eager, y, bias, grad)
            assert torch.equal(fallback[0], ref[0]) and torch.equal(fallback[1], ref[1])
            torch.testing.assert_close(fallback[2], ref[2], rtol=1e-6, atol=1e-6)
    finally:
        monkeypatch.undo()
        kernels.reset()
    for got, want in zip(kernel, fallback):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_fallback_for_an_old_build_and_for_uncovered_inputs(monkeypatch):
    y, bias, _ = _inputs((4, 8), torch.float32)
    # an extension built before the kernel existed still serves the other fusions
    monkeypatch.setattr(kernels, "extension", lambda device_type: SimpleNamespace())
    assert fused_bias_gelu._cpu_kernel(y, bias) is None
    monkeypatch.undo()
    assert fused_bias_gelu._cpu_kernel(y.double(), bias.double()) is None
    assert fused_bias_gelu._cpu_kernel(y, bias.bfloat16()) is None
    assert fused_bias_gelu._cpu_kernel(y, bias[:4]) is None
    # not a CPU tensor (CUDA in training): the TorchScript path
    assert fused_bias_gelu._cpu_kernel(y.to("meta"), bias.to("meta")) is None
    out = bias_gelu(y.double(), bias.double())
    assert torch.equal(out, _eager(y.double(), bias.double()))
