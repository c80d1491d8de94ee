"""Layer norm and RMS norm through the fused kernels: one pass computes the row statistics in fp32
and the output, saving the statistics (mean and inverse standard deviation; RMS norm: the inverse
root mean square) for a backward that produces the input and weight (and bias) gradients in one
pass over the rows (fp32 accumulation for fp16/bf16)."""

from __future__ import annotations

from types import ModuleType

import torch

from megatron.core.fusions import kernels


class _FusedLayerNormAffine(torch.autograd.Function):

    @staticmethod
    def forward(ctx, ext: ModuleType, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> torch.Tensor:
        x = x.contiguous()
        y, mean, invvar = ext.layer_norm_forward(x, weight, bias, eps)
        ctx.ext = ext
        ctx.save_for_backward(x, weight, mean, invvar)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, mean, invvar = ctx.saved_tensors
        grad_x, grad_w, grad_b = ctx.ext.layer_norm_backward(grad_y.contiguous(), x, mean,
                                                            invvar, weight)
        return None, grad_x, grad_w, grad_b, None


def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     eps: float) -> torch.Tensor | None:
    """Layer norm of ``x`` over its last dim (weight and bias ``[h]`` of ``x``'s dtype), or
    ``None`` when no kernel covers the inputs or ATen's is faster on the device (CUDA: see
    :data:`kernels.FASTER_THAN_PYTORCH`); the caller then runs ``F.layer_norm``."""
    if x.dtype not in kernels.KERNEL_DTYPES or weight.dtype != x.dtype or bias.dtype != x.dtype:
        return None
    ext = kernels.preferred("layer_norm", x.device.type)
    if ext is None:
        return None
    return _FusedLayerNormAffine.apply(ext, x, weight, bias, float(eps))


class _FusedRMSNorm(torch.autograd.Function):

    @staticmethod
    def forward(ctx, ext: ModuleType, x: torch.Tensor, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
        x = x.contiguous()
        y, rstd = ext.rms_norm_forward(x, weight, eps)
        ctx.ext = ext
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = ctx.ext.rms_norm_backward(grad_y.contiguous(), x, rstd, weight)
        return None, grad_x, grad_w, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Megatron's RMSNorm of ``x`` over its last dim (``weight`` ``[h]`` of ``x``'s dtype): the
    normalized row in fp32, rounded to ``x``'s dtype, times the weight; or ``None`` when no
    kernel covers the inputs or PyTorch is faster on the device
    (:data:`kernels.FASTER_THAN_PYTORCH`), an extension built before the kernel included."""
    if x.dtype not in kernels.KERNEL_DTYPES or weight.dtype != x.dtype:
        return None
    ext = kernels.preferred("rms_norm", x.device.type)
    if ext is None or not hasattr(ext, "rms_norm_forward"):
        return None
    return _FusedRMSNorm.apply(ext, x, weight, float(eps))
