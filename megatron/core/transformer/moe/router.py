"""Megatron-Core's ``TopKRouter``: a gate GEMM, top-k selection with the configured score
function, optional capacity dropping, and the load-balancing and z losses attached to the
autograd graph (:class:`~megatron.core.transformer.moe.moe_utils.AuxLossScaler`).

Token counts for the balancing losses are summed over the groups Megatron sums them over:
TP x CP for ``aux_loss`` / ``seq_aux_loss`` (with sequence parallelism each TP rank routes its
``s/p`` rows, with context parallelism each CP rank its two chunks of every sequence), TP x DP
x CP for ``global_aux_loss`` and the expert-bias counts (those in ``finalize_model_grads``).
A product group is reduced as its factors in turn (TP then CP, TP then DP x CP: a sum over the
product is the sum over each in turn), so no TP x CP or TP x DP x CP group is needed.
Legend: s sequence, b batch, h hidden, T = s*b tokens of this rank, E experts.
"""

from __future__ import annotations

import torch

from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import ProcessGroup, tp_world_size
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe import metrics
from megatron.core.transformer.moe import moe_utils as mu

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class TopKRouter(torch.nn.Module):
    """Routes each token to ``moe_router_topk`` experts.

    Args:
        config: transformer settings (the ``moe_router_*`` fields).
        layer_number: 1-based global layer index (per-layer loss logging).
        tp_group: the TP group (the balancing loss's token counts, the z-loss average).
        dp_cp_group: DP x CP (None: one rank): with ``tp_group``, the global balancing loss's
            token counts (Megatron's ``tp_dp_cp`` group).
        cp_group: the context-parallel group (None: CP 1): the balancing loss's token counts
            and the z-loss average span TP x CP.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 tp_group: ProcessGroup | None, dp_cp_group: ProcessGroup | None = None,
                 cp_group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.tp_group, self.cp_group, self.dp_cp_group = tp_group, cp_group, dp_cp_group
        e, h = config.num_moe_experts, config.hidden_size
        # Initialized on the CPU as every layer's weights (the model moves to the device after).
        self.weight = torch.nn.Parameter(torch.empty(e, h, dtype=torch.float32, device="cpu"))
        self.bias = torch.nn.Parameter(torch.empty(e, dtype=torch.float32, device="cpu")) \
            if config.add_bias_linear else None
        with torch.no_grad():
            self.weight.normal_(0.0, config.init_method_std)
            if self.bias is not None:
                self.bias.normal_(0.0, config.init_method_std)
        for p in (self.weight, self.bias):
            if p is not None:
                p.data = p.data.to(config.params_dtype)
                # Each TP rank routes its own s/p rows: the gradients are partial sums.
                p.sequence_parallel = config.sequence_parallel
        bias_on = config.moe_router_enable_expert_bias
        global_on = config.moe_router_load_balancing_type == "global_aux_loss"

        def counts(on: bool, shape: tuple[int, ...]) -> torch.Tensor | None:
            return torch.zeros(shape, device="cpu") if on else None  # moved with the model

        self.register_buffer("expert_bias", counts(bias_on, (e,)))
        self.register_buffer("local_tokens_per_expert", counts(bias_on, (e,)), persistent=False)
        self.register_buffer("global_tokens_per_expert", counts(global_on, (e,)),
                             persistent=False)
        self.register_buffer("ga_steps", counts(global_on, ()), persistent=False)
        # The logged losses' row: a tensor, so that a compiled layer does not specialize on it.
        self.register_buffer("layer_index", torch.tensor([layer_number - 1], device="cpu"),
                             persistent=False)

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> logits ``[s, b, E]`` in ``moe_router_dtype`` (else the input's)."""
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, x.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[s, b, h]`` -> (``probs [T, E]``, ``routing_map [T, E]`` bool), tokens s-major."""
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.float()  # kept fp32 under fp16 wrappers
        x = self._jitter(x)
        logits = self.gating(x)  # [s, b, E]
        seq, batch = logits.shape[:2]
        logits = logits.reshape(-1, self.config.num_moe_experts)  # [T, E]
        training = self.training and torch.is_grad_enabled()
        if training:
            logits = self._apply_z_loss(logits)
        probs, routing_map = self._select(logits)
        cfg = self.config
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = mu.drop_over_capacity(
                probs, routing_map, cfg.moe_router_topk, cfg.moe_expert_capacity_factor,
                cfg.moe_token_drop_policy, cfg.moe_pad_expert_input_to_capacity)
        if training and cfg.moe_aux_loss_coeff > 0 and \
                cfg.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss",
                                                       "global_aux_loss"):
            probs = self._apply_aux_loss(probs, logits, seq, batch)
        if training and self.local_tokens_per_expert is not None:
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _jitter(self, x: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's multiplicative input noise, uniform in [1 - eps, 1 + eps]
        (training forwards only)."""
        eps = self.config.moe_input_jitter_eps
        if eps is None or not self.training:
            return x
        noise = torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        return x * noise

    def _select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        if cfg.moe_router_load_balancing_type == "sinkhorn":
            return self._sinkhorn(logits)
        return mu.score_topk(
            logits, cfg.moe_router_topk, score_function=cfg.moe_router_score_function,
            pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk,
            scaling_factor=cfg.moe_router_topk_scaling_factor, expert_bias=self.expert_bias)

    def _sinkhorn(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """S-BASE routing: in training the experts are chosen on the Sinkhorn-balanced scores;
        the gates are the plain softmax (sigmoid for top-1) scores of the chosen experts."""
        k = self.config.moe_router_topk
        gates = torch.sigmoid(logits) if k == 1 else \
            torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        with torch.no_grad():
            chooser = mu.sinkhorn(logits.float()) if self.training else gates
            top = torch.topk(chooser, k=k, dim=1)[1]
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        return gates * routing_map, routing_map

    def _apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if coeff is None:
            return logits
        # Each TP x CP rank's share of the average over the TP x CP group's tokens.
        coeff = coeff / (tp_world_size(self.tp_group) * tp_world_size(self.cp_group))
        loss = mu.z_loss(logits, coeff)
        metrics.record("z_loss", loss / coeff, self.layer_index, self.config.num_layers)
        return mu.attach_aux_loss(logits, loss)

    def _apply_aux_loss(self, probs: torch.Tensor, logits: torch.Tensor, seq: int,
                        batch: int) -> torch.Tensor:
        cfg = self.config
        kind, coeff, k = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, \
            cfg.moe_router_topk
        aux_map, scores = mu.scores_for_aux_loss(logits, k, cfg.moe_router_score_function)
        if kind == "seq_aux_loss":
            # One sequence per column block: [s, b*E] sums to each sequence's own loss.
            scores, aux_map = scores.reshape(seq, -1), aux_map.reshape(seq, -1)
            counts, total = self._counts(aux_map, self.tp_group, self.cp_group)
            loss = mu.switch_load_balancing_loss(scores, counts, total, k, coeff,
                                                 cfg.num_moe_experts) / batch
            name = "seq_load_balancing_loss"
        elif kind == "global_aux_loss":
            # Each rank's share of the loss over the TP x DP x CP group's tokens.
            counts, total = self._counts(aux_map, self.tp_group, self.dp_cp_group)
            self.global_tokens_per_expert += counts
            self.ga_steps += 1
            loss = mu.switch_load_balancing_loss(
                scores, self.global_tokens_per_expert / self.ga_steps, total, k, coeff)
            name = "global_load_balancing_loss"
        else:
            counts, total = self._counts(aux_map, self.tp_group, self.cp_group)
            loss = mu.switch_load_balancing_loss(scores, counts, total, k, coeff)
            name = "load_balancing_loss"
        metrics.record(name, loss / coeff, self.layer_index, cfg.num_layers)
        return mu.attach_aux_loss(probs, loss)

    @staticmethod
    def _counts(routing_map: torch.Tensor, *count_groups: ProcessGroup | None
                ) -> tuple[torch.Tensor, int]:
        """Tokens per column of ``routing_map`` summed over each of ``count_groups`` in turn
        (together their product group), and the groups' token count (this rank's rows times
        the group sizes)."""
        counts = routing_map.sum(dim=0).float()
        total = routing_map.shape[0]
        for group in count_groups:
            counts = reduce_from_tensor_model_parallel_region(counts, group)
            total *= tp_world_size(group)
        return counts, total

    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """One aux-loss-free balancing step from the step's token counts (summed over TP x
        DP x CP); the local counts start again from zero."""
        self.expert_bias.copy_(mu.updated_expert_bias(
            tokens_per_expert, self.expert_bias, self.config.moe_router_bias_update_rate))
        self.local_tokens_per_expert.zero_()

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new global batch for ``global_aux_loss``."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()
