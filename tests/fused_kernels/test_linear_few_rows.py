"""The few-row linear kernel (decoding's matrix-vector and few-row products,
megatron/core/fusions/fused_linear_few_rows.py) against ``F.linear``: fp32 to fp32 rounding of
the sums (another order than the BLAS's), bf16/fp16 to an ulp of the output; out sizes off every
multiple of 4 (the kernel's four-row blocks) and of the thread split; 1 to 8 rows, odd counts
included (the kernel takes rows of x two at a time); with and without bias; the shapes decoding
passes ([1, b, in], [1, in], [in]); and the cases that must stay ``F.linear`` (autograd on, more
than 8 rows, mixed dtypes, no extension)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import fused_linear_few_rows, kernels
from megatron.core.fusions.fused_linear_few_rows import linear

EXTENSION = kernels.EXTENSIONS["cpu"]
# (in, out): out = 1, 3, 5 (below and across one 4-row block), 67 and 130 (split over threads
# with a remainder), a GPT-2-sized pair, and an in not a multiple of any vector width
SIZES = [(8, 1), (16, 3), (33, 5), (64, 67), (29, 130), (768, 2304)]


pytestmark = pytest.mark.usefixtures("cpu_extension_built")


def _operands(in_features, out_features, dtype, seed=0, rows=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, in_features, generator=gen).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    return x, weight, bias


@pytest.mark.parametrize("rows", [1, 2, 3, 8], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("in_features,out_features", SIZES)
@pytest.mark.parametrize("with_bias", [True, False])
@torch.no_grad()
def test_fp32_equals_f_linear_to_rounding(in_features, out_features, with_bias, rows):
    x, weight, bias = _operands(in_features, out_features, torch.float32, rows=rows)
    bias = bias if with_bias else None
    assert fused_linear_few_rows._kernel_for(x, weight, bias) is not None
    got = linear(x, weight, bias)
    assert got.shape == (1, rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    # float64 truth: the kernel's fp32 sums are as close to it as the BLAS's
    truth = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_within_an_ulp(dtype, rows):
    x, weight, bias = _operands(768, 130, dtype, seed=1, rows=rows)
    got = linear(x, weight, bias)
    assert got.dtype == dtype
    truth = F.linear(x.double(), weight.double(), bias.double())
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    assert ((got.double() - truth).abs() <= ulp * truth.abs() + 1e-3).all()


@torch.no_grad()
def test_every_few_rows_shape_decoding_passes():
    """[s=1, b, in] as decoding a batch passes it, [b, in], and a non-contiguous x (a
    transposed view: its rows are read in their logical order)."""
    x, weight, bias = _operands(64, 67, torch.float32, seed=4, rows=6)
    for rows in (x, x.view(6, 64), x.transpose(0, 1)):
        got = linear(rows, weight, bias)
        assert got.shape == rows.shape[:-1] + (67,)
        torch.testing.assert_close(got, F.linear(rows, weight, bias), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_every_one_row_shape_decoding_passes():
    x, weight, bias = _operands(64, 67, torch.float32, seed=2)
    for row in (x, x.view(1, 64), x.view(64)):
        got = linear(row, weight, bias)
        assert got.shape == row.shape[:-1] + (67,)
        torch.testing.assert_close(got, F.linear(row, weight, bias), rtol=1e-5, atol=1e-5)
    # a non-contiguous weight (a transposed view) is read as its values
    wt = weight.t().contiguous().t()
    torch.testing.assert_close(linear(x, wt, bias), F.linear(x, weight, bias), rtol=1e-5,
                               atol=1e-5)


def test_f_linear_wherever_the_kernel_is_not_the_same_computation(monkeypatch):
    x, weight, bias = _operands(16, 8, torch.float32, seed=3)
    with torch.enable_grad():  # training: autograd needs F.linear's graph
        assert fused_linear_few_rows._kernel_for(x, weight, bias) is None
        w = weight.clone().requires_grad_(True)
        linear(x, w, bias).sum().backward()
        assert w.grad is not None
    with torch.no_grad():
        nine_rows = torch.cat([x] * 9, dim=1)  # a prompt: the BLAS's GEMM
        assert fused_linear_few_rows._kernel_for(nine_rows, weight, bias) is None
        assert fused_linear_few_rows._kernel_for(nine_rows[:, :8], weight, bias) is not None
        assert fused_linear_few_rows._kernel_for(x[..., :0], weight[:, :0], bias) is None
        assert fused_linear_few_rows._kernel_for(x, weight.double(), bias) is None
        assert fused_linear_few_rows._kernel_for(x.double(), weight.double(), None) is None
        assert fused_linear_few_rows._kernel_for(x.to("meta"), weight.to("meta"), None) is None
        monkeypatch.setitem(sys.modules, EXTENSION, None)  # no extension: F.linear
        kernels.reset()
        try:
            assert fused_linear_few_rows._kernel_for(x, weight, bias) is None
            assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
        finally:
            monkeypatch.undo()
            kernels.reset()
