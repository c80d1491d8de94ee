"""Global gradient norm, clipping and zero counting over a model split across ranks.

Every rank passes only the gradients it should count: a TP-duplicated parameter
(``tensor_model_parallel`` False, e.g. a LayerNorm weight) only on TP rank 0, and a ``shared``
duplicate (the last stage's copy of a tied embedding) nowhere; the partial sums are then
all-reduced over ``groups`` (the model-parallel group, plus the DP group when grads are sharded by
the distributed optimizer).
"""

from __future__ import annotations

import math

import torch

from megatron.core import comm, device


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for a parameter marked ``shared`` (counted on another rank or module)."""
    return not getattr(param, "shared", False)


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for TP-split parameters, and for replicated ones only on TP rank 0."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def get_grad_norm_fp32(grads: list[torch.Tensor], groups: list[comm.ProcessGroup | None],
                       norm_type: float = 2.0) -> float:
    """The norm of all ranks' ``grads`` together.

    Args:
        grads: this rank's gradients to count (already filtered for duplicates).
        groups: groups to reduce the partial norm over, in order.
        norm_type: 2 (or any p), or ``inf``.

    Returns:
        The global norm as a Python float.
    """
    return get_grad_norm_fp32_parts([(grads, groups)], norm_type)


def get_grad_norm_fp32_parts(parts: list[tuple[list[torch.Tensor],
                                               list[comm.ProcessGroup | None]]],
                             norm_type: float = 2.0) -> float:
    """The norm of several sets of gradients, each counted over its own groups (dense
    parameters over TP x PP, expert parameters over ETP x EP x PP), combined as one norm."""
    infinity = norm_type == math.inf
    combined = torch.zeros(1, dtype=torch.float32, device=device.get_device())
    for grads, groups in parts:
        total = torch.zeros(1, dtype=torch.float32, device=device.get_device())
        if grads:
            norms = torch.stack(torch._foreach_norm(
                [g.float() if g.dtype != torch.float32 else g for g in grads], norm_type))
            total += norms.max() if infinity else norms.pow(norm_type).sum()
        for group in groups:
            comm.all_reduce(total, group, "max" if infinity else "sum")
        combined = torch.maximum(combined, total) if infinity else combined + total
    return float(combined.item()) if infinity else float(combined.item() ** (1.0 / norm_type))


def clip_grads_by_total_norm(grads: list[torch.Tensor], max_norm: float,
                             total_norm: float) -> None:
    """Scale ``grads`` in place so that their global norm is at most ``max_norm``."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(grads: list[torch.Tensor], groups: list[comm.ProcessGroup | None]) -> int:
    """Number of zero gradient elements over all ranks (``--log-num-zeros-in-grad``)."""
    total = torch.zeros(1, dtype=torch.float64, device=device.get_device())
    for grad in grads:
        total += grad.numel() - torch.count_nonzero(grad)  # no .item(): one sync, at the end
    for group in groups:
        comm.all_reduce(total, group, "sum")
    return int(total.item())
