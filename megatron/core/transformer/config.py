"""The transformer and language-model settings the model code needs.

Model code receives a :class:`TransformerConfig` (never the CLI's ``MegatronConfig``) plus its
process groups. The CLI layer fills it by copying same-named flags
(``megatron.config.core_configs.transformer_config``), so the library never reads the CLI config.
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
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); None: one per attention head (plain MHA)."""

    # Language-model pieces (embedding and output layer).
    padded_vocab_size: int | None = None
    max_position_embeddings: int | None = None
    add_position_embedding: bool = True
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    """The learned table is built only for ``learned_absolute`` (and ``add_position_embedding``);
    ``rope`` rotates queries and keys in every attention layer instead."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates (the first ones)."""
    rotary_base: int = 10000
    rotary_interleaved: bool = False
    """Rotate adjacent pairs (x0, x1), (x2, x3)... instead of the two halves of the rotary dims."""
    num_tokentypes: int = 0
    untie_embeddings_and_output_weights: bool = False
    fp16_lm_cross_entropy: bool = False

    # Numerics.
    params_dtype: torch.dtype = torch.float32
    layernorm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Every norm of the transformer (both of each layer and the final one)."""
    apply_residual_connection_post_layernorm: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    """A bias on the QKV projection even with ``add_bias_linear`` off (Qwen2)."""
    qk_layernorm: bool = False
    """A ``normalization`` norm over ``kv_channels`` applied to every query and key head after
    the QKV projection and before RoPE (Megatron core's ``q_layernorm`` / ``k_layernorm``)."""
    qk_layernorm_full_projection: bool = False
    """With ``qk_layernorm``: the q norm spans all query heads (``np * kv_channels``) and the k
    norm all key groups (``G * kv_channels``), OLMoE's and OLMo-2's form (TP=1)."""
    swiglu: bool = False
    """Gated MLP: fc1 is 2 x ffn_hidden_size wide, silu(gate) * up (Megatron's ``glu``)."""
    squared_relu: bool = False
    """MLP activation relu(x)^2 instead of GeLU."""
    openai_gelu: bool = False
    onnx_safe: bool = False
    bias_gelu_fusion: bool = True
    """Megatron's fused bias+GeLU uses the tanh approximation; with it off, exact erf GeLU."""
    bias_swiglu_fusion: bool = True
    """With ``swiglu``: the fused (bias +) SwiGLU, which keeps only fc1's output for the
    backward (``megatron.core.fusions.fused_bias_swiglu``; same values)."""
    masked_softmax_fusion: bool = True
    """The unfused attention path's scale-mask-softmax runs the fused kernel
    (``megatron.core.fusions.fused_softmax``) where one is built for the device and dtype."""
    bias_dropout_fusion: bool = True
    """Bias + dropout + residual add through TorchScript (same values as the eager ops)."""
    gradient_accumulation_fusion: bool = True
    """Linear layers accumulate their weight gradient straight into ``weight.main_grad`` (the
    data-parallel buffer) instead of producing ``weight.grad`` that is then added to it."""
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = False
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"

    compile_layers: bool = False
    """``torch.compile`` each layer of a :class:`TransformerBlock` (its forward without a KV
    cache: training and evaluation). Inside the compiled region the fused-kernel extension, the
    TorchScript fusions and the gradient-accumulation fusion give way to plain PyTorch ops that
    inductor fuses; see ``megatron/core/transformer/block.py`` for what stays a graph break."""

    # Regularization and init.
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    use_cpu_initialization: bool = True
    """Draw every TP-split weight whole on the CPU from the default generator and keep this
    rank's slice (Megatron's ``--use-cpu-initialization``): every TP size starts from the same
    weights. False (Megatron's default on a GPU): each rank draws only its own shard on the
    device, from the model-parallel RNG stream (1/TP of the work; TP sizes then start from
    different weights)."""
    perform_initialization: bool = True
    """Draw the TP-split weights at all (Megatron-Core's option): False leaves them
    uninitialized, for a model whose every weight a checkpoint load overwrites next."""

    # Activation recomputation.
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int = 1
    distribute_saved_activations: bool = False
    """Keep a 1/TP slice of each full-recompute checkpoint's input; ignored with
    ``sequence_parallel``, whose checkpoint inputs are already split (as Megatron)."""

    # Mixture of experts (Megatron-Core's names; ``megatron/core/transformer/moe``).
    num_moe_experts: int | None = None
    """Experts of each MoE layer; None: dense MLPs only."""
    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE: an int N (every N-th layer, from the first) or a 0/1 per layer."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's hidden size (defaults to ffn_hidden_size)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Hidden size of the shared experts (all of them as one MLP); None: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x . gate_weight) (Qwen2-MoE)."""
    moe_router_topk: int = 2
    moe_router_score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """The router's GEMM, scores and losses in this dtype (None: the activations' dtype)."""
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss",
                                            "sinkhorn", "none"] = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_input_jitter_eps: float | None = None
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "allgather"
    moe_grouped_gemm: bool = False
    """One grouped GEMM over the local experts (``torch._grouped_mm`` where the device and
    build have it, else the per-expert loop: the same parameters and numbers)."""
    moe_per_layer_logging: bool = False

    # Tensor parallelism.
    sequence_parallel: bool = False
    """Korthikanti et al. 2022: the LayerNorm/dropout/residual regions run on ``s/TP`` rows,
    the hidden states between layers (and pipeline stages) are ``[s/TP, b, h]``; the TP
    all-reduces become an all-gather before each column-parallel linear and a reduce-scatter
    after each row-parallel one. No effect without TP (a group of one)."""

    # Context parallelism (the group itself is passed to the model, as the TP group).
    context_parallel_size: int = 1
    """Ranks each sequence is split over (see megatron.core.transformer.context_parallel)."""
    cp_comm_type: str | list[str] = dataclasses.field(default_factory=lambda: ["p2p"])
    """p2p, all_gather or a2a; a list gives one per layer (one entry: every layer)."""

    def cp_comm_type_of(self, layer_number: int) -> str:
        """The context-parallel exchange of 1-based global layer ``layer_number``."""
        types = self.cp_comm_type
        if isinstance(types, str):
            return types
        return types[0] if len(types) == 1 else types[layer_number - 1]

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by "
                                 f"num_attention_heads ({self.num_attention_heads}); set "
                                 "kv_channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not divisible "
                             f"by num_query_groups ({self.num_query_groups})")

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (1-based) has an MoE MLP."""
        if self.num_moe_experts is None:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return (layer_number - 1) % freq == 0
        return bool(freq[layer_number - 1])

    @property
    def use_sdpa(self) -> bool:
        """True for torch's scaled_dot_product_attention, False for the unfused reference."""
        return self.attention_backend not in ("unfused", "local")

    @property
    def gelu_tanh_approximation(self) -> bool:
        """Megatron-LM's GeLU: tanh form with --openai-gelu or the (default) bias-gelu fusion
        (:func:`gelu_tanh_approximation`)."""
        return gelu_tanh_approximation(self)


def gelu_tanh_approximation(settings) -> bool:
    """The MLP's GeLU form of a :class:`TransformerConfig` or of a checkpoint's ``args``: True
    for the tanh approximation, False for the exact erf form.

    23.06 ``ParallelMLP``: openai_gelu -> tanh formula; onnx_safe -> erf formula; otherwise
    ``F.gelu`` (erf) -- but with ``bias_gelu_fusion`` (default on, needs biases) the fused
    ``bias_gelu`` kernel computes the tanh approximation instead. Missing attributes take
    Megatron-LM's defaults.
    """
    if getattr(settings, "openai_gelu", False):
        return True
    if getattr(settings, "onnx_safe", False):
        return False
    return bool(getattr(settings, "bias_gelu_fusion", True)) and \
        bool(getattr(settings, "add_bias_linear", True))
