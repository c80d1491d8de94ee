"""Moving tokens to their experts and back, over Megatron-Core's expert grid ("parallel
folding"): the experts of a layer are spread over the expert-parallel group (EP, each rank
holds E/EP of them) and each expert's weights are split over the expert tensor-parallel group
(ETP; fc1 column-, fc2 row-parallel, with no collective of their own). Every rank of the
ETP x EP group routes tokens of its own (sequence parallelism splits the rows over TP, data
parallelism the batches), so the dispatcher brings each expert the tokens of the whole group
and sums the experts' partial outputs (over ETP) back to each token's rank:

* :class:`AllGatherDispatcher`: gather tokens, gates and routing map over ETP x EP, run the
  tokens routed to this rank's experts, reduce-scatter the gated outputs over ETP x EP.
* :class:`AllToAllDispatcher`: sort this rank's tokens by expert, send each block to the EP
  rank holding that expert (all-to-all over EP), gather the blocks over ETP; back the same way
  (reduce-scatter over ETP, all-to-all over EP), the gates applied at home.

The two give the same outputs and gradients. Without expert parallelism the groups are the
dense TP group (ETP = TP, EP = 1).

:func:`permute` sorts a rank's tokens by expert (one copy per routed expert, Megatron's
``permute`` with a routing map) and :func:`unpermute` sums each token's gated expert outputs
back into its row.

Legend: T tokens of this rank, S tokens of the ETP x EP group, E experts, L = E / EP local
experts, N routed copies, h hidden.
"""

from __future__ import annotations

import torch

from megatron.core.tensor_parallel.mappings import (all_to_all,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from megatron.core.tensor_parallel.utils import ProcessGroup, tp_rank, tp_world_size


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
    """Megatron's allgather dispatcher over the ETP x EP group: every rank gathers the group's
    tokens, gates and routing map, runs the tokens routed to its own experts, and the partial
    outputs (other experts' rows are zero; fc2 sums over ETP are partial) are summed back to
    each token's rank by one reduce-scatter.

    Args:
        tp_ep_group: the expert tensor-and-model-parallel group (ETP x EP, ETP fastest).
        local_offset: global index of this rank's first expert.
        num_local_experts: experts on this rank.
    """

    def __init__(self, tp_ep_group: ProcessGroup | None, local_offset: int,
                 num_local_experts: int) -> None:
        self.tp_ep_group = tp_ep_group
        self.local = slice(local_offset, local_offset + num_local_experts)

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], tuple]:
        """``hidden [T, h]``, ``probs`` / ``routing_map [T, E]`` -> (tokens by local expert
        ``[N, h]``, copies per local expert, the state :meth:`combine` needs)."""
        # Each rank's expert shards see only some of the gathered rows and columns: their
        # gradients are partial sums, reduce-scattered in the backward.
        hidden = gather_from_sequence_parallel_region(hidden, self.tp_ep_group)  # [S, h]
        probs = gather_from_sequence_parallel_region(probs, self.tp_ep_group)  # [S, E]
        with torch.no_grad():
            routing_map = gather_from_sequence_parallel_region(
                routing_map.to(torch.uint8), self.tp_ep_group).bool()
        tokens, gates, source, counts = permute(hidden, routing_map[:, self.local],
                                                probs[:, self.local])
        return tokens, counts, (gates, source, hidden.shape[0])

    def combine(self, expert_out: torch.Tensor, state: tuple) -> torch.Tensor:
        """Partial expert outputs ``[N, h]`` -> this rank's ``[T, h]``."""
        gates, source, num_tokens = state
        out = unpermute(expert_out, gates, source, num_tokens)  # [S, h], partial
        return reduce_scatter_to_sequence_parallel_region(out, self.tp_ep_group)  # [T, h]


