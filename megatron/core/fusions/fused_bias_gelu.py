"""Megatron-LM's fused bias + GeLU (``--bias-gelu-fusion``, on by default).

The tanh-approximated GeLU of ``y + bias``, as Megatron's ``bias_gelu_impl``, written as two
TorchScript functions inside an autograd Function: the forward keeps only its inputs (``y`` and
the bias) and the backward recomputes ``y + bias``, so the sum is never stored, and TorchScript's
fuser can merge the add with the GeLU (and its gradient) into one kernel where it fuses (CUDA;
torch keeps its CPU fuser off, so on CPU the ops run one after the other).

Numerics: exactly ``F.gelu(y + bias, approximate="tanh")`` and its autograd gradient (the same
aten ops), i.e. what the unfused path computes when the tanh form is selected
(``TransformerConfig.gelu_tanh_approximation``), so switching the fusion off with
``--openai-gelu`` kept gives the same values; ``--no-bias-gelu-fusion`` alone selects the exact
erf GeLU, as in Megatron-LM 23.06.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


# torch 2.13 deprecates torch.jit.script in favour of torch.compile, which would compile C++
# at launch on CPU (what these kernels avoid); the scripted functions still work.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.script
    def _bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.gelu(y + bias, approximate="tanh")

    @torch.jit.script
    def _bias_gelu_backward(grad: torch.Tensor, bias: torch.Tensor,
                            y: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_backward(grad, y + bias, approximate="tanh")


class _BiasGeLU(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, bias)
        return _bias_gelu(bias, y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, bias = ctx.saved_tensors
        grad_y = _bias_gelu_backward(grad, bias, y)
        # The bias was broadcast over [s, b]: autograd sums grad_y down to its shape.
        return grad_y, grad_y


def bias_gelu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(y + bias)`` with ``bias`` ``[f]`` broadcast over ``y`` ``[..., f]``."""
    return _BiasGeLU.apply(y, bias)
