"""The MoE layer that replaces a transformer layer's MLP (Megatron-Core's ``MoELayer``): the
router picks experts per token, the dispatcher moves the tokens to them and back, and the
shared experts (if any) run on every token beside them.

State-dict names (Megatron-LM's legacy ``SwitchMLP`` layout): ``router.weight`` ``[E, h]``
(``router.expert_bias`` with aux-loss-free balancing), ``local_experts.<i>.dense_h_to_4h`` /
``dense_4h_to_h`` (i local to the rank), ``shared_experts.dense_h_to_4h`` / ``dense_4h_to_h``
and ``shared_experts.gate_weight``.
Legend: s sequence, b batch, h hidden, p TP size, T = s*b tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core.eager_regions import eager_region
from megatron.core.tensor_parallel.utils import ProcessGroup, tp_rank, tp_world_size
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import Experts, expert_config
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import (AllGatherDispatcher,
                                                           AllToAllDispatcher)


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """The MoE layers' process groups beyond TP and CP: the routed experts' (Megatron-Core's
    expert grid, "parallel folding") and the router's global statistics' (None: this rank
    alone).

    Attributes:
        ep: the expert-parallel group: this rank holds experts ``ep_rank * E/EP ...
            (ep_rank + 1) * E/EP - 1``.
        etp: the expert tensor-parallel group each expert's weights are split over.
        tp_ep: ETP x EP (ETP fastest): the ranks whose tokens the dispatcher exchanges.
        dp_cp: DP x CP of the dense grid: with TP, the group ``global_aux_loss`` sums its
            token counts over (Megatron's ``tp_dp_cp`` group, reduced as TP then DP x CP).
    """

    ep: ProcessGroup | None
    etp: ProcessGroup | None
    tp_ep: ProcessGroup | None
    dp_cp: ProcessGroup | None = None


class SharedExpertMLP(MLP):
    """The shared experts as one dense MLP of ``moe_shared_expert_intermediate_size``, split
    over TP (and the sequence) as the dense MLP; with ``moe_shared_expert_gate`` its output is
    scaled per token by ``sigmoid(x . gate_weight)`` (``gate_weight [1, h]``, whole on every
    rank)."""

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None) -> None:
        cfg = expert_config(config, config.moe_shared_expert_intermediate_size,
                            config.sequence_parallel)
        super().__init__(cfg, tp_group)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(
                1, config.hidden_size, dtype=config.params_dtype, device="cpu"))
            with torch.no_grad():
                self.gate_weight.normal_(0.0, config.init_method_std)
            self.gate_weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[s, b, h]`` -> (``[s, b, h]`` bias included, None); ``[s/p, b, h]`` with SP."""
        out, bias = super().forward(hidden_states)
        if bias is not None:
            out = out + bias
        if self.gate_weight is not None:
            out = out * torch.sigmoid(torch.nn.functional.linear(hidden_states,
                                                                 self.gate_weight))
        return out, None


class MoELayer(torch.nn.Module):
    """Router, routed experts and shared experts of one layer.

    Args:
        config: transformer settings (``num_moe_experts`` and the ``moe_*`` fields).
        layer_number: 1-based global layer index.
        tp_group: the TP group (the router's counts; the shared experts are split over it).
        expert_groups: the routed experts' groups and the router's DP x CP group; None: those
            of expert parallelism 1, the experts split over ``tp_group`` (ETP = TP), and one
            data-parallel rank.
        cp_group: the context-parallel group (the router's balancing-loss counts span TP x
            CP); the tokens themselves need nothing of it (each is routed on its own).
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 tp_group: ProcessGroup | None, expert_groups: ExpertGroups | None = None,
                 cp_group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        groups = expert_groups or ExpertGroups(ep=None, etp=tp_group, tp_ep=tp_group)
        self.router = TopKRouter(config, layer_number, tp_group, groups.dp_cp, cp_group)
        num_local = config.num_moe_experts // tp_world_size(groups.ep)
        self.local_expert_offset = tp_rank(groups.ep) * num_local
        experts = Experts(config, num_local, groups.etp)
        # Registered flat, as Megatron-LM's SwitchMLP: the checkpoint keys have no 'experts.'.
        self.local_experts = experts.local_experts
        self._experts = [experts]  # outside the module tree: its parameters are local_experts'
        for param in self.local_experts.parameters():
            # Megatron's mark: not reduced over the dense data-parallel group but over the
            # expert-data-parallel one (each EP rank holds other experts).
            param.allreduce = False
        if config.moe_token_dispatcher_type == "alltoall":
            self.dispatcher = AllToAllDispatcher(groups.ep, groups.etp, groups.tp_ep,
                                                 config.num_moe_experts,
                                                 self.local_expert_offset, num_local)
        else:
            self.dispatcher = AllGatherDispatcher(groups.tp_ep, self.local_expert_offset,
                                                  num_local)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, tp_group)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[s, b, h]`` -> (``[s, b, h]``, None): every bias is already added."""
        shape = hidden_states.shape
        probs, routing_map = self.router(hidden_states)  # [T, E] each
        tokens = hidden_states.reshape(-1, shape[-1])  # [T, h]
        out = self._routed_experts(tokens, probs, routing_map).view(shape)  # [s, b, h]
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)[0]
        return out, None

    @eager_region
    def _routed_experts(self, tokens: torch.Tensor, probs: torch.Tensor,
                        routing_map: torch.Tensor) -> torch.Tensor:
        """Dispatch, experts, combine: ``[T, h]`` -> ``[T, h]``. Eager even in a compiled layer
        (``--compile-layers``): the tokens per expert are data-dependent sizes (the split
        sizes of the collectives and of the expert GEMMs), which a graph would have to
        recompile or break on every step; the router before and the shared experts after stay
        in the layer's graph (Megatron's MoE CUDA-graph scopes likewise end at the router)."""
        routed, counts, state = self.dispatcher.dispatch(tokens, probs, routing_map)
        expert_out = self._experts[0](routed, counts)  # [N, h]
        return self.dispatcher.combine(expert_out, state)

