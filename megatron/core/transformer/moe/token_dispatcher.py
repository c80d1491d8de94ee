"""Moving tokens to their experts and back.

:func:`permute` sorts a rank's tokens by expert (one copy per routed expert, Megatron's
``permute`` with a routing map) and :func:`unpermute` sums each token's gated expert outputs
back into its row. With sequence parallelism the TP ranks route their own ``s/p`` rows and the
experts, split over TP as the dense MLP is, see all ``s`` rows: the dispatcher gathers tokens,
gates and routing map over TP before the experts, and each rank keeps its rows of the combined
output after them (Megatron's allgather dispatcher over the TP group).

Legend: T tokens of this rank, S = T x TP tokens of the TP group, E experts, N routed copies,
h hidden.
"""

from __future__ import annotations

import torch

from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                    scatter_to_sequence_parallel_region)
from megatron.core.tensor_parallel.utils import ProcessGroup


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """``tokens [T, h]`` -> (``[N, h]`` sorted by expert then token, the gates ``[N]``, the
    source row of each copy ``[N]``, the copies per expert ``E`` ints)."""
    num_tokens, num_experts = routing_map.shape
    by_expert = routing_map.t()  # [E, T]
    rows = torch.arange(num_tokens, device=tokens.device).expand(num_experts, -1)
    source = rows.masked_select(by_expert)  # [N]
    gates = probs.t().masked_select(by_expert)  # [N]
    counts = by_expert.sum(dim=1).tolist()
    return tokens.index_select(0, source), gates, source, counts


def unpermute(expert_out: torch.Tensor, gates: torch.Tensor, source: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """``[N, h]`` expert outputs -> ``[T, h]``: each row the gate-weighted sum of its copies."""
    weighted = expert_out * gates.unsqueeze(-1).to(expert_out.dtype)
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=expert_out.dtype,
                      device=expert_out.device)
    return out.index_add(0, source, weighted)


class AllGatherDispatcher:
    """Token movement of an MoE layer whose experts are all on this rank (expert parallelism
    1), split over ``tp_group`` with the sequence split over it too (or a group of one).

    Args:
        tp_group: the TP group (sequence parallelism); None: this rank alone.
    """

    def __init__(self, tp_group: ProcessGroup | None) -> None:
        self.tp_group = tp_group

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], tuple]:
        """``hidden [T, h]``, ``probs`` / ``routing_map [T, E]`` -> (tokens by expert
        ``[N, h]``, copies per expert, the state :meth:`combine` needs)."""
        # The experts' column-parallel fc1 all-reduces its input gradient over TP, and the
        # combine below sees whole (all-reduced) expert outputs: both gradients arrive whole
        # on every rank, so each keeps its own rows.
        hidden = gather_from_sequence_parallel_region(hidden, self.tp_group,
                                                      grad_is_partial=False)  # [S, h]
        probs = gather_from_sequence_parallel_region(probs, self.tp_group, grad_is_partial=False)
        with torch.no_grad():
            routing_map = gather_from_sequence_parallel_region(
                routing_map.to(torch.uint8), self.tp_group).bool()
        tokens, gates, source, counts = permute(hidden, routing_map, probs)
        return tokens, counts, (gates, source, hidden.shape[0])

    def combine(self, expert_out: torch.Tensor, state: tuple) -> torch.Tensor:
        """Expert outputs ``[N, h]`` -> this rank's ``[T, h]``."""
        gates, source, num_tokens = state
        out = unpermute(expert_out, gates, source, num_tokens)  # [S, h]
        return scatter_to_sequence_parallel_region(out, self.tp_group)  # [T, h]
