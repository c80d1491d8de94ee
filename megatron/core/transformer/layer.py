"""One transformer layer (paper, figure 2): LayerNorm -> self-attention -> bias-dropout-add ->
LayerNorm -> MLP -> bias-dropout-add.

Residual dropout acts on activations replicated over TP ranks, so it draws from the default
generator (identical on all TP ranks); only attention dropout uses the per-rank TP stream.
Legend: s sequence, b batch, h hidden.
"""

from __future__ import annotations

import torch

from megatron.core.fusions.fused_bias_dropout import bias_dropout_add
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.config import AttnMaskType, TransformerConfig
from megatron.core.transformer.layernorm import LayerNorm
from megatron.core.transformer.mlp import MLP


class TransformerLayer(torch.nn.Module):
    """Megatron-LM's ``ParallelTransformerLayer`` (pre-LN by default; the residual can be taken
    after the LayerNorm with ``apply_residual_connection_post_layernorm``, as original BERT).

    Args:
        config: transformer settings.
        layer_number: 1-based global layer index.
        tp_group: the TP process group.
        attn_mask_type: ``causal`` or ``padding``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 tp_group: ProcessGroup | None, attn_mask_type: AttnMaskType = "causal") -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        norm = dict(eps=config.layernorm_epsilon, apply_layernorm_1p=config.apply_layernorm_1p,
                    params_dtype=config.params_dtype)
        self.input_layernorm = LayerNorm(config.hidden_size, **norm)
        self.self_attention = SelfAttention(config, layer_number, tp_group, attn_mask_type)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, **norm)
        self.mlp = MLP(config, tp_group)

    def forward(self, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None,
                inference_params=None) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]`` (``inference_params``: the generation KV cache)."""
        post_ln_residual = self.config.apply_residual_connection_post_layernorm
        p = self.config.hidden_dropout
        ln_out = self.input_layernorm(hidden_states)
        attn_out, attn_bias = self.self_attention(ln_out, attention_mask, inference_params)
        residual = ln_out if post_ln_residual else hidden_states
        fused = self.config.bias_dropout_fusion
        ln_in = bias_dropout_add(attn_out, attn_bias, residual, p, self.training, fused)

        ln_out = self.post_attention_layernorm(ln_in)
        mlp_out, mlp_bias = self.mlp(ln_out)
        residual = ln_out if post_ln_residual else ln_in
        return bias_dropout_add(mlp_out, mlp_bias, residual, p, self.training, fused)
