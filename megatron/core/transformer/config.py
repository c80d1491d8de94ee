"""The transformer and language-model settings the model code needs, built from the CLI config.

Model code receives a :class:`TransformerConfig` (never the whole ``MegatronConfig``) plus its
process groups; :func:`transformer_config_from` is the one translation from flags.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

AttnMaskType = Literal["causal", "padding"]


@dataclasses.dataclass(kw_only=True)
class TransformerConfig:
    """Shape, numerics, dropout, init and recompute settings of a Megatron transformer."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    """Defaults to 4 x hidden_size."""
    kv_channels: int | None = None
    """Per-head size; defaults to hidden_size / num_attention_heads."""

    # Language-model pieces (embedding and output layer).
    padded_vocab_size: int | None = None
    max_position_embeddings: int | None = None
    add_position_embedding: bool = True
    num_tokentypes: int = 0
    untie_embeddings_and_output_weights: bool = False
    fp16_lm_cross_entropy: bool = False

    # Numerics.
    params_dtype: torch.dtype = torch.float32
    layernorm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    apply_residual_connection_post_layernorm: bool = False
    add_bias_linear: bool = True
    openai_gelu: bool = False
    onnx_safe: bool = False
    bias_gelu_fusion: bool = True
    """Megatron's fused bias+GeLU uses the tanh approximation; with it off, exact erf GeLU."""
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = False
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"

    # Regularization and init.
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02

    # Activation recomputation.
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int = 1
    distribute_saved_activations: bool = False

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by "
                                 f"num_attention_heads ({self.num_attention_heads}); set "
                                 "kv_channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads

    @property
    def use_sdpa(self) -> bool:
        """True for torch's scaled_dot_product_attention, False for the unfused reference."""
        return self.attention_backend not in ("unfused", "local")

    @property
    def gelu_tanh_approximation(self) -> bool:
        """Megatron-LM's GeLU: tanh form with --openai-gelu or the (default) bias-gelu fusion.

        23.06 ``ParallelMLP``: openai_gelu -> tanh formula; onnx_safe -> erf formula; otherwise
        ``F.gelu`` (erf) -- but with ``bias_gelu_fusion`` (default on, needs biases) the fused
        ``bias_gelu`` kernel computes the tanh approximation instead.
        """
        if self.openai_gelu:
            return True
        if self.onnx_safe:
            return False
        return self.bias_gelu_fusion and self.add_bias_linear


def transformer_config_from(cfg) -> TransformerConfig:
    """Translate a validated :class:`~megatron.config.MegatronConfig` into a TransformerConfig.

    Raises:
        ValueError: a flag this model does not implement (named, with the fix).
    """
    m, p, t = cfg.model, cfg.precision, cfg.training
    if p.fp32_residual_connection:
        raise ValueError("--fp32-residual-connection is not implemented by this model yet; "
                         "drop the flag")
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels, padded_vocab_size=cfg.padded_vocab_size,
        max_position_embeddings=m.max_position_embeddings,
        add_position_embedding=m.add_position_embedding,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        fp16_lm_cross_entropy=p.fp16_lm_cross_entropy, params_dtype=cfg.params_dtype,
        layernorm_epsilon=m.layernorm_epsilon, apply_layernorm_1p=m.apply_layernorm_1p,
        apply_residual_connection_post_layernorm=m.apply_residual_connection_post_layernorm,
        add_bias_linear=m.add_bias_linear, openai_gelu=m.openai_gelu,
        onnx_safe=bool(m.onnx_safe), bias_gelu_fusion=m.bias_gelu_fusion,
        apply_query_key_layer_scaling=m.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=p.attention_softmax_in_fp32,
        attention_backend=m.attention_backend, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, init_method_std=m.init_method_std,
        recompute_granularity=t.recompute_granularity, recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        distribute_saved_activations=t.distribute_saved_activations)