class AllToAllDispatcher:
    """Megatron's alltoall dispatcher: each rank sorts its tokens by expert and sends every
    block to the EP rank holding that expert (one all-to-all over the expert-parallel group),
    the ETP ranks of an expert gather each other's blocks (each holds a slice of the expert),
    and the outputs come back the same way, summed over ETP on the way; the gates are applied
    at home.

    Args:
        ep_group: the expert-parallel group.
        etp_group: the expert tensor-parallel group.
        tp_ep_group: ETP x EP (ETP fastest): the token counts are gathered over it.
        num_experts: experts of the layer (all ranks).
        local_offset: global index of this rank's first expert.
        num_local_experts: experts on each rank (``num_experts / EP``).
    """

    def __init__(self, ep_group: ProcessGroup | None, etp_group: ProcessGroup | None,
                 tp_ep_group: ProcessGroup | None, num_experts: int, local_offset: int,
                 num_local_experts: int) -> None:
        self.ep_group, self.etp_group, self.tp_ep_group = ep_group, etp_group, tp_ep_group
        self.num_experts, self.num_local = num_experts, num_local_experts
        self.local = slice(local_offset, local_offset + num_local_experts)

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], tuple]:
        tokens, gates, source, counts = permute(hidden, routing_map, probs)  # by global expert
        ep, etp = tp_world_size(self.ep_group), tp_world_size(self.etp_group)
        with torch.no_grad():
            send = torch.tensor(counts, dtype=torch.long, device=hidden.device)  # [E]
            everyone = gather_from_sequence_parallel_region(send, self.tp_ep_group)
            # [EP, ETP, L]: the copies rank (ep s, etp t) sends to each of this rank's experts
            mine = everyone.view(ep, etp, self.num_experts)[:, :, self.local]
        send_rows = send.view(ep, self.num_local).sum(1).tolist()  # to each EP rank
        recv_rows = mine[:, tp_rank(self.etp_group)].sum(1).tolist()  # from each EP rank
        received = all_to_all(tokens, self.ep_group, recv_rows, send_rows)  # by (s, expert)
        etp_rows = mine.sum(dim=(0, 2)).tolist()  # what each ETP rank received
        received = _gather_rows(received, self.etp_group, etp_rows)  # by (t, s, expert)
        blocks = mine.transpose(0, 1).reshape(etp * ep, self.num_local)  # [(t, s), L]
        order = _block_major_to_expert_major(blocks)
        local_counts = blocks.sum(0).tolist()
        return received.index_select(0, order), local_counts, \
            (gates, source, hidden.shape[0], order, send_rows, recv_rows, etp_rows)

    def combine(self, expert_out: torch.Tensor, state: tuple) -> torch.Tensor:
        gates, source, num_tokens, order, send_rows, recv_rows, etp_rows = state
        back = torch.empty_like(expert_out).index_copy(0, order, expert_out)  # by (t, s, e)
        back = _reduce_scatter_rows(back, self.etp_group, etp_rows)  # by (s, e), summed
        home = all_to_all(back, self.ep_group, send_rows, recv_rows)  # by global expert
        return unpermute(home, gates, source, num_tokens)


def _gather_rows(x: torch.Tensor, etp_group: ProcessGroup | None, rows: list[int]) -> torch.Tensor:
    """All-gather of ``x [rows[me], h]`` with another row count per rank -> ``[sum(rows), h]``
    in rank order; the backward sums every rank's gradient of this rank's rows (a
    reduce-scatter). One all-to-all that sends ``x`` to every rank."""
    if tp_world_size(etp_group) == 1:
        return x
    copies = torch.cat([x] * len(rows))  # [n * rows[me], h]
    return all_to_all(copies, etp_group, rows, [x.shape[0]] * len(rows))


def _reduce_scatter_rows(x: torch.Tensor, etp_group: ProcessGroup | None,
                         rows: list[int]) -> torch.Tensor:
    """The reverse of :func:`_gather_rows`: ``x [sum(rows), h]`` -> this rank's ``rows[me]``
    rows summed over the ranks (the backward gathers)."""
    if tp_world_size(etp_group) == 1:
        return x
    n, mine = len(rows), rows[tp_rank(etp_group)]
    pieces = all_to_all(x, etp_group, [mine] * n, rows)  # [n * mine, h], rank r's piece r-th
    return pieces.view(n, mine, *x.shape[1:]).sum(0)


def _block_major_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Rows received in (block, local expert) order -> the row order (local expert, block) the
    experts need: for ``counts [B, L]`` the index of each row in the received buffer."""
    flat = counts.flatten().tolist()
    starts = [0]
    for c in flat[:-1]:
        starts.append(starts[-1] + c)
    blocks, num_local = counts.shape
    pieces = [torch.arange(starts[b * num_local + e], starts[b * num_local + e] +
                           flat[b * num_local + e], device=counts.device)
              for e in range(num_local) for b in range(blocks)]
    return torch.cat(pieces) if pieces else counts.new_zeros(0)
