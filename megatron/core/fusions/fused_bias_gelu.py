"""Megatron-LM's fused bias + GeLU (``--bias-gelu-fusion``, on by default).

The tanh-approximated GeLU of ``y + bias`` and its gradient, as Megatron's ``bias_gelu_impl``,
by one of two implementations of the same autograd contract (inside a region that
``torch.compile`` traces, ``--compile-layers``, the plain ATen ops instead):

* CPU tensors, with the C++ extension built (``megatron.fused_kernels._cpu``, loaded through
  :mod:`megatron.core.fusions.kernels`): one pass over ``y`` computes ``y + bias`` and the GeLU
  in fp32 (fp32, bf16 or fp16 storage); as Megatron's Function it saves ``y`` and the bias, and
  the backward recomputes the sum in the same pass that computes ``grad_y`` and sums it over the
  rows into the bias gradient (fp32 partial sums per fixed chunk of rows, added in a fixed
  order: the same bits run to run and for any thread count).
* Otherwise (CUDA, where TorchScript's fuser merges the ops; or a CPU without the extension):
  TorchScript functions inside an autograd Function. On CPU, where torch keeps that fuser off,
  the same aten ops then run one after the other, and the sum is saved instead of ``y`` (what
  eager autograd saves for ``gelu``, same memory) so that the backward does not add a pass.

Numerics: the TorchScript path is exactly ``F.gelu(y + bias, approximate="tanh")`` and its
autograd gradient. The C++ kernel computes the same function as ``x * sigmoid(2u)``
(``= 0.5 x (1 + tanh(u))``, ``u = sqrt(2/pi) (x + 0.044715 x^3)``) with a polynomial exp: within
~1e-6 (relative, or absolute near 0) of ATen's fp32 values, about as close to the float64
function as they are (closer for the gradient, which avoids ``1 - tanh^2``), not bitwise equal.
Below x = -9.7 it gives -0 and a zero gradient, as ATen does (whose fp32 ``tanh(u)`` is already
-1 from x = -5.1, where the true values are below 2e-7); infinities and NaN give what ATen gives. In
bf16/fp16 the sum ``y + bias`` is not rounded to the storage dtype before the GeLU (eager rounds
it), so results may differ from eager by an ulp. The unfused path (``--openai-gelu`` kept, or
``TransformerConfig.gelu_tanh_approximation``) computes ATen's values; ``--no-bias-gelu-fusion``
alone selects the exact erf GeLU, as in Megatron-LM 23.06.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch
import torch.nn.functional as F

from megatron.core.fusions import kernels

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
    """The TorchScript implementation (CUDA, or CPU without the extension)."""

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


class _BiasGeLUKernel(torch.autograd.Function):
    """The C++ kernel: saves ``y`` and the bias, returns the bias gradient already summed."""

    @staticmethod
    def forward(ctx, ext: ModuleType, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        y = y.contiguous()
        ctx.ext = ext
        ctx.save_for_backward(y, bias)
        return ext.bias_gelu_forward(y, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, bias = ctx.saved_tensors
        grad_y, grad_bias = ctx.ext.bias_gelu_backward(grad.contiguous(), y, bias)
        return None, grad_y, grad_bias


def _cpu_kernel(y: torch.Tensor, bias: torch.Tensor) -> ModuleType | None:
    """The CPU extension when it covers these inputs, else ``None``."""
    if bias.dim() != 1 or y.dim() < 1 or bias.shape[0] != y.shape[-1]:
        return None
    return kernels.cpu_kernel("bias_gelu_forward", y, bias)


def bias_gelu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(y + bias)`` with ``bias`` ``[f]`` broadcast over ``y`` ``[..., f]``."""
    if torch.compiler.is_compiling():
        # Traced by torch.compile (--compile-layers): the plain ops, which inductor fuses
        # with their neighbours and differentiates itself (a Function would be opaque).
        return F.gelu(y + bias, approximate="tanh")
    ext = _cpu_kernel(y, bias)
    if ext is not None:
        return _BiasGeLUKernel.apply(ext, y, bias)
    return _BiasGeLU.apply(y, bias)
