"""One transformer layer (paper, figure 2): LayerNorm -> self-attention -> bias-dropout-add ->
LayerNorm -> MLP (or mixture of experts) -> bias-dropout-add.

Residual dropout acts on activations replicated over TP ranks, so it draws from the default
generator (identical on all TP ranks); only attention dropout uses the per-rank TP stream. With
sequence parallelism the residual stream is split along the sequence (``[s/p, b, h]``, every
rank different rows), so its dropout draws from the per-rank TP stream too, as Megatron's.
Legend: s sequence, b batch, h hidden, p TP size.
"""

from __future__ import annotations

import torch

from megatron.core import eager_regions
from megatron.core.fusions.fused_bias_dropout import bias_dropout_add
from megatron.core.tensor_parallel.random import run_in_tp_stream
from megatron.core.tensor_parallel.utils import ProcessGroup, tp_world_size
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.config import AttnMaskType, TransformerConfig
from megatron.core.transformer.layernorm import build_norm
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import ExpertGroups, MoELayer


class TransformerLayer(torch.nn.Module):
    """Megatron-LM's ``ParallelTransformerLayer`` (pre-LN by default; the residual can be taken
    after the LayerNorm with ``apply_residual_connection_post_layernorm``, as original BERT).

    Args:
        config: transformer settings.
        layer_number: 1-based global layer index.
        tp_group: the TP process group.
        attn_mask_type: ``causal`` or ``padding``.
        cp_group: the context-parallel group.
        expert_groups: an MoE layer's expert groups (None: expert parallelism 1).
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 tp_group: ProcessGroup | None, attn_mask_type: AttnMaskType = "causal",
                 cp_group: ProcessGroup | None = None,
                 expert_groups: ExpertGroups | None = None) -> None:
        super().__init__()
        if config.compile_layers:
            eager_regions.mark_all()  # before anything traces this layer
        self.config = config
        self.layer_number = layer_number
        self.tp_size = tp_world_size(tp_group)
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, layer_number, tp_group, attn_mask_type,
                                            cp_group=cp_group)
        self.post_attention_layernorm = build_norm(config)
        self.mlp = (MoELayer(config, layer_number, tp_group, expert_groups=expert_groups,
                             cp_group=cp_group) if config.is_moe_layer(layer_number)
                    else MLP(config, tp_group))

    def forward(self, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None,
                inference_params=None, rotary_pos_emb: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]`` (``[s/p, b, h]`` both with sequence parallelism;
        ``inference_params``: the generation KV cache; ``rotary_pos_emb``: RoPE
        ``(cos, sin)`` ``[s, 1, 1, rot]`` of this forward's positions, or their angles)."""
        post_ln_residual = self.config.apply_residual_connection_post_layernorm
        ln_out = self.input_layernorm(hidden_states)
        attn_out, attn_bias = self.self_attention(ln_out, attention_mask, inference_params,
                                                  rotary_pos_emb)
        residual = ln_out if post_ln_residual else hidden_states
        ln_in = self._bias_dropout_add(attn_out, attn_bias, residual)

        ln_out = self.post_attention_layernorm(ln_in)
        mlp_out, mlp_bias = self.mlp(ln_out)
        residual = ln_out if post_ln_residual else ln_in
        return self._bias_dropout_add(mlp_out, mlp_bias, residual)

    def _bias_dropout_add(self, x: torch.Tensor, bias: torch.Tensor | None,
                          residual: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout
        args = (x, bias, residual, p, self.training, self.config.bias_dropout_fusion)
        if self.config.sequence_parallel and self.training and p > 0:
            # Sequence-split rows differ per rank: their masks must too (the TP stream).
            return run_in_tp_stream(bias_dropout_add, *args, tp_size=self.tp_size)
        return bias_dropout_add(*args)
