"""A fully masked query row (a padding query of BERT's padding mask) on each of the three
attention paths (SDPA, the unfused PyTorch softmax, the fused softmax kernel) gets what
Megatron-LM gives it for the dtype: the uniform row of its PyTorch softmax (the mean of the
values) in fp32, zeros from its fused CUDA kernel in fp16/bf16 with --masked-softmax-fusion
(the uniform row again without it). The other rows are unchanged and agree across paths.

Legend: s sequence, b batch, np heads, hn head size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.core import device
from megatron.core.transformer.attention import CoreAttention
from megatron.core.transformer.config import TransformerConfig

S, B, NP, HN = 8, 2, 2, 16
REAL = 5  # sample 1: 5 real tokens, queries and keys 5.. are padding
CONFIG = TransformerConfig(num_layers=2, hidden_size=NP * HN, num_attention_heads=NP,
                           hidden_dropout=0.0, attention_dropout=0.0)
PATHS = {"sdpa": dict(attention_backend="auto"),
         "unfused": dict(attention_backend="unfused", masked_softmax_fusion=False),
         "fused": dict(attention_backend="unfused", masked_softmax_fusion=True)}


def _inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(S, B, NP, HN, generator=gen, dtype=torch.float64).to(dtype)
               .to(device.get_device()) for _ in range(3)]
    pad = torch.zeros(B, S, dtype=torch.bool, device=device.get_device())
    pad[1, REAL:] = True
    mask = pad[:, None, :, None] | pad[:, None, None, :]  # [b, 1, s, s], Megatron BERT's
    return q, k, v, mask


def _run(path: str, dtype, fusion: bool | None = None):
    fields = dict(PATHS[path])
    if fusion is not None and path == "sdpa":
        fields["masked_softmax_fusion"] = fusion
    q, k, v, mask = _inputs(dtype)
    attention = CoreAttention(dataclasses.replace(CONFIG, **fields), 1, "padding").eval()
    with torch.no_grad():
        out = attention(q, k, v, mask).view(S, B, NP, HN)  # [s, b, np, hn]
    return out.double(), v.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_fully_masked_row_is_megatrons_for_the_dtype(path, dtype):
    out, v = _run(path, dtype, fusion=True)
    padding = out[REAL:, 1]  # [s - REAL, np, hn]
    zero = dtype == torch.bfloat16 and PATHS[path].get("masked_softmax_fusion", True)
    if zero:
        assert torch.equal(padding, torch.zeros_like(padding)), path
    else:
        mean = v[:, 1].mean(dim=0)  # [np, hn]: a uniform softmax over every key
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        assert (padding - mean).abs().max() <= tol, path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_paths_agree_on_every_row(dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    reference = {path: _run(path, dtype)[0] for path in PATHS}
    # With fusion on (the default) every path gives Megatron's fused rows in half precision;
    # the unfused path without fusion is Megatron's PyTorch path.
    assert (reference["sdpa"] - reference["fused"]).abs().max() <= tol
    real = reference["unfused"][:, 0], reference["sdpa"][:, 0]
    assert (real[0] - real[1]).abs().max() <= tol
