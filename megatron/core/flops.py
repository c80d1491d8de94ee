"""Parameter count and training FLOPs of the GPT model, for logging model TFLOP/s.

FLOPs follow Megatron-LM's ``num_floating_point_operations`` (training.py; the paper's
section 5.1 formula): per iteration, forward (1x) + backward (2x) of every GEMM, a multiply-add
counted as 2 FLOPs, causal attention counted as full (as Megatron does):

    12 B s L h^2 [ (2 + s/h) (hp/h) + f/h + V / (2 L h) ]

(hp = heads x kv_channels, f = ffn size, V = padded vocabulary; with grouped-query attention
the QKV GEMM's key/value part is 2 G kv_channels rows instead of 2 hp, and SwiGLU's fc1 is 2 f
wide, Megatron-LM core_v0.13's ``gated_linear_multiplier``). With ``f = 4h`` and
``hp = h`` this is the paper's ``72 B s L h^2 (1 + s/(6h) + V/(12 L h))``. Recomputation adds
a second forward: full recompute multiplies the transformer part by 4/3 (the paper's 96 B s L h^2
form), selective recompute adds the attention core's forward (``4 B s^2 L hp``).
"""

from __future__ import annotations

from megatron.core.transformer.config import TransformerConfig


def num_parameters(config: TransformerConfig, exclude_embeddings: bool = False) -> int:
    """Exact parameter count of the full (unsplit) GPT model, biases and norms (the q/k norms
    of --qk-layernorm too) included.

    Args:
        config: the model's settings (``padded_vocab_size`` set unless ``exclude_embeddings``).
        exclude_embeddings: leave out word, position and token-type embeddings and the untied
            output layer (the usual "non-embedding parameters").
    """
    c = config
    h, f = c.hidden_size, c.ffn_hidden_size
    proj = c.kv_channels * c.num_attention_heads
    qkv = proj + 2 * c.kv_channels * c.num_query_groups  # grouped-query: G key/value heads
    fc1 = 2 * f if c.swiglu else f  # SwiGLU's fc1 holds the gate and up projections
    bias = 1 if c.add_bias_linear else 0
    qkv_bias = 1 if c.add_bias_linear or c.add_qkv_bias else 0
    norm = h if c.normalization == "RMSNorm" else 2 * h  # RMSNorm has no bias
    # --qk-layernorm: one norm over hn each for the queries and the keys, shared by the heads
    # (with --qk-layernorm-full-projection one over all of q and one over all of k).
    qk_width = (proj + c.kv_channels * c.num_query_groups
                if getattr(c, "qk_layernorm_full_projection", False) else 2 * c.kv_channels)
    qk_norms = (qk_width if c.normalization == "RMSNorm" else 2 * qk_width) \
        if c.qk_layernorm else 0
    per_layer = (2 * norm + qk_norms                 # two norms (+ the q/k norms)
                 + qkv * h + qkv_bias * qkv          # query_key_value
                 + proj * h + bias * h               # dense
                 + fc1 * h + f * h + bias * (fc1 + h))  # dense_h_to_4h, dense_4h_to_h
    total = c.num_layers * per_layer + norm          # + final norm
    if exclude_embeddings:
        return total
    if c.padded_vocab_size is None:
        raise ValueError("padded_vocab_size is unset: build the tokenizer first")
    total += c.padded_vocab_size * h
    if c.add_position_embedding and c.position_embedding_type == "learned_absolute":
        total += c.max_position_embeddings * h
    total += c.num_tokentypes * h
    if c.untie_embeddings_and_output_weights:
        total += c.padded_vocab_size * h
    return total


def num_floating_point_operations(config: TransformerConfig, batch_size: int, seq_length: int,
                                  include_recompute: bool = False) -> float:
    """Training FLOPs of one iteration (forward + backward) over ``batch_size`` sequences.

    Args:
        config: the model's settings (``padded_vocab_size`` set).
        batch_size: sequences per iteration (the global batch size for a whole step).
        seq_length: tokens per sequence.
        include_recompute: count the extra forward of activation recomputation (hardware
            FLOPs) as configured by ``recompute_granularity``; False gives model FLOPs, the
            figure Megatron-LM logs.
    """
    c = config
    if c.padded_vocab_size is None:
        raise ValueError("padded_vocab_size is unset: build the tokenizer first")
    b, s, layers, h = batch_size, seq_length, c.num_layers, c.hidden_size
    proj = c.kv_channels * c.num_attention_heads
    kv = 2 * c.kv_channels * c.num_query_groups  # the key and value rows of the QKV GEMM
    fc1 = 2 * c.ffn_hidden_size if c.swiglu else c.ffn_hidden_size
    # Per layer, forward: the GEMMs (QKV, dense, fc1, fc2) 2 B s h (2 hp + kv + fc1 + f) and
    # attention's two s x s products 4 B s^2 hp; backward twice that.
    layer_flops = 3 * layers * (2 * b * s * h * (2 * proj + kv + fc1 + c.ffn_hidden_size)
                                + 4 * b * s * s * proj)
    logits_flops = 6 * b * s * c.padded_vocab_size * h
    extra = 0.0
    if include_recompute and c.recompute_granularity == "full":
        extra = layer_flops / 3
    elif include_recompute and c.recompute_granularity == "selective":
        extra = 4 * b * s * s * layers * proj
    return float(layer_flops + logits_flops + extra)
