"""LayerNorm with Megatron-LM's options (``--apply-layernorm-1p``), parameters replicated on all
TP ranks (``tensor_model_parallel=False``).

It runs the fused layer-norm kernel (``megatron.core.fusions.fused_layer_norm``: C++ on CPU,
CUDA on GPUs), as Megatron always runs APEX's fused layer norm, and ``F.layer_norm`` where no
kernel covers the device or dtype (float64, an extension that was not built: logged once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core import device as device_mod
from megatron.core.fusions.fused_layer_norm import fused_layer_norm, fused_rms_norm
from megatron.core.tensor_parallel.utils import (set_defaults_if_not_set,
                                                 set_sequence_parallel_attribute)


class _ReplicatedNorm(torch.nn.Module):
    """What LayerNorm and RMSNorm share: the weight (and optionally a bias) over the last
    dimension, replicated on all TP ranks, ``--apply-layernorm-1p``'s storage of ``gamma - 1``,
    and the sequence-parallel marking of partial gradients."""

    def __init__(self, hidden_size: int, eps: float, apply_layernorm_1p: bool,
                 params_dtype: torch.dtype, device: torch.device | None, fused: bool,
                 sequence_parallel: bool, bias: bool) -> None:
        super().__init__()
        self.eps, self.apply_layernorm_1p, self.fused = eps, apply_layernorm_1p, fused
        dev = device or device_mod.get_device()
        init = torch.zeros if apply_layernorm_1p else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=params_dtype, device=dev))
        params = [self.weight]
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype,
                                                       device=dev))
            params.append(self.bias)
        for param in params:
            set_defaults_if_not_set(param)
            set_sequence_parallel_attribute(param, sequence_parallel)

    def gamma(self) -> torch.Tensor:
        """The multiplier the norm applies (``weight + 1`` with ``--apply-layernorm-1p``)."""
        return self.weight + 1 if self.apply_layernorm_1p else self.weight


class LayerNorm(_ReplicatedNorm):
    """LayerNorm over the last dimension.

    Args:
        hidden_size: normalized size.
        eps: epsilon.
        apply_layernorm_1p: store ``gamma - 1`` (initialized to 0) so weight decay pulls gamma
            towards 1.
        params_dtype: dtype of weight and bias.
        device: where they live.
        fused: use the fused kernel where one is built (False: always ``F.layer_norm``).
        sequence_parallel: it normalizes this rank's ``s/p`` rows (sequence parallelism):
            weight and bias are marked so their partial gradients are summed over TP ranks.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, apply_layernorm_1p: bool = False,
                 params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, fused: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__(hidden_size, eps, apply_layernorm_1p, params_dtype, device, fused,
                         sequence_parallel, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.gamma()
        if self.fused:
            out = fused_layer_norm(x, weight, self.bias, self.eps)
            if out is not None:
                return out
        return F.layer_norm(x, (x.size(-1),), weight, self.bias, self.eps)


class RMSNorm(_ReplicatedNorm):
    """Root-mean-square norm over the last dimension (``--normalization RMSNorm``): no mean
    subtraction, no bias; ``weight`` replicated on all TP ranks.

    As Megatron-LM's PyTorch ``RMSNorm``, half-precision inputs are normalized in fp32 and cast
    back before the weight multiplies (a sum of squares in fp16 overflows at |x| ~ 256/sqrt(h)).
    It runs the fused RMS-norm kernel (``megatron.core.fusions.fused_layer_norm``) where one
    covers the device and dtype and beats PyTorch there (``kernels.FASTER_THAN_PYTORCH``: the
    C++ kernel on CPU), with the same roundings; on CUDA ATen's fused ``F.rms_norm``
    (:func:`rms_norm_aten`, faster than both Megatron's ops and our CUDA kernel); else the
    PyTorch ops of :func:`rms_norm_reference`.

    Args: as :class:`LayerNorm`'s (no bias); ``fused``: use the fused kernel where it is the
    default (False: always the PyTorch ops).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, apply_layernorm_1p: bool = False,
                 params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, fused: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__(hidden_size, eps, apply_layernorm_1p, params_dtype, device, fused,
                         sequence_parallel, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.gamma()
        if self.fused:
            out = fused_rms_norm(x, weight, self.eps)
            if out is not None:
                return out
        if x.device.type == "cuda":
            return rms_norm_aten(x, weight, self.eps)
        return rms_norm_reference(x, weight, self.eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Megatron-LM's PyTorch RMSNorm: fp16/bf16 normalized in fp32 and cast back, then times the
    weight (fp64 stays fp64)."""
    compute = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normed = compute * torch.rsqrt(compute.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


def rms_norm_aten(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Megatron-LM's RMSNorm through ATen's ``F.rms_norm`` (one fused kernel on CUDA): it
    normalizes half-precision rows in fp32 and rounds the result to ``x``'s dtype, as Megatron;
    the weight multiplies after that rounding, outside the call, so the two roundings are
    Megatron's (a weight inside would be applied before the one rounding)."""
    return F.rms_norm(x, (x.size(-1),), None, eps) * weight


def build_norm(config, hidden_size: int | None = None,
               partial_grads: bool | None = None) -> torch.nn.Module:
    """The norm a :class:`~megatron.core.transformer.config.TransformerConfig` asks for
    (``normalization``, ``layernorm_epsilon``, ``apply_layernorm_1p``).

    ``partial_grads``: each TP rank sees only part of the norm's rows, so its weight gradients
    are summed over TP ranks (the ``sequence_parallel`` attribute); default: sequence
    parallelism is on."""
    if partial_grads is None:
        partial_grads = config.sequence_parallel
    kwargs = dict(eps=config.layernorm_epsilon, apply_layernorm_1p=config.apply_layernorm_1p,
                  params_dtype=config.params_dtype, sequence_parallel=partial_grads)
    size = config.hidden_size if hidden_size is None else hidden_size
    if config.normalization == "RMSNorm":
        return RMSNorm(size, **kwargs)
    return LayerNorm(size, **kwargs)
