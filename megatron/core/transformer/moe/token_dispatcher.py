"""Moving tokens to their experts and back.

:func:`permute` sorts a rank's tokens by expert (one copy per routed expert, Megatron's
``permute`` with a routing map) and :func:`unpermute` sums each token's gated expert outputs
back into its row. With sequence parallelism the TP ranks route their own ``s/p`` rows and the
experts, split over TP as the dense MLP is, see all ``s`` rows: the dispatcher gathers tokens,
gates and routing map over TP before the experts, and each rank keeps its rows of the combined
output after them (Megatron's allgather dispatcher over the TP group). With expert parallelism
each rank holds E/EP experts and the tokens travel over the expert-parallel group
(:class:`ExpertParallelAllGatherDispatcher`, :class:`AllToAllDispatcher`): the two give the
same outputs and gradients.

Legend: T tokens of this rank, S = T x TP tokens of the TP group, E experts, N routed copies,
h hidden.
"""

from __future__ import annotations

import torch

from megatron.core import comm
from megatron.core.tensor_parallel.mappings import (all_to_all,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region,
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


class ExpertParallelAllGatherDispatcher:
    """Megatron's allgather dispatcher over the expert-parallel group: every rank gathers the
    group's tokens, gates and routing map, runs the tokens routed to its own experts, and the
    partial outputs are summed back to each token's rank (a reduce-scatter).

    Args:
        ep_group: the expert-parallel group.
        local_offset: global index of this rank's first expert.
        num_local_experts: experts on this rank.
    """

    def __init__(self, ep_group: ProcessGroup | None, local_offset: int,
                 num_local_experts: int) -> None:
        self.ep_group = ep_group
        self.local = slice(local_offset, local_offset + num_local_experts)

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], tuple]:
        # Each rank's experts use only some of the gathered rows: partial gradients.
        hidden = gather_from_sequence_parallel_region(hidden, self.ep_group)  # [S, h]
        probs = gather_from_sequence_parallel_region(probs, self.ep_group)  # [S, E]
        with torch.no_grad():
            routing_map = gather_from_sequence_parallel_region(
                routing_map.to(torch.uint8), self.ep_group).bool()
        tokens, gates, source, counts = permute(hidden, routing_map[:, self.local],
                                                probs[:, self.local])
        return tokens, counts, (gates, source, hidden.shape[0])

    def combine(self, expert_out: torch.Tensor, state: tuple) -> torch.Tensor:
        gates, source, num_tokens = state
        out = unpermute(expert_out, gates, source, num_tokens)  # [S, h], this rank's experts
        return reduce_scatter_to_sequence_parallel_region(out, self.ep_group)  # [T, h]


class AllToAllDispatcher:
    """Megatron's alltoall dispatcher: each rank sorts its tokens by expert and sends every
    block to the rank holding that expert (one all-to-all over the expert-parallel group), and
    the outputs come back the same way; the gates are applied at home.

    Args:
        ep_group: the expert-parallel group.
        num_experts: experts of the layer (all ranks).
        num_local_experts: experts on each rank (``num_experts / EP``).
    """

    def __init__(self, ep_group: ProcessGroup | None, num_experts: int,
                 num_local_experts: int) -> None:
        self.ep_group = ep_group
        self.num_experts, self.num_local = num_experts, num_local_experts

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], tuple]:
        tokens, gates, source, counts = permute(hidden, routing_map, probs)  # by global expert
        ep = self.num_experts // self.num_local
        send = torch.tensor(counts, dtype=torch.long, device=hidden.device)  # [E]
        recv = torch.empty_like(send)  # [EP * L]: from each source rank, per local expert
        comm.all_to_all_single(recv, send, self.ep_group)  # num_local counts to each rank
        send_rows = send.view(ep, self.num_local).sum(1).tolist()
        recv_by_src = recv.view(ep, self.num_local)  # [EP, L]
        recv_rows = recv_by_src.sum(1).tolist()
        received = all_to_all(tokens, self.ep_group, recv_rows, send_rows)  # by (src, expert)
        order = _source_major_to_expert_major(recv_by_src)
        local_counts = recv_by_src.sum(0).tolist()
        return received.index_select(0, order), local_counts, \
            (gates, source, hidden.shape[0], order, send_rows, recv_rows)

    def combine(self, expert_out: torch.Tensor, state: tuple) -> torch.Tensor:
        gates, source, num_tokens, order, send_rows, recv_rows = state
        back = torch.empty_like(expert_out).index_copy(0, order, expert_out)  # by (src, expert)
        home = all_to_all(back, self.ep_group, send_rows, recv_rows)  # by global expert
        return unpermute(home, gates, source, num_tokens)


def _source_major_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Rows received in (source rank, local expert) blocks -> the row order (local expert,
    source rank) the experts need: for ``counts [EP, L]`` the index of each row in the
    received buffer."""
    flat = counts.flatten().tolist()
    starts = [0]
    for c in flat[:-1]:
        starts.append(starts[-1] + c)
    ep, num_local = counts.shape
    pieces = [torch.arange(starts[s * num_local + e], starts[s * num_local + e] +
                           flat[s * num_local + e], device=counts.device)
              for e in range(num_local) for s in range(ep)]
    return torch.cat(pieces) if pieces else counts.new_zeros(0)
