"""Megatron optimizers: fp32, fp16/bf16 with fp32 main params, and the distributed optimizer.

Entry point::

    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=3e-4, bf16=True, params_dtype=torch.bfloat16), model_chunks,
        dp_group=parallel_state.get_data_parallel_group(),
        mp_group=parallel_state.get_model_parallel_group())

Which class (as Megatron-LM 23.06 picks):

* ``use_distributed_optimizer`` -> :class:`DistributedOptimizer` (any precision; the grad scaler
  only with fp16),
* ``--fp16`` / ``--bf16`` -> :class:`Float16OptimizerWithFloat16Params` (scaler only with fp16:
  constant with ``--loss-scale``, else dynamic),
* fp32 -> :class:`FP32Optimizer`.

The torch optimizer is ``torch.optim.AdamW`` (``--optimizer adam``; decoupled weight decay like
Megatron's apex FusedAdam, ``fused=True`` where the device supports it, else the foreach loop) or
``torch.optim.SGD`` with ``--sgd-momentum``. Param groups follow Megatron's
``_get_params_for_weight_decay_optimization``: biases and 1-D params (norms) get no weight decay
(``wd_mult`` 0); every group carries ``lr_mult`` 1.0 for the scheduler, which sets
``group['lr'] = lr * lr_mult`` and ``group['weight_decay'] = wd * wd_mult``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron.core import comm, parallel_state
from megatron.core.log import get_logger
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.mixed_precision import Float16OptimizerWithFloat16Params
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
from megatron.core.timers import Timers

__all__ = ["ConstantGradScaler", "DistributedOptimizer", "DynamicGradScaler", "FP32Optimizer",
           "Float16OptimizerWithFloat16Params", "MegatronOptimizer", "OptimizerConfig",
           "get_megatron_optimizer",
           "get_param_groups"]


def get_param_groups(model_chunks: list[torch.nn.Module],
                     weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable params into a weight-decay group and a no-weight-decay group.

    No decay for biases and 1-D params (LayerNorm weights). Empty groups are dropped, as in
    Megatron-LM; the group order is decay first.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if name.endswith(".bias") or param.dim() == 1:
                no_decay.append(param)
            else:
                decay.append(param)
    groups = []
    if decay:
        groups.append({"params": decay, "wd_mult": 1.0, "lr_mult": 1.0,
                       "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0, "weight_decay": 0.0})
    return groups


def _build_torch_optimizer(config: OptimizerConfig,
                           groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    lr = config.lr if config.lr is not None else 0.0  # the LR scheduler sets the real value
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=config.sgd_momentum,
                               weight_decay=config.weight_decay)
    if config.optimizer != "adam":
        raise ValueError(f"--optimizer {config.optimizer!r} is not supported: use adam or sgd")
    kwargs = dict(lr=lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                  weight_decay=config.weight_decay)
    try:
        # torch's default AdamW is a per-tensor Python loop on CPU: ~6x slower than fused.
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError) as err:
        get_logger().debug("fused AdamW unavailable (%s); using the foreach implementation", err)
        return torch.optim.AdamW(groups, **kwargs)


def _build_grad_scaler(config: OptimizerConfig) -> ConstantGradScaler | None:
    if not config.fp16:
        return None  # bf16 has fp32's range: no loss scaling
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(initial_scale=config.initial_loss_scale,
                             min_scale=config.min_loss_scale,
                             growth_interval=int(config.loss_scale_window),
                             hysteresis=config.hysteresis)


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: list[torch.nn.Module], *,
                           dp_group: comm.ProcessGroup, mp_group: comm.ProcessGroup,
                           tensor_model_parallel_rank: int | None = None,
                           timers: Timers | None = None,
                           expert_dp_group: comm.ProcessGroup | None = None,
                           expert_mp_group: comm.ProcessGroup | None = None,
                           expert_tensor_parallel_rank: int = 0) -> MegatronOptimizer:
    """Build the optimizer for ``model_chunks`` (module docstring says which class).

    Args:
        config: optimizer hyper-parameters, precision and loss scaling.
        model_chunks: the DDP-wrapped model chunks of this rank.
        dp_group: the data-parallel group (sharding, and the norm with the distributed
            optimizer).
        mp_group: the model-parallel (TP x PP) group norms and inf flags are reduced over.
        tensor_model_parallel_rank: TP rank for the duplicate filter of the norm; read from
            ``parallel_state`` when None.
        timers: times the parts of each step (Megatron's level-1 optimizer timers).
        expert_dp_group: with expert parallelism, the expert-data-parallel group.
        expert_mp_group: with expert parallelism, the expert model-parallel group (ETP x EP x
            PP); None: no expert parallelism, every parameter counted as a dense one.
        expert_tensor_parallel_rank: with expert parallelism, this rank's expert TP rank (the
            duplicate filter of the expert parameters).

    Raises:
        ValueError: an unknown optimizer.
    """
    if tensor_model_parallel_rank is None:
        tensor_model_parallel_rank = parallel_state.get_tensor_model_parallel_rank()
    groups = get_param_groups(model_chunks, config.weight_decay)
    factory = functools.partial(_build_torch_optimizer, config)
    common = dict(clip_grad=config.clip_grad,
                  log_num_zeros_in_grad=config.log_num_zeros_in_grad,
                  grad_scaler=_build_grad_scaler(config),
                  mp_group=mp_group,
                  tensor_model_parallel_rank=tensor_model_parallel_rank,
                  timers=timers, barrier_with_l1_time=config.barrier_with_L1_time,
                  expert_dp_group=expert_dp_group, expert_mp_group=expert_mp_group,
                  expert_tensor_parallel_rank=expert_tensor_parallel_rank)
    if config.use_distributed_optimizer:
        return DistributedOptimizer(groups, factory, model_chunks, dp_group, **common)
    if config.fp16 or config.bf16:
        return Float16OptimizerWithFloat16Params(groups, factory, **common)
    return FP32Optimizer(factory(groups), **common)
