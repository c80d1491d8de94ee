"""Self-attention split over TP ranks by heads (paper, figure 3b).

The fused QKV projection is one column-parallel linear (rank r computes heads
``[r np/p, (r+1) np/p)``), attention runs locally on those heads, and the output projection is
row-parallel (one all-reduce forward, one backward). Two attention implementations:

* SDPA (default): ``torch.nn.functional.scaled_dot_product_attention``; ``is_causal`` when no
  mask is given for causal attention, an additive mask otherwise.
* unfused (``attention_backend`` ``unfused``/``local``): the explicit scale, mask, softmax,
  dropout, matmul reference of Megatron-LM's ``CoreAttention``. The 1/norm_factor scale is the
  ``alpha`` of one ``baddbmm`` (inside the GEMM, as Megatron) so an fp16 Q K^T that exceeds the fp16
  range before scaling stays finite; fp16/bf16 scores are upcast to fp32 for the softmax with
  ``--attention-softmax-in-fp32`` or ``--apply-query-key-layer-scaling`` (fp32/fp64 untouched, as
  Megatron's ``FusedScaleMaskSoftmax``).

``--apply-query-key-layer-scaling`` and ``--attention-softmax-in-fp32`` act on the unfused path
only. SDPA does not need them: with fp16/bf16 inputs torch's CPU kernels compute the
scores and the softmax in fp32 internally -- the CPU flash kernel (no dropout) accumulates in fp32,
and the math kernel (chosen when dropout is on) upcasts q, k, v to fp32 and multiplies q and k by
sqrt(scale) each before the matmul -- and casts only the output back. On CUDA the flash and
memory-efficient kernels also accumulate in fp32, and the math kernel upcasts unless
``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``.
(``tests/core/transformer/test_attention.py`` checks the CPU half-precision claim.)

Legend: s sequence, b batch, h hidden, np heads on this rank, hn head size, hp = np * hn.
Masks are boolean ``[b or 1, 1, sq, sk]`` with True = masked out (Megatron's convention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from megatron.core import comm
from megatron.core.fusions.fused_softmax import fused_scale_mask_softmax
from megatron.core.inference_params import InferenceParams
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel.random import (checkpoint, checkpoint_eagerly,
                                                  run_in_tp_stream)
from megatron.core.tensor_parallel.utils import ProcessGroup, divide, tp_world_size
from megatron.core.transformer.config import AttnMaskType, TransformerConfig
from megatron.core.transformer.context_parallel import context_parallel_attention
from megatron.core.transformer.layernorm import build_norm
from megatron.core.transformer.rotary import (RotaryPosEmb, apply_rotary_pos_emb,
                                               rotary_cos_sin)

# Megatron fills masked scores with this value rather than -inf (no NaN). A fully masked row (a
# padding query) gets what Megatron-LM gives it for the dtype: zeros from its fused CUDA kernel
# (fp16/bf16 with --masked-softmax-fusion), else the uniform row of its PyTorch softmax; every
# path here gives the same (_padding_rows), since a loss reading every position (SQuAD's span
# loss) sees them.
_MASK_VALUE = -10000.0


def _padding_rows(out: torch.Tensor, mask: torch.Tensor, zero: bool,
                  uniform: torch.Tensor) -> torch.Tensor:
    """``out`` [b, np, sq, x] with the rows of fully masked queries (mask [b|1, 1, sq, sk])
    set to zeros (``zero``) or to ``uniform`` [b, np, 1, x] (the row of a uniform softmax)."""
    full = mask.all(dim=-1, keepdim=True)  # [b|1, 1, sq, 1]
    return out.masked_fill(full, 0.0) if zero else torch.where(full, uniform, out)


def causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[1, 1, s, s]`` mask, True above the diagonal (future positions)."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device),
                      diagonal=1).view(1, 1, seq_length, seq_length)


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask (True = masked) -> the additive ``[b|1, 1, sq, sk]`` SDPA takes: 0 where
    attended, ``_MASK_VALUE`` where masked. A float mask is taken as additive already. The
    transformer block converts once per forward, not every layer."""
    if attention_mask.dtype != torch.bool:
        return attention_mask.to(dtype)
    mask = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill(attention_mask, _MASK_VALUE)


