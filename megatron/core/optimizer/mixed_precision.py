"""fp16/bf16 training without sharding: fp32 main params beside the half-precision model.

:class:`Float16OptimizerWithFloat16Params` keeps an fp32 copy ("main param") of every fp16/bf16
model param; fp32 model params are stepped directly. Each step copies the model grads into fp32
main grads (an alias when the DDP buffer is already fp32), runs the shared step of
:class:`~megatron.core.optimizer.optimizer.MegatronOptimizer` (unscale + inf check with fp16),
and copies the main params back into the model (rounding to fp16/bf16).

State dict (docs/FORMATS.md 2d): ``{"optimizer": torch state dict, "grad_scaler": scaler
state (fp16 only), "fp32_from_fp16_params": list (per group) of lists of fp32 main params}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron.core.log import warn_rank_0
from megatron.core.optimizer.optimizer import (MegatronOptimizer, adapt_torch_state_dict,
                                               copy_param_attributes, model_grad)

_HALF = (torch.float16, torch.bfloat16)


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """Mixed-precision optimizer over fp32 main copies of half-precision params.

    Args:
        param_groups: groups of model params (with 'lr_mult'/'wd_mult' etc.).
        optimizer_factory: builds the torch optimizer from groups of main params.
        **kwargs: see :class:`MegatronOptimizer`.
    """

    def __init__(self, param_groups: list[dict[str, Any]],
                 optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 **kwargs: Any) -> None:
        self.float16_groups: list[list[torch.nn.Parameter]] = []
        self.fp32_from_float16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.nn.Parameter]] = []
        main_groups = []
        for group in param_groups:
            half, main_of_half, fp32, mains = [], [], [], []
            for param in group["params"]:
                if param.dtype in _HALF:
                    main = param.detach().clone().float()
                    copy_param_attributes(param, main)
                    half.append(param)
                    main_of_half.append(main)
                    mains.append(main)
                else:
                    fp32.append(param)
                    mains.append(param)
            self.float16_groups.append(half)
            self.fp32_from_float16_groups.append(main_of_half)
            self.fp32_from_fp32_groups.append(fp32)
            main_groups.append({**group, "params": mains})
        super().__init__(optimizer_factory(main_groups), **kwargs)
        self._pairs = [(m, p) for halfs, mains in zip(self.float16_groups,
                                                      self.fp32_from_float16_groups)
                       for p, m in zip(halfs, mains)]
        self._fp32_params = [p for group in self.fp32_from_fp32_groups for p in group]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop model and main gradients (the DDP buffer is zeroed by ``zero_grad_buffer``)."""
        for main, param in self._pairs:
            main.grad = None
            param.grad = None
        for param in self._fp32_params:
            param.grad = None

    def _copy_model_grads_to_main_grads(self) -> None:
        for main, param in self._pairs:
            grad = model_grad(param)
            # .float() of an fp32 buffer view is the view itself: no copy with fp32 grads.
            main.grad = None if grad is None else grad.float()
        for param in self._fp32_params:
            param.grad = model_grad(param)

    def _copy_main_params_to_model_params(self) -> None:
        if self._pairs:
            torch._foreach_copy_([p.data for _, p in self._pairs], [m for m, _ in self._pairs])
        for param in self._fp32_params:
            param.grad = None  # see FP32Optimizer: no alias of the buffer may outlive the step

    def reload_model_params(self) -> None:
        """Refresh the main params from the model (after loading a model checkpoint)."""
        with torch.no_grad():
            for main, param in self._pairs:
                main.copy_(param.float())

    def state_dict(self) -> dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        state["fp32_from_fp16_params"] = self.fp32_from_float16_groups
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a Megatron fp16/bf16 optimizer state dict.

        Raises:
            ValueError: the saved main params do not match this model's.
        """
        self.optimizer.load_state_dict(adapt_torch_state_dict(self.optimizer,
                                                              state_dict["optimizer"]))
        if self.grad_scaler is not None:
            if "grad_scaler" in state_dict:
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
            else:
                warn_rank_0("the checkpoint has no grad scaler state: keeping the initial scale")
        saved = state_dict["fp32_from_fp16_params"]
        if [len(g) for g in saved] != [len(g) for g in self.fp32_from_float16_groups]:
            raise ValueError("the checkpoint's fp32_from_fp16_params groups "
                             f"{[len(g) for g in saved]} do not match this model's "
                             f"{[len(g) for g in self.fp32_from_float16_groups]}")
        with torch.no_grad():
            for mine, theirs in zip(self.fp32_from_float16_groups, saved):
                for main, value in zip(mine, theirs):
                    main.copy_(value)
