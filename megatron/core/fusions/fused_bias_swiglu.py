"""Megatron-LM's fused (bias +) SwiGLU (``--bias-swiglu-fusion``, on by default;
``--no-bias-swiglu-fusion`` turns it off).

``silu(gate) * up`` of the two halves of fc1's output ``y`` (``[..., 2f/p]``, this rank's
``[gate_r; up_r]``), optionally after adding fc1's bias. Autograd of the plain ops keeps
``silu(gate)`` (``f/p`` wide) besides ``y`` (``2f/p``: ``gate`` and ``up`` are views of it) for the
backward; as Megatron's ``SwiGLUFunction`` / ``BiasSwiGLUFunction`` this Function keeps ``y``
(and the bias) alone and recomputes ``silu(gate)`` in the backward: two thirds of the
activation memory of the plain ops.

Numerics: the same ATen ops in the same order as autograd of the plain ops (``silu``, ``mul``,
``silu_backward``), so the values and gradients are bit-equal to them. Inside a region that
``torch.compile`` traces (``--compile-layers``) the plain ops run: the compiler decides itself
what to save and fuses the element-wise work.

Legend: f ffn_hidden_size, p TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(y, bias)
        if bias is not None:
            y = y + bias
        gate, up = torch.chunk(y, 2, dim=-1)  # 2 x [..., f/p]
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, bias = ctx.saved_tensors
        if bias is not None:
            y = y + bias
        gate, up = torch.chunk(y, 2, dim=-1)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        grad_up = grad * F.silu(gate)
        grad_y = torch.cat((grad_gate, grad_up), dim=-1)  # [..., 2f/p]
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[1]:
            grad_bias = grad_y.reshape(-1, grad_y.size(-1)).sum(0)
        return grad_y, grad_bias


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``y + bias = [gate; up]`` (last dimension), saving only ``y`` and
    the bias for the backward: ``[..., 2f/p]`` -> ``[..., f/p]``."""
    if torch.compiler.is_compiling():
        if bias is not None:
            y = y + bias
        gate, up = torch.chunk(y, 2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(y, bias)