class CoreAttention(torch.nn.Module):
    """softmax(Q K^T / sqrt(hn)) V on this rank's heads, with dropout under the TP RNG stream.

    Args:
        config: transformer settings.
        layer_number: 1-based layer index (query-key layer scaling uses it).
        attn_mask_type: ``causal`` (GPT) or ``padding`` (BERT).
        tp_size: the TP size (heads split over that many ranks).
        cp_group: the context-parallel group; with more than one rank the sequence is split
            over it and attention runs :func:`context_parallel_attention`.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType = "causal", tp_size: int = 1,
                 cp_group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.cp_group = cp_group if comm.world_size(cp_group) > 1 else None
        self.cp_comm_type = config.cp_comm_type_of(max(1, layer_number))
        self.tp_size = tp_size  # ranks the heads are split over (their dropout streams)
        self.attn_mask_type = attn_mask_type
        self.layer_number = max(1, layer_number)
        self.softmax_in_fp32 = (config.attention_softmax_in_fp32
                                or config.apply_query_key_layer_scaling)
        # Query-key layer scaling: scores are divided by an extra `coeff` in the matmul (fp16
        # range) and multiplied back before the softmax, so the math is unchanged.
        self.coeff = self.layer_number if config.apply_query_key_layer_scaling else None
        self.norm_factor = math.sqrt(config.kv_channels) * (self.coeff or 1)
        self.dropout_p = config.attention_dropout

    def draws_per_rank(self) -> bool:
        """Its dropout is active and must differ between TP ranks: inside a compiled layer it
        runs eagerly under the TP stream (:func:`run_in_tp_stream`)."""
        return self.training and self.dropout_p > 0 and self.tp_size > 1

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
        """q ``[s, b, np, hn]``, k, v ``[sk, b, g, hn]`` (g = np, or the key/value groups of
        grouped-query attention: query head i reads group i // (np/g)) -> context
        ``[s, b, hp]``."""
        if self.cp_group is not None:
            # validate() refuses explicit masks and attention dropout with CP.
            assert attention_mask is None and not (self.training and self.dropout_p > 0)
            return context_parallel_attention(query, key, value, self.cp_group,
                                              self.cp_comm_type,
                                              causal=self.attn_mask_type == "causal",
                                              scale=1.0 / math.sqrt(self.config.kv_channels))
        if self.config.use_sdpa:
            return self._sdpa(query, key, value, attention_mask)
        key, value = _repeat_groups(key, query.size(2)), _repeat_groups(value, query.size(2))
        return self._unfused(query, key, value, attention_mask)

    def _sdpa(self, query, key, value, attention_mask):
        sq, b, np_, hn = query.shape
        # SDPA reads the groups itself (no np/g copies of the keys and values) where its kernel
        # takes them: without a mask (transformers' rule) and, on CUDA, in half precision, the
        # flash kernel's case; fp32 GQA there would fall back to the s x s math kernel.
        enable_gqa = key.size(2) != np_ and attention_mask is None and (
            query.device.type != "cuda" or query.dtype in (torch.float16, torch.bfloat16))
        if not enable_gqa:
            key, value = _repeat_groups(key, np_), _repeat_groups(value, np_)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np|g, s, hn]
        mask, is_causal = None, False
        if attention_mask is not None:
            mask = additive_mask(attention_mask, q.dtype)  # [b|1, 1, sq, sk]
        elif self.attn_mask_type == "causal" and sq > 1:
            # One query (a generation step: the newest position) sees every key: no mask.
            is_causal = True
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                      scale=1.0 / math.sqrt(hn), enable_gqa=enable_gqa)
        if dropout_p > 0:
            # Heads are split over TP ranks, so their dropout must differ per rank: TP stream.
            ctx = run_in_tp_stream(F.scaled_dot_product_attention, q, k, v,
                                   tp_size=self.tp_size, **kwargs)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, **kwargs)
        if attention_mask is not None:  # the additive mask left such rows' softmax unmasked
            ctx = _padding_rows(ctx, attention_mask, self._zero_padding_rows(q.dtype),
                                v.mean(dim=-2, keepdim=True))  # [b, np, sq, hn]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)  # [s, b, hp]

    def _zero_padding_rows(self, dtype: torch.dtype) -> bool:
        """Megatron-LM's fully masked rows: zeros where its fused kernel runs (half precision
        with --masked-softmax-fusion), uniform elsewhere."""
        return self.config.masked_softmax_fusion and dtype in (torch.float16, torch.bfloat16)

    def _unfused(self, query, key, value, attention_mask):
        sq, b, np_, hn = query.shape
        sk = key.size(0)
        q = query.reshape(sq, b * np_, hn).transpose(0, 1)  # [b*np, sq, hn]
        k = key.reshape(sk, b * np_, hn).transpose(0, 1)  # [b*np, sk, hn]
        v = value.reshape(sk, b * np_, hn).transpose(0, 1)  # [b*np, sk, hn]
        # Scale inside the GEMM (alpha, beta=0 ignores the uninitialized input), as Megatron: a
        # separate multiply would see the unscaled fp16 Q K^T, which overflows first.
        scores = torch.baddbmm(torch.empty(b * np_, sq, sk, dtype=q.dtype, device=q.device),
                               q, k.transpose(1, 2), beta=0.0,
                               alpha=1.0 / self.norm_factor)  # [b*np, sq, sk]
        scores = scores.view(b, np_, sq, sk)  # [b, np, sq, sk]
        probs = self._scale_mask_softmax(scores, attention_mask)
        if self.training and self.dropout_p > 0:
            probs = run_in_tp_stream(F.dropout, probs, tp_size=self.tp_size, p=self.dropout_p)
        ctx = torch.bmm(probs.view(b * np_, sq, sk), v)  # [b*np, sq, hn]
        ctx = ctx.view(b, np_, sq, hn).permute(2, 0, 1, 3)  # [sq, b, np, hn]
        return ctx.reshape(sq, b, np_ * hn)  # [sq, b, hp]

    def _scale_mask_softmax(self, scores: torch.Tensor,
                            attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.config.masked_softmax_fusion:
            # Megatron's fused kernels (fp32 math for every input dtype, fully masked rows -> 0);
            # None where no kernel is built for this device/dtype: the PyTorch ops below.
            probs = fused_scale_mask_softmax(scores, attention_mask,
                                             self.attn_mask_type == "causal", self.coeff or 1.0)
            if probs is not None:
                return probs if attention_mask is None else self._padding_probs(
                    probs, attention_mask, scores.dtype)
        in_dtype = scores.dtype
        # Only half precision is upcast: .float() would round fp64 scores down to fp32.
        if self.softmax_in_fp32 and in_dtype in (torch.float16, torch.bfloat16):
            scores = scores.float()
        if self.coeff is not None:
            scores = scores * self.coeff
        if attention_mask is None and self.attn_mask_type == "causal" and scores.size(-2) > 1:
            attention_mask = causal_mask(scores.size(-1), scores.device)[..., -scores.size(-2):, :]
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, _MASK_VALUE)
        probs = torch.softmax(scores, dim=-1).to(in_dtype)
        return probs if attention_mask is None else self._padding_probs(probs, attention_mask,
                                                                        in_dtype)

    def _padding_probs(self, probs: torch.Tensor, mask: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
        """[b, np, sq, sk] probabilities with Megatron's fully masked rows for ``dtype``."""
        uniform = torch.full_like(probs[..., :1, :], 1.0 / probs.size(-1))
        return _padding_rows(probs, mask, self._zero_padding_rows(dtype), uniform)


