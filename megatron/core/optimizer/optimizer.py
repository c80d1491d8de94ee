"""The optimizer interface the training loop calls, and the fp32 optimizer.

Every Megatron optimizer wraps a torch optimizer (AdamW or SGD) and offers::

    optimizer.zero_grad()
    loss = optimizer.scale_loss(loss); loss.backward()    # x loss scale (1 without fp16)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    optimizer.param_groups          # 'lr', 'weight_decay', 'lr_mult', 'wd_mult' per group
    optimizer.get_loss_scale()      # a 1-element fp32 tensor
    optimizer.state_dict() / optimizer.load_state_dict(sd)
    optimizer.reload_model_params() # after loading weights without the optimizer state

``step()`` = copy the model gradients (``param.main_grad`` from the DDP buffers, else
``param.grad``) to the main gradients; with a loss scaler, unscale them, find inf/nan (MAX over the
model-parallel ranks so every rank agrees), update the scaler and skip the step on overflow; clip
by the global norm; count zeros if asked; step; copy the main params back into the model.

:class:`FP32Optimizer` is the fp32 case: no copies, the torch optimizer steps the model parameters
with ``param.grad`` pointed at ``param.main_grad``; its state dict is the torch optimizer's.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core import comm, device
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer.grad_scaler import ConstantGradScaler
from megatron.core.timers import Timers, timed

StepResult = tuple[bool, float | None, int | None]

# Attributes the norm filter reads; main params inherit them from their model params.
_PARAM_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
                "allreduce")


def copy_param_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy Megatron's parallelism attributes from a model param to its main param."""
    for name in _PARAM_ATTRS:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


