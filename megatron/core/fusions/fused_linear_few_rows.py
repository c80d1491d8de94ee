"""``F.linear`` of one row or a few (decoding) as one stream over the weight, on CPU.

Decoding one token at a time turns every linear layer, and the output layer over the
vocabulary, into a matrix-vector product (a few-row product at batch 2-8): each step reads every
weight once and does two flops per weight and row, so its speed is the memory bandwidth it
reaches. torch's CPU path reaches about a third of this machine's read bandwidth for one row and
less for a few (bench/bench_generation.py prints both); the C++ kernel (``linear_few_rows`` in
``megatron/fused_kernels/csrc/cpu/``) streams the ``[out, in]`` rows split over torch's threads,
four weight rows per pass over one row of ``x``, or over two rows of ``x`` at a time for
several, so each weight is read from memory once per call; sums in fp32.

It serves only where it is the same computation: no autograd (generation runs under
``torch.no_grad``), a CPU tensor holding 1 to ``MAX_ROWS`` rows, fp32/bf16/fp16 with one dtype
throughout. Everything else (a prompt's many rows, training), and a build without the kernel,
is ``F.linear``. The sums run in another order than the BLAS's, so results agree with
``F.linear`` to fp32 rounding (~1e-6 relative), not bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fusions import kernels

# Rows of x the kernel takes (kMaxFewRows in the C++ source): decoding batches up to 8.
MAX_ROWS = 8


def _kernel_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if torch.is_grad_enabled() or weight.dim() != 2 or x.dim() == 0:
        return None
    if not 1 <= x.numel() // max(x.size(-1), 1) <= MAX_ROWS:
        return None
    return kernels.cpu_kernel("linear_few_rows", x, weight,
                              *(() if bias is None else (bias,)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through the few-row kernel where it applies."""
    ext = _kernel_for(x, weight, bias)
    if ext is None:
        return F.linear(x, weight, bias)
    return ext.linear_few_rows(x, weight, bias)
