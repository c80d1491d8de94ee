"""Megatron <-> HuggingFace ``GPT2LMHeadModel`` names, shapes and settings (shared by
``saver_hf`` and ``loader_hf``; ``transformers`` itself is only imported by those), and the
split of our grouped QKV rows that the BERT and Llama-family mappings share.

GPT-2 in transformers keeps its linear weights as ``Conv1D`` ``[in, out]`` (ours are
``[out, in]``: transposed) and its fused ``c_attn`` columns as all q, then all k, then all v
(checkpoint_version 0's ``[3, np, hn]`` order; ours is ``[np, 3, hn]``).
"""

from __future__ import annotations

import argparse

import torch

from megatron.checkpointing import qkv_from_current_order, qkv_to_current_order
from megatron.core.transformer.config import gelu_tanh_approximation

LAYER = "language_model.encoder.layers.{}."
ATTENTION = LAYER + "self_attention."

GPT2_LAYER = "transformer.h.{}."
# (ours, HF, transposed): whole-tensor renames of one layer.
GPT2_LAYER_TENSORS = (
    ("input_layernorm.weight", "ln_1.weight", False),
    ("input_layernorm.bias", "ln_1.bias", False),
    ("self_attention.dense.weight", "attn.c_proj.weight", True),
    ("self_attention.dense.bias", "attn.c_proj.bias", False),
    ("post_attention_layernorm.weight", "ln_2.weight", False),
    ("post_attention_layernorm.bias", "ln_2.bias", False),
    ("mlp.dense_h_to_4h.weight", "mlp.c_fc.weight", True),
    ("mlp.dense_h_to_4h.bias", "mlp.c_fc.bias", False),
    ("mlp.dense_4h_to_h.weight", "mlp.c_proj.weight", True),
    ("mlp.dense_4h_to_h.bias", "mlp.c_proj.bias", False),
)
LAYER_ORDER = ("input_layernorm.weight", "input_layernorm.bias",
               "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
               "self_attention.dense.weight", "self_attention.dense.bias",
               "post_attention_layernorm.weight", "post_attention_layernorm.bias",
               "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
               "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias")
"""A layer's tensors in the order Megatron's modules hold them (and its checkpoints list them)."""
GPT2_QKV = (("self_attention.query_key_value.weight", "attn.c_attn.weight"),
            ("self_attention.query_key_value.bias", "attn.c_attn.bias"))


def gelu_is_tanh(args: argparse.Namespace) -> bool:
    """Megatron's MLP GeLU form (``megatron.core.transformer.config.gelu_tanh_approximation``):
    the tanh approximation with --openai-gelu or the default bias-GeLU fusion, else the exact
    erf."""
    return gelu_tanh_approximation(args)


def check_gpt2_compatible(args: argparse.Namespace) -> None:
    """Refuse Megatron GPTs that ``GPT2LMHeadModel`` cannot express.

    Raises:
        ValueError: naming the flag.
    """
    problems = [flag for flag, bad in (
        ("--use-rotary-position-embeddings", getattr(args, "use_rotary_position_embeddings",
                                                     False)),
        ("--swiglu", getattr(args, "swiglu", False)),
        ("--squared-relu", getattr(args, "squared_relu", False)),
        ("--disable-bias-linear", not getattr(args, "add_bias_linear", True)),
        ("--apply-residual-connection-post-layernorm",
         getattr(args, "apply_residual_connection_post_layernorm", False)),
        ("--apply-layernorm-1p", getattr(args, "apply_layernorm_1p", False)),
        ("--no-position-embedding", not getattr(args, "add_position_embedding", True)),
        ("--normalization RMSNorm", getattr(args, "normalization", "LayerNorm") != "LayerNorm"),
        ("--position-embedding-type none",
         getattr(args, "position_embedding_type", "learned_absolute") == "none"),
        ("--group-query-attention", getattr(args, "group_query_attention", False)
         and getattr(args, "num_query_groups", None) not in (None, args.num_attention_heads)),
        ("--add-qkv-bias", getattr(args, "add_qkv_bias", False)),
    ) if bad]
    kv = getattr(args, "kv_channels", None)
    if kv is not None and kv * args.num_attention_heads != args.hidden_size:
        problems.append(f"--kv-channels {kv} (GPT-2 has hidden_size / heads)")
    if problems:
        raise ValueError("GPT2LMHeadModel cannot hold a model trained with "
                         + ", ".join(problems))


def split_grouped_qkv(t: torch.Tensor, heads: int,
                      groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused QKV rows in Megatron's grouped layout ``[G, np/G + 2, hn]`` (G = np: the
    ``[np, 3, hn]`` of checkpoint version >= 2.0) -> q ``[np*hn, ...]``, k and v ``[G*hn, ...]``,
    as HF's BERT and Llama-family models keep them (weights and biases alike)."""
    per_group = heads // groups
    hn = t.shape[0] // (groups * (per_group + 2))
    grouped = t.reshape(groups, per_group + 2, hn, *t.shape[1:])
    q, k, v = torch.split(grouped, [per_group, 1, 1], dim=1)
    return tuple(x.reshape(-1, *t.shape[1:]).contiguous() for x in (q, k, v))


def fuse_grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     groups: int) -> torch.Tensor:
    """The inverse of :func:`split_grouped_qkv`."""
    rest, hn = q.shape[1:], k.shape[0] // groups
    parts = (q.reshape(groups, -1, hn, *rest), k.reshape(groups, 1, hn, *rest),
             v.reshape(groups, 1, hn, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Our ``[np*3*hn, h]`` / ``[np*3*hn]`` -> HF ``c_attn`` ``[h, 3h]`` / ``[3h]``."""
    ordered = qkv_from_current_order(t, 3, heads, 0.0)  # [3, np, hn] rows
    return ordered.t().contiguous() if ordered.dim() == 2 else ordered


def qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF ``c_attn`` -> ours (the inverse of :func:`qkv_to_hf`)."""
    rows = t.t().contiguous() if t.dim() == 2 else t
    return qkv_to_current_order(rows, 3, heads, 0.0)