def model_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the DDP wrapper produced: ``main_grad`` if set, else ``grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def merged_param_group(mine: dict[str, Any], saved: dict[str, Any],
                       keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """A saved param group over this optimizer's own: options the saved group lacks (apex
    ``FusedAdam`` has no ``fused``, ``foreach``, ``decoupled_weight_decay``...) keep ``mine``'s
    values instead of torch's load-time defaults; ``keep`` names keys always taken from
    ``mine``."""
    return {**{k: v for k, v in mine.items() if k != "params" or "params" in keep},
            **{k: v for k, v in saved.items() if k not in keep}}


def adapt_torch_state_dict(optimizer: torch.optim.Optimizer,
                           state_dict: dict[str, Any]) -> dict[str, Any]:
    """A saved torch optimizer state dict, made loadable into ``optimizer`` (a new dict).

    Megatron-LM trains with apex ``FusedAdam``, which keeps ``step`` in each param group instead
    of each parameter's state: torch's Adam then raises ``KeyError: 'step'``, so the group's step
    is copied into every parameter state that lacks one. Group options the saved dict lacks
    (``FusedAdam`` has no ``fused``, ``foreach``, ``decoupled_weight_decay``...) are taken from
    ``optimizer``'s own groups rather than torch's load-time defaults (which would, e.g., drop
    the fused CPU kernel chosen at build time).
    """
    current = optimizer.param_groups
    groups = [merged_param_group(current[i] if i < len(current) else {}, saved)
              for i, saved in enumerate(state_dict.get("param_groups", []))]
    state = {key: dict(value) for key, value in state_dict.get("state", {}).items()}
    for group in groups:
        if "step" not in group:
            continue
        for param_id in group["params"]:
            if param_id in state and state[param_id] and "step" not in state[param_id]:
                # torch's optimizers move "step" where their policy wants it on load.
                state[param_id]["step"] = torch.tensor(float(group["step"]),
                                                       dtype=torch.float32, device="cpu")
    return {**state_dict, "state": state, "param_groups": groups}


class MegatronOptimizer:
    """Base of the Megatron optimizers: loss scaling, inf check, clipping, zero counting.

    Args:
        optimizer: the torch optimizer over the main params.
        clip_grad: clip to this global norm; 0 disables.
        log_num_zeros_in_grad: count zero gradient elements at every step.
        grad_scaler: the fp16 loss scaler, or None.
        mp_group: the model-parallel (TP x PP) group the norm / inf flag are reduced over
            (None: this rank alone).
        tensor_model_parallel_rank: this rank's TP rank (TP duplicates count on rank 0 only).
        timers: times the parts of each step under Megatron-LM's level-1 names
            (``optimizer-copy-to-main-grad``, ``optimizer-unscale-and-check-inf``, ...).
        barrier_with_l1_time: ``--barrier-with-L1-time`` for those timers.
        expert_dp_group: with expert parallelism, the expert-data-parallel group (the expert
            gradients' reduction and, with the distributed optimizer, their sharding).
        expert_mp_group: with expert parallelism, the expert model-parallel group (ETP x EP x
            PP): the expert parameters (``allreduce = False``) are counted in the norm over it,
            the others over ``mp_group``, each exactly once. None: no expert parallelism.
        expert_tensor_parallel_rank: this rank's expert TP rank: an expert parameter
            replicated over the expert TP group (fc2's bias) counts on its rank 0 only.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, clip_grad: float,
                 log_num_zeros_in_grad: bool, grad_scaler: ConstantGradScaler | None,
                 mp_group: comm.ProcessGroup | None,
                 tensor_model_parallel_rank: int, timers: Timers | None = None,
                 barrier_with_l1_time: bool = False,
                 expert_dp_group: comm.ProcessGroup | None = None,
                 expert_mp_group: comm.ProcessGroup | None = None,
                 expert_tensor_parallel_rank: int = 0) -> None:
        self.optimizer = optimizer
        self.expert_tp_rank = expert_tensor_parallel_rank
        self.expert_dp_group = expert_dp_group
        self.expert_mp_group = expert_mp_group
        self.expert_parallel = expert_mp_group is not None
        self.clip_grad = clip_grad
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.grad_scaler = grad_scaler
        self.mp_group = mp_group
        self.tp_rank = tensor_model_parallel_rank
        self.timers = timers
        self.barrier_with_l1_time = barrier_with_l1_time
        self._unit_scale = torch.tensor([1.0], dtype=torch.float32, device=device.get_device())

    # Hooks the subclasses fill in ---------------------------------------------------------
    def main_params(self) -> list[torch.Tensor]:
        """The tensors the torch optimizer steps."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def reduction_groups(self) -> list[comm.ProcessGroup | None]:
        """Groups over which per-rank norms and inf flags are combined."""
        return [self.mp_group]

    def expert_reduction_groups(self) -> list[comm.ProcessGroup | None]:
        """Groups over which the expert parameters' per-rank norms are combined."""
        return [self.expert_mp_group]

    def _copy_model_grads_to_main_grads(self) -> None:
        raise NotImplementedError

    def _copy_main_params_to_model_params(self) -> None:
        raise NotImplementedError

    def reload_model_params(self) -> None:
        """Copy the model params into the main params (after a load without optimizer state:
        ``--finetune``, ``--no-load-optim``, release checkpoints), so the first step does not
        write the initial weights back over the loaded ones."""
        raise NotImplementedError

    # The step ------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's param groups (the LR scheduler writes 'lr'/'weight_decay')."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale as a 1-element fp32 tensor (1 without a scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else self._unit_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (what backward should run on)."""
        scale = self.get_loss_scale().to(device=loss.device, dtype=loss.dtype).reshape(())
        return loss * scale

    def _main_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.main_params() if p.grad is not None]

    def _grads_for_norm(self) -> list[torch.Tensor]:
        return [p.grad for p in self.main_params()
                if p.grad is not None and clip_grads.param_is_not_shared(p)
                and clip_grads.param_is_not_tensor_parallel_duplicate(p, self._tp_rank_of(p))]

    def _tp_rank_of(self, param: torch.Tensor) -> int:
        """The rank of the group ``param`` may be replicated over: with expert parallelism an
        expert's is the expert TP group (at ETP 1 each rank's experts are its own)."""
        if self.expert_parallel and not getattr(param, "allreduce", True):
            return self.expert_tp_rank
        return self.tp_rank

    def _norm_parts(self) -> list[tuple[list[torch.Tensor], list[comm.ProcessGroup | None]]]:
        """(grads, groups their partial norm is reduced over): with expert parallelism the
        dense and the expert gradients apart, as Megatron's chained dense and expert
        optimizers."""
        grads = self._grads_for_norm()
        if not self.expert_parallel:
            return [(grads, self.reduction_groups())]
        expert_ids = {id(p.grad) for p in self.main_params()
                      if p.grad is not None and not getattr(p, "allreduce", True)}
        return [([g for g in grads if id(g) not in expert_ids], self.reduction_groups()),
                ([g for g in grads if id(g) in expert_ids], self.expert_reduction_groups())]

    def _flag_groups(self) -> list[comm.ProcessGroup | None]:
        """Groups the inf flag is max-reduced over, one after the other, so that every rank
        agrees (with expert parallelism the expert grids too: their grads differ by rank)."""
        if not self.expert_parallel:
            return self.reduction_groups()
        return [*self.expert_reduction_groups(), self.expert_dp_group,
                *self.reduction_groups()]

    def _unscale_and_check_for_nan(self) -> bool:
        """Divide the main grads by the loss scale; True if any rank saw an inf/nan."""
        grads = self._main_grads()
        # The flag and the scale live where the gradients do (torch's kernel requires it; the
        # scaler keeps its scale on the host).
        where = grads[0].device if grads else device.get_device()
        found_inf = torch.zeros(1, dtype=torch.float32, device=where)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_inf, self.grad_scaler.inv_scale.to(where))
        for group in self._flag_groups():
            comm.all_reduce(found_inf, group, "max")
        return bool(found_inf.item() > 0)

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Global gradient norm (before clipping); clips the main grads to ``clip_grad``."""
        norm = clip_grads.get_grad_norm_fp32_parts(self._norm_parts())
        clip_grads.clip_grads_by_total_norm(self._main_grads(), clip_grad, norm)
        return norm

    def count_zeros(self) -> int:
        """Zero elements of the gradients counted by the norm, over all ranks."""
        return sum(clip_grads.count_zeros_fp32(grads, groups)
                   for grads, groups in self._norm_parts())

    @torch.no_grad()
    def step(self) -> StepResult:
        """One optimizer step.

        Returns:
            (update_successful, grad_norm or None when not clipping / skipped,
            num_zeros_in_grad or None when not counting / skipped).
        """
        with self._timed("optimizer-copy-to-main-grad"):
            self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            with self._timed("optimizer-unscale-and-check-inf"):
                found_inf = self._unscale_and_check_for_nan()
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = num_zeros = None
        if self.clip_grad > 0:
            with self._timed("optimizer-clip-main-grad"):
                grad_norm = self.clip_grad_norm(self.clip_grad)
        if self.log_num_zeros_in_grad:
            with self._timed("optimizer-count-zeros"):
                num_zeros = self.count_zeros()
        with self._timed("optimizer-inner-step"):
            self.optimizer.step()
        with self._timed("optimizer-copy-main-to-model-params"):
            self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros

    def _timed(self, name: str):
        return timed(self.timers, name, 1, self.barrier_with_l1_time)


class FP32Optimizer(MegatronOptimizer):
    """fp32 training: the torch optimizer steps the model params themselves.

    Args:
        optimizer: torch optimizer built over the model params.
        **kwargs: see :class:`MegatronOptimizer`.
    """

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the ``.grad`` aliases (the DDP buffer is zeroed by ``zero_grad_buffer``)."""
        for param in self.main_params():
            param.grad = None

    def _copy_model_grads_to_main_grads(self) -> None:
        for param in self.main_params():
            param.grad = model_grad(param)  # an alias of the DDP buffer, no copy

    def reload_model_params(self) -> None:
        """Nothing to do: the model params are the main params."""

    def _copy_main_params_to_model_params(self) -> None:
        # The params were stepped in place. Drop the aliases, so the next backward's
        # AccumulateGrad does not add into the DDP buffer behind the hooks' back.
        self.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's state dict (Megatron's FP32Optimizer layout)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch (or apex FusedAdam, see :func:`adapt_torch_state_dict`) state dict."""
        self.optimizer.load_state_dict(adapt_torch_state_dict(self.optimizer, state_dict))
