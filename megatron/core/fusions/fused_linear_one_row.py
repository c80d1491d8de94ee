"""``F.linear`` of a single row (batch-1 decoding) as one stream over the weight, on CPU.

Decoding one token at a time turns every linear layer, and the output layer over the
vocabulary, into a matrix-vector product: each step reads every weight once and does two flops
per weight, so its speed is the memory bandwidth it reaches. torch's CPU path for an
``[1, in] x [in, out]`` product reaches about a third of this machine's read bandwidth
(bench/bench_generation.py prints both); the C++ kernel (``linear_one_row`` in
``megatron/fused_kernels/csrc/cpu/``) streams the ``[out, in]`` rows split over torch's threads,
four rows per pass over ``x``, summing in fp32.

It serves only where it is the same computation: no autograd (generation runs under
``torch.no_grad``), a CPU tensor holding one row, fp32/bf16/fp16 with one dtype throughout.
Everything else, and a build without the kernel, is ``F.linear``. The sums run in another
order than the BLAS's, so results agree with ``F.linear`` to fp32 rounding (~1e-6 relative),
not bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fusions import kernels

def _kernel_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if torch.is_grad_enabled() or x.numel() != x.size(-1) or weight.dim() != 2:
        return None
    return kernels.cpu_kernel("linear_one_row", x, weight, *(() if bias is None else (bias,)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through the one-row kernel where it applies."""
    ext = _kernel_for(x, weight, bias)
    if ext is None:
        return F.linear(x, weight, bias)
    return ext.linear_one_row(x, weight, bias)
