"""LayerNorm with Megatron-LM's options (``--apply-layernorm-1p``), parameters replicated on all
TP ranks (``tensor_model_parallel=False``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core import device as device_mod
from megatron.core.tensor_parallel.utils import set_defaults_if_not_set


class LayerNorm(torch.nn.Module):
    """LayerNorm over the last dimension.

    Args:
        hidden_size: normalized size.
        eps: epsilon.
        apply_layernorm_1p: store ``gamma - 1`` (initialized to 0) so weight decay pulls gamma
            towards 1.
        params_dtype: dtype of weight and bias.
        device: where they live.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, apply_layernorm_1p: bool = False,
                 params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.eps, self.apply_layernorm_1p = eps, apply_layernorm_1p
        dev = device or device_mod.get_device()
        init = torch.zeros if apply_layernorm_1p else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=params_dtype, device=dev))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=dev))
        for param in (self.weight, self.bias):
            set_defaults_if_not_set(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.apply_layernorm_1p else self.weight
        return F.layer_norm(x, (x.size(-1),), weight, self.bias, self.eps)
