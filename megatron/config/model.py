"""Model architecture, dropout and initialization flags (Megatron's network size,
regularization-dropout and initialization groups)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron.config.base import spec
from megatron.config.moe_freq import moe_freq_type


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Transformer shape, dropout, initialization and attention numerics."""

    num_layers: int | None = None
    """Number of transformer layers."""
    encoder_num_layers: int | None = None
    """Number of encoder layers (encoder-decoder models; alternative to --num-layers)."""
    decoder_num_layers: int | None = None
    """Number of decoder layers (encoder-decoder models)."""
    hidden_size: int | None = None
    """Transformer hidden size."""
    ffn_hidden_size: int | None = None
    """Hidden size of the MLP; defaults to 4 x --hidden-size."""
    num_attention_heads: int | None = None
    """Number of attention heads."""
    kv_channels: int | None = None
    """Projection size per attention head; defaults to --hidden-size / --num-attention-heads."""
    max_position_embeddings: int | None = None
    """Maximum sequence length the learned position embedding supports."""
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    """Position embedding: a learned absolute table, rotary (RoPE, in every attention layer),
    or none."""
    use_rotary_position_embeddings: bool = False
    """Older spelling of --position-embedding-type rope."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that rotary embeddings rotate."""
    rotary_base: int = 10000
    """Base of the rotary embeddings' geometric frequency sequence."""
    rotary_interleaved: bool = False
    """Rotate adjacent dimension pairs instead of the two halves of the rotary dimensions."""
    group_query_attention: bool = False
    """Grouped-query attention: --num-query-groups key/value heads shared by the query heads."""
    num_query_groups: int | None = 1
    """Key/value heads with --group-query-attention (ignored without it, as Megatron-LM)."""
    add_position_embedding: bool = spec(True, flag="--no-position-embedding")
    """Disable the learned position embedding."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this value x TP size, for efficient GEMMs."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """The norm of every transformer layer and the final norm."""
    layernorm_epsilon: float = spec(1e-5, aliases=("--norm-epsilon",))
    """Epsilon of every norm (LayerNorm or RMSNorm); --norm-epsilon is Megatron-LM
    core_v0.13's name."""
    apply_layernorm_1p: bool = False
    """LayerNorm weights are stored as (gamma - 1), centring them at zero."""
    apply_residual_connection_post_layernorm: bool = False
    """Take the residual after the LayerNorm (original BERT) instead of before it."""
    openai_gelu: bool = False
    """Use OpenAI's tanh approximation of GeLU (as GPT-2 did)."""
    squared_relu: bool = False
    """Use squared ReLU instead of GeLU."""
    swiglu: bool = False
    """Use a gated SwiGLU MLP instead of GeLU."""
    onnx_safe: bool | None = spec(None, argtype=lambda s: s.lower() in ("1", "true", "yes"))
    """Use workarounds for known problems with the Torch ONNX exporter."""
    bert_binary_head: bool = spec(True, flag="--bert-no-binary-head")
    """Disable BERT's binary (sentence-order) head."""
    num_experts: int | None = None
    """Number of experts in each mixture-of-experts layer (None: dense MLPs only)."""
    moe_layer_freq: int | list[int] = spec(1, argtype=moe_freq_type)
    """Which layers are MoE: an int N (one MoE layer every N layers, from the first) or a
    Python list expression of 0/1 per layer such as "[1,1,0,1]" or "([0]+[1]*3)*2"."""
    moe_ffn_hidden_size: int | None = None
    """Hidden size of each expert's MLP (default: --ffn-hidden-size)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Hidden size of the shared experts, all of them together (None: no shared expert)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x . w) (Qwen2-MoE)."""
    moe_shared_expert_overlap: bool = False
    """Overlap the shared experts with the token dispatch (not built: refused)."""
    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing",
        "none"] = "aux_loss"
    """Load balancing: the Switch/GShard loss over the micro-batch (aux_loss), per sequence
    (seq_aux_loss, DeepSeek-V2), over the global batch (global_aux_loss), S-BASE Sinkhorn
    routing, or none. quantile_balancing is not built (refused)."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (1e-2 is a usual start)."""
    moe_z_loss_coeff: float | None = None
    """Coefficient of the router z-loss (1e-3 is a usual start)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_router_score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    """The router's score function."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (softmax scores); needed for top-1."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiply the top-k gates by this factor."""
    moe_router_num_groups: int | None = None
    """Expert groups for group-limited routing (DeepSeek device/node-limited routing)."""
    moe_router_group_topk: int | None = None
    """Groups each token may choose its experts from (group-limited routing)."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Dtype of the router's GEMM, scores and losses (default: the activations')."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, updated each step from the
    token counts, added to the scores for the choice of experts only."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update."""
    moe_router_fusion: bool = False
    """Transformer Engine's fused router kernels (not built: refused)."""
    moe_router_force_load_balancing: bool = False
    """Random router logits, for benchmarks (not built: refused)."""
    moe_input_jitter_eps: float | None = None
    """Multiply the router input by uniform noise in [1 - eps, 1 + eps] in training."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    """How tokens reach the experts' ranks; flex (DeepEP / HybridEP) is not built (refused)."""
    moe_grouped_gemm: bool = False
    """Run the local experts as grouped GEMMs (torch._grouped_mm on CUDA in bf16 where the
    build has it; the per-expert loop elsewhere, with the same numbers)."""
    moe_permute_fusion: bool = False
    """Transformer Engine's fused token permutation (not built: refused)."""
    moe_per_layer_logging: bool = False
    """Log each MoE layer's auxiliary losses, not only their mean."""
    moe_expert_capacity_factor: float | None = None
    """Tokens per expert capped at ceil(T k / E x factor); None: dropless."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (needs --moe-expert-capacity-factor)."""
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Over capacity, keep the tokens with the highest gates (probs) or routed tokens first
    (position; ties broken as Megatron-Core's top-k over the routing map breaks them)."""
    moe_layer_recompute: bool = False
    """Checkpoint the MoE layer's activations (not built: refused)."""
    moe_use_upcycling: bool = False
    """Turn a dense checkpoint into an MoE one (not built: refused)."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of tying it to the word embeddings."""
    embedding_weights_in_fp32: bool = False
    """Keep the word embedding in fp32 with fp16/bf16 training."""
    add_bias_linear: bool = spec(True, flag="--disable-bias-linear")
    """Disable biases in the linear layers."""
    add_qkv_bias: bool = False
    """Keep the QKV projection's bias with --disable-bias-linear (Qwen2-style)."""
    qk_layernorm: bool = False
    """Normalize each query and key head over its kv-channels (the --normalization norm,
    after the QKV projection, before RoPE; Qwen3-style)."""
    qk_layernorm_full_projection: bool = False
    """With --qk-layernorm: one norm over the whole query projection (all heads' q,
    heads x kv-channels wide) and one over all keys (query-groups x kv-channels), as OLMoE and
    OLMo-2 normalize, instead of one per head. Not in Megatron-LM; TP=1 only."""

    attention_dropout: float = 0.1
    """Dropout probability of the attention probabilities."""
    hidden_dropout: float = 0.1
    """Dropout probability of the embedding and of each residual branch."""

    seed: int = 1234
    """Random seed for python, numpy, torch and the model-parallel streams."""
    data_parallel_random_init: bool = False
    """Initialize each data-parallel replica with a different seed."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    init_method_xavier_uniform: bool = False
    """Use Xavier-uniform initialization instead of the normal distribution."""

    apply_query_key_layer_scaling: bool = spec(
        False, flag="--apply-query-key-layer-scaling")
    """Scale Q.K^T by 1/layer-number (and the softmax input back up), for fp16 stability.
    Megatron-LM 23.06's inverse switch --no-query-key-layer-scaling is accepted too. Acts on the
    unfused attention path (with --attention-softmax-in-fp32 forced on); torch's SDPA already
    computes fp16/bf16 scores and softmax in fp32 internally."""
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    """Attention implementation: auto/flash/fused use torch's scaled_dot_product_attention;
    unfused/local use the explicit scale-mask-softmax reference path."""
    masked_softmax_fusion: bool = spec(True, flag="--no-masked-softmax-fusion")
    """Disable the fused scale-mask-softmax kernels (megatron/fused_kernels) of the unfused
    attention path (--attention-backend unfused/local); torch's softmax then runs."""
    bias_gelu_fusion: bool = spec(True, flag="--no-bias-gelu-fusion")
    """Disable the fused bias + GeLU (TorchScript, tanh GeLU); without it the exact erf GeLU
    runs, as in Megatron-LM 23.06."""
    bias_swiglu_fusion: bool = spec(True, flag="--no-bias-swiglu-fusion")
    """Disable the fused (bias +) SwiGLU of --swiglu (Megatron-Core's flag): the plain ops then
    keep silu(gate) besides fc1's output for the backward (same values, more memory)."""
    bias_dropout_fusion: bool = spec(True, flag="--no-bias-dropout-fusion")
    """Disable the fused bias + dropout + residual add (TorchScript; same values)."""
    no_persist_layer_norm: bool = False
    """Do not use APEX's persistent fused LayerNorm kernel. Accepted for Megatron-LM scripts;
    no effect here: the fused layer norm of megatron/fused_kernels has a single kernel (the
    persistent/non-persistent choice is between two APEX kernels with the same numerics)."""
    compile_layers: bool = False
    """torch.compile each transformer layer (not Megatron-LM's; as torchtitan compiles per
    block): inductor fuses its elementwise work (bias + GeLU, layer norms, bias-dropout-add).
    Training and evaluation forwards; generation with the KV cache runs the layers uncompiled
    (--no-kv-cache runs them compiled). Off by default: the first step pays the compile time
    and the gain depends on the model (docs/benchmarks.md)."""
    use_flash_attn: bool = False
    """Use FlashAttention (here: torch's SDPA, which dispatches to flash kernels on GPUs)."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Transformer implementation: local (this library's layers)."""
