"""The router's arithmetic as Megatron-Core computes it (``megatron/core/transformer/moe/
moe_utils.py``): scores and top-k selection, the load-balancing and z losses, capacity dropping,
and the autograd hook that adds an auxiliary loss's gradient without touching the main loss.

Pure functions of tensors (no process groups): the caller reduces token counts over its groups
first. Legend: T tokens on this rank, E experts, k top-k.
"""

from __future__ import annotations

import math

import torch

from megatron.core import device


def score_topk(logits: torch.Tensor, topk: int, *, score_function: str = "softmax",
               pre_softmax: bool = False, num_groups: int | None = None,
               group_topk: int | None = None, scaling_factor: float | None = None,
               expert_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``topk_routing_with_score_function``.

    softmax: top-k of the logits then a softmax over the k (``pre_softmax``: softmax over all E
    then top-k). sigmoid / sqrtsoftplus: top-k of the scores (plus ``expert_bias``, which only
    chooses: the gates are the unbiased scores), normalized over the k when k > 1.

    Args:
        logits: ``[T, E]``.
        topk: experts per token.
        score_function: ``softmax``, ``sigmoid`` or ``sqrtsoftplus``.
        pre_softmax: softmax before the top-k (softmax scores only).
        num_groups, group_topk: group-limited routing (:func:`group_limited_topk`).
        scaling_factor: multiplies the gates.
        expert_bias: ``[E]`` selection bias (sigmoid / sqrtsoftplus scores).

    Returns:
        ``(probs [T, E]`` zero outside the chosen experts, in the logits' dtype,
        ``routing_map [T, E]`` bool).
    """
    def choose(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            probs, top = choose(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            chosen, top = choose(logits)
            probs = torch.softmax(chosen, dim=-1, dtype=torch.float32)
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        scores = _bounded_scores(logits, score_function)
        if expert_bias is not None:
            _, top = choose(scores + expert_bias.float())
            scores = torch.gather(scores, 1, top)
        else:
            scores, top = choose(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top, probs)  # [T, E]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return routing_probs, routing_map


def _bounded_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    return torch.nn.functional.softplus(logits.float()).sqrt()


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited top-k: the E experts form ``num_groups`` equal groups, each
    group scored by the sum of its best ``topk // group_topk`` scores; the token picks its
    ``group_topk`` best groups and its top-k experts among them.

    Returns:
        ``(values [T, k], indices [T, k])``.
    """
    t, e = scores.shape
    group_scores = scores.view(t, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]  # [T, g]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)  # [T, G]
    score_mask = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``compute_routing_scores_for_aux_loss``: every expert's score over all E
    (softmax; or the bounded scores normalized to sum 1) and the plain top-k map they give
    (no groups, no bias, no capacity). Returns ``(routing_map [T, E] bool, scores [T, E])``."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = _bounded_scores(logits, score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, k=topk, dim=1)[1]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return routing_map, scores


def switch_load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor,
                               total_num_tokens: int | float, topk: int, coeff: float,
                               num_experts: int | None = None) -> torch.Tensor:
    """Switch Transformer / GShard balancing loss,
    ``coeff * E / (k T^2) * sum_i (sum_x p(x, i)) * tokens_i``: ``probs`` are this rank's
    scores ``[T_local, E]``; ``tokens_per_expert`` ``[E]`` and ``total_num_tokens`` count the
    tokens over the reduction group (T), so the ranks' losses sum to the group's loss.
    ``num_experts`` defaults to the columns of ``probs`` (the sequence-level loss passes E
    with ``b * E`` columns, one block per sequence)."""
    num_experts = probs.shape[-1] if num_experts is None else num_experts
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: ``coeff * mean_x logsumexp(logits(x))^2``."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` ``[T, E]`` (S-BASE): alternately rescale rows
    and columns until the column scales move less than ``tol``."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert takes: ``ceil(num_tokens / E * capacity_factor)`` (``num_tokens``
    counts token-expert pairs, T * k)."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, topk: int,
                       capacity_factor: float, drop_policy: str = "probs",
                       pad_to_capacity: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``apply_router_token_dropping``: each expert keeps its ``capacity`` tokens
    with the highest gate (``probs``) or its routed tokens first (``position``: ties broken
    as ``torch.topk`` breaks them, as in Megatron); with ``pad_to_capacity``
    every expert takes exactly ``capacity`` tokens (the kept ones plus zero-gate fillers).

    Returns:
        ``(probs [T, E], routing_map [T, E])`` after dropping.
    """
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens * topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    elif drop_policy == "probs":
        idx = torch.topk(probs, k=capacity, dim=0, sorted=False)[1]  # [C, E]
        keep = torch.zeros_like(routing_map).scatter(0, idx, True)
    elif drop_policy == "position":
        # Megatron's top-k over the 0/1 map: routed tokens first, and among the tied ones
        # those torch.topk returns, which are not always the earliest (on a CPU it often keeps
        # later ones). The same call keeps the same tokens as Megatron-Core on every device.
        idx = torch.topk(routing_map.int(), k=capacity, dim=0, sorted=False)[1]  # [C, E]
        keep = torch.zeros_like(routing_map).scatter(0, idx, True)
    else:
        raise ValueError(f"unknown token drop policy {drop_policy!r}")
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                        update_rate: float) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3): each expert's selection bias moves by
    ``update_rate`` towards balance, up if it took fewer tokens than the mean, down if more.
    ``tokens_per_expert`` ``[E]`` is already summed over the data-parallel ranks."""
    tokens = tokens_per_expert.float()
    offset = tokens.mean() - tokens
    return expert_bias + torch.sign(offset) * update_rate


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``output`` whose backward also feeds ``scale`` as the gradient of
    ``aux_loss``: the auxiliary loss joins the backward pass with the scale the main loss has
    (the fp16 loss scale over the number of micro-batches), as Megatron's
    ``MoEAuxLossAutoScaler``. The scale is an input (a 0-dim tensor, :func:`aux_loss_scale`)
    rather than a class attribute read in the backward, so that a compiled layer
    (``--compile-layers``) traces the function whole and still uses each step's scale."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss, scale)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_loss, scale = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.dtype), None


_AUX_LOSS_SCALE: torch.Tensor | None = None
"""The current backward scale of the auxiliary losses; None: 1 (no schedule has set it)."""


def set_aux_loss_scale(scale: float | torch.Tensor) -> None:
    """The backward scale of every auxiliary loss (see :class:`AuxLossScaler`); the pipeline
    schedules set it before each step. A float becomes a 0-dim fp32 tensor on the compute
    device (made by a fill, not a host copy); a tensor is kept on its device."""
    global _AUX_LOSS_SCALE
    if isinstance(scale, torch.Tensor):
        _AUX_LOSS_SCALE = scale.detach().reshape(()).float()
    else:
        _AUX_LOSS_SCALE = torch.full((), float(scale), dtype=torch.float32,
                                     device=device.get_device())


def aux_loss_scale(like: torch.Tensor) -> torch.Tensor:
    """The current scale as a 0-dim tensor on ``like``'s device."""
    if _AUX_LOSS_SCALE is None:
        return torch.ones((), dtype=torch.float32, device=like.device)
    return _AUX_LOSS_SCALE.to(like.device)


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged, with ``aux_loss`` joining the backward at the current scale."""
    return AuxLossScaler.apply(output, aux_loss, aux_loss_scale(output))
