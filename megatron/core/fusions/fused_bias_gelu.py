"""Megatron-LM's fused bias + GeLU (``--bias-gelu-fusion``, on by default).

The tanh-approximated GeLU of ``y + bias``, as Megatron's ``bias_gelu_impl``: TorchScript
functions inside an autograd Function, so that TorchScript's fuser can merge the add with the
GeLU (forward) and the GeLU gradient with its input (backward) where it fuses (CUDA). Torch
keeps its CPU fuser off, so on CPU the same aten ops run one after the other.

Megatron's Function saves ``y`` and the bias and recomputes the sum in the backward; here the
sum is saved instead (what eager autograd saves for ``gelu`` anyway, same memory), because
on CPU, with nothing fused, the recomputation would be one more pass over ``[s, b, f]``.

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
    def _bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = y + bias
        return x, F.gelu(x, approximate="tanh")

    @torch.jit.script
    def _bias_gelu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


class _BiasGeLU(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x, out = _bias_gelu(bias, y)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        grad_y = _bias_gelu_backward(grad, x)
        # The bias was broadcast over [s, b]: autograd sums grad_y down to its shape.
        return grad_y, grad_y


def bias_gelu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(y + bias)`` with ``bias`` ``[f]`` broadcast over ``y`` ``[..., f]``."""
    return _BiasGeLU.apply(y, bias)