class SelfAttention(torch.nn.Module):
    """Megatron-LM's ``ParallelAttention`` (self-attention): QKV column-parallel, dense
    row-parallel. Parameter names: ``query_key_value``, ``dense``.

    Args:
        config: transformer settings.
        layer_number: 1-based layer index.
        tp_group: the TP process group.
        attn_mask_type: ``causal`` or ``padding``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 tp_group: ProcessGroup | None, attn_mask_type: AttnMaskType = "causal",
                 cp_group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        tp = tp_world_size(tp_group)
        projection = config.kv_channels * config.num_attention_heads
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        # Grouped-query attention: G key/value heads, each shared by np/G query heads; the
        # config check (megatron/config/validate.py) makes TP divide G.
        self.groups_per_partition = divide(config.num_query_groups, tp)
        self.heads_per_group = divide(config.num_attention_heads, config.num_query_groups)
        self.head_dim = config.kv_channels
        self.layer_number = layer_number  # names this layer's KV cache
        self.rotary_interleaved = config.rotary_interleaved
        # Full QKV weight rows are Megatron's grouped layout [G, np/G + 2, hn]: each group's
        # query heads, then its key, then its value (G = np: [np, 3, hn], checkpoint version
        # >= 2.0). A contiguous split over TP ranks hands each rank whole groups.
        self.query_key_value = tp_layers.ColumnParallelLinear(
            config.hidden_size, projection + 2 * config.kv_channels * config.num_query_groups,
            tp_group=tp_group,
            init_method=tp_layers.init_method_normal(config.init_method_std),
            bias=config.add_bias_linear or config.add_qkv_bias, gather_output=False,
            params_dtype=config.params_dtype,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            sequence_parallel=config.sequence_parallel, **tp_layers.init_options(config))
        if config.qk_layernorm and config.qk_layernorm_full_projection:
            # Whole rows of this rank's q and k (TP=1: validation refuses more ranks, whose
            # norm would need the other ranks' heads).
            self.q_layernorm = build_norm(config, projection, partial_grads=False)
            self.k_layernorm = build_norm(config, config.kv_channels * config.num_query_groups,
                                          partial_grads=False)
        elif config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = self._head_norm(), self._head_norm()
        else:
            self.q_layernorm = self.k_layernorm = None
        self.core_attention = CoreAttention(config, layer_number, attn_mask_type, tp, cp_group)
        self.checkpoint_core_attention = config.recompute_granularity == "selective"
        self.dense = tp_layers.RowParallelLinear(
            projection, config.hidden_size, tp_group=tp_group,
            init_method=tp_layers.scaled_init_method_normal(config.init_method_std,
                                                            config.num_layers),
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            params_dtype=config.params_dtype,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            sequence_parallel=config.sequence_parallel, **tp_layers.init_options(config))

    def _head_norm(self) -> torch.nn.Module:
        """``--qk-layernorm``: one norm over ``hn`` shared by every head, replicated on all TP
        ranks. Each rank normalizes only its own heads (of the full sequence, even with
        sequence parallelism), so its weight gradient is a partial sum over heads: marked for
        the TP all-reduce whenever TP > 1, as Megatron's ``_allreduce_layernorm_grads`` sums
        ``q_layernorm`` / ``k_layernorm`` with ``config.qk_layernorm``."""
        return build_norm(self.config, self.head_dim, partial_grads=True)

    def _qk_norm(self, query: torch.Tensor, key: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[s, b, np, hn]`` queries and ``[s, b, g, hn]`` keys normalized per head, or with
        ``qk_layernorm_full_projection`` over all heads of each (heads in HF's order)."""
        if not self.config.qk_layernorm_full_projection:
            return self.q_layernorm(query), self.k_layernorm(key)
        q = self.q_layernorm(query.flatten(2)).view_as(query)
        return q, self.k_layernorm(key.flatten(2)).view_as(key)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                inference_params: InferenceParams | None = None,
                rotary_pos_emb: RotaryPosEmb | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` -> (``[s, b, h]`` before the dense bias, the dense bias); with
        sequence parallelism ``[s/p, b, h]`` in and out (the QKV projection gathers the
        sequence, attention runs on all ``s`` for this rank's heads, the dense layer scatters).

        ``rotary_pos_emb``: RoPE ``(cos, sin)`` ``[s, 1, 1, rot]`` of this forward's positions
        (or their fp32 angles); queries and keys are rotated before the keys enter the cache. With
        ``inference_params`` (generation) this step's keys and values are appended to the
        layer's cache (only the G key/value heads) and the queries attend to every cached
        position (see :mod:`megatron.core.inference_params`).
        """
        mixed, _ = self.query_key_value(hidden_states)  # [s, b, g*(np/g+2)*hn] (all s with SP)
        s, b = mixed.shape[:2]
        g, per_group = self.groups_per_partition, self.heads_per_group
        mixed = mixed.view(s, b, g, (per_group + 2) * self.head_dim)  # [s, b, g, (np/g+2)hn]
        query, key, value = torch.split(
            mixed, [per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        query = query.reshape(s, b, g * per_group, self.head_dim)  # [s, b, np, hn]
        if self.q_layernorm is not None:
            query, key = self._qk_norm(query, key)
        if rotary_pos_emb is not None:
            rotary = rotary_cos_sin(rotary_pos_emb, query.dtype)  # one pair for q and k
            query = apply_rotary_pos_emb(query, rotary, self.rotary_interleaved)
            key = apply_rotary_pos_emb(key, rotary, self.rotary_interleaved)
        if inference_params is not None:
            key, value = inference_params.store(self.layer_number, key, value)  # [sk, b, g, hn]
            attention_mask = self._cached_causal_mask(attention_mask, s, key.size(0), key.device)
        if self.checkpoint_core_attention and self.training:
            # Selective recompute: the s^2 scores are the memory hog, cheap to recompute.
            context = self._recomputed_core_attention(query, key, value, attention_mask)
        else:
            context = self.core_attention(query, key, value, attention_mask)  # [s, b, hp]
        return self.dense(context)

    def _recomputed_core_attention(self, *args: torch.Tensor | None) -> torch.Tensor:
        """The core attention, its activations recomputed in backward (selective recompute)."""
        if not torch.compiler.is_compiling():
            return checkpoint(self.core_attention, False, *args)
        if self.core_attention.draws_per_rank() or self.core_attention.cp_group is not None:
            # Its dropout runs eagerly under the TP stream, whose state only our checkpoint
            # restores for the recompute; or the context-parallel attention, itself a graph
            # break (context_parallel_attention), which torch's traced checkpoint cannot hold:
            # the whole region runs eagerly (a graph break).
            return checkpoint_eagerly(self.core_attention, False, *args)
        # Traced (--compile-layers): torch's checkpoint is what the compiler understands; the
        # compiled backward recomputes the region with the forward's random draws.
        return torch.utils.checkpoint.checkpoint(self.core_attention, *args,
                                                 use_reentrant=False)

    def _cached_causal_mask(self, attention_mask: torch.Tensor | None, sq: int, sk: int,
                            device: torch.device) -> torch.Tensor | None:
        """The mask of ``sq`` new queries over ``sk`` cached keys: the new queries are the last
        ``sq`` positions, so the causal mask is the bottom ``sq`` rows of the ``sk x sk`` one
        (SDPA's ``is_causal`` aligns top-left, which is wrong once ``sq < sk``)."""
        if attention_mask is not None or self.core_attention.attn_mask_type != "causal" \
                or sq == sk or sq == 1:
            # sq == 1: the newest position attends to every cached key; a mask of all False
            # would cost five small ops a layer per generated token for nothing.
            return attention_mask
        # O(sq * sk) per step, not the sk x sk triangle: one new query is one row of False.
        query_positions = torch.arange(sk - sq, sk, device=device).view(sq, 1)
        key_positions = torch.arange(sk, device=device).view(1, sk)
        return (key_positions > query_positions).view(1, 1, sq, sk)


def _repeat_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value ``[sk, b, g, hn]`` -> ``[sk, b, heads, hn]``: each group's head repeated
    ``heads / g`` times (grouped-query attention), or ``t`` itself when g == heads."""
    if t.size(2) == heads:
        return t
    return t.repeat_interleave(heads // t.size(2), dim=2)
