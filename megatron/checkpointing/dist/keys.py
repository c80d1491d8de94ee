"""Our legacy parameter names -> Megatron-Core's ``torch_dist`` keys, global shapes and chunks.

A ``torch_dist`` checkpoint stores every tensor once, under Megatron-Core's name, at its global
shape (independent of TP/PP/DP), as chunks that each rank writes where it holds them. Megatron-
Core stacks the decoder layers: ``decoder.layers.<name>`` has a leading ``[num_layers]``
dimension and one chunk per layer (MoE experts add a second stacked dimension, ``[layers,
experts, ...]``). The table below, one block per module kind, maps our (Megatron-LM legacy,
``megatron.core.checkpoint_keys``) names onto those keys:

=====================================================  ===========================================
ours (``language_model.`` / ``...encoder.layers.N.``)  Megatron-Core ``torch_dist``
=====================================================  ===========================================
embedding.word_embeddings.weight (TP rows)             embedding.word_embeddings.weight
embedding.position_embeddings.weight                   embedding.position_embeddings.weight
input_layernorm.{weight,bias}                          decoder.layers.self_attention.linear_qkv
                                                       .layer_norm_{weight,bias} (the TE names)
self_attention.query_key_value.* (TP rows)             decoder.layers.self_attention.linear_qkv.*
self_attention.dense.weight (TP columns) / .bias       decoder.layers.self_attention.linear_proj.*
post_attention_layernorm.{weight,bias}                 decoder.layers.mlp.linear_fc1
                                                       .layer_norm_{weight,bias}
mlp.dense_h_to_4h.* (TP rows; SwiGLU: two chunks)      decoder.layers.mlp.linear_fc1.*
mlp.dense_4h_to_h.weight (TP columns) / .bias          decoder.layers.mlp.linear_fc2.*
encoder.final_layernorm.*                              decoder.final_layernorm.*
output_layer.weight (untied; TP rows)                  output_layer.weight
word_embeddings.weight (tied head copy, PP > 1)        embedding.word_embeddings.weight (read, not
                                                       written: a replica of stage 0's)
=====================================================  ===========================================

Both sides keep the same row orders: the QKV rows are grouped per query group (``[ng, (np/ng +
2) * hn]``, our checkpoint version 3 order), and the SwiGLU ``dense_h_to_4h`` rows are ``[gate;
up]`` on every TP rank. Megatron-Core saves the two halves as separate chunks (TP rank ``r`` of
``p`` holds ``gate[r F/p : (r+1) F/p]`` at global row ``r F/p`` and ``up[...]`` at ``F + r F/p``)
so that the global tensor is ``[gate; up]`` whatever the TP size: :attr:`KeyRule.glu`.

MoE rows (``mlp.router``, ``mlp.local_experts.<i>``, ``mlp.shared_experts``) follow the layout
the MoE layers save under; expert ``i`` of EP rank ``e`` is global expert ``e * E/EP + i``. As in
Megatron-Core's ``SequentialMLP.sharded_state_dict`` (parallel folding), an expert's own
dimensions are split over the expert tensor-parallel group (ETP rank and size), the router and
the shared experts' over the dense TP group.

BERT (:func:`bert_rules`, Megatron-Core's ``BertModel``): the same embedding and layer rows,
with the stacked layers under ``encoder.`` instead of ``decoder.``, and its heads:

=====================================================  ===========================================
ours                                                   Megatron-Core ``torch_dist``
=====================================================  ===========================================
language_model.encoder.final_layernorm.*               encoder.final_layernorm.*
language_model.pooler.dense.*                          pooler.dense.*
lm_head.dense.*                                        lm_head.dense.*
lm_head.layernorm.*                                    lm_head.layer_norm.*
lm_head.bias (TP rows of the vocabulary)               output_layer.bias
binary_head.*                                          binary_head.*
=====================================================  ===========================================
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.core.checkpoint_keys import HEAD_COPY_MODULE

LANGUAGE_MODEL = "language_model."
LAYER = "language_model.encoder.layers.{layer}."
EXTRA_STATE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2")
"""Megatron-Core's decoder linears that save an ``_extra_state`` object (``None`` without
Transformer Engine's FP8): written so that Megatron-Core's own load finds them. An MoE layer
has the experts' (one per layer and expert) and the shared experts' instead of the MLP's."""
ATTENTION_LINEARS = EXTRA_STATE_LINEARS[:2]
DENSE_LINEARS = EXTRA_STATE_LINEARS[2:]
EXPERT_LINEARS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
SHARED_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


@dataclass(frozen=True)
class KeyRule:
    """One of our parameters and the Megatron-Core key it is saved under."""

    ours: str
    """Our model's name, with ``{layer}`` for the chunk-local layer number and ``{expert}`` for
    a local expert number."""
    mcore: str
    """Megatron-Core's ``torch_dist`` key."""
    tp_dim: int | None
    """Dimension split over TP ranks (None: whole on every TP rank)."""
    glu: bool = False
    """A gated linear unit's ``[gate; up]`` rows, each half split over TP on its own."""
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pattern = re.escape(self.ours).replace(r"\{layer\}", r"(?P<layer>\d+)") \
            .replace(r"\{expert\}", r"(?P<expert>\d+)")
        object.__setattr__(self, "regex", re.compile(pattern))

    @property
    def stacked(self) -> int:
        """Leading stacked dimensions: 0 (outside the layers), 1 (layers), 2 (layers, experts)."""
        return ("{layer}" in self.ours) + ("{expert}" in self.ours)


def _rules(prefix: str, mcore_prefix: str, rows: Iterable[tuple]) -> tuple[KeyRule, ...]:
    return tuple(KeyRule(prefix + ours, mcore_prefix + mcore, *rest) for ours, mcore, *rest in rows)


EMBEDDING_RULES = _rules(LANGUAGE_MODEL + "embedding.", "embedding.", (
    ("word_embeddings.weight", "word_embeddings.weight", 0),
    ("position_embeddings.weight", "position_embeddings.weight", None),
    ("tokentype_embeddings.weight", "tokentype_embeddings.weight", None),
))
ATTENTION_RULES = _rules(LAYER, "decoder.layers.", (
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", None),
    ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias", None),
    ("self_attention.query_key_value.weight", "self_attention.linear_qkv.weight", 0),
    ("self_attention.query_key_value.bias", "self_attention.linear_qkv.bias", 0),
    ("self_attention.q_layernorm.weight", "self_attention.q_layernorm.weight", None),
    ("self_attention.q_layernorm.bias", "self_attention.q_layernorm.bias", None),
    ("self_attention.k_layernorm.weight", "self_attention.k_layernorm.weight", None),
    ("self_attention.k_layernorm.bias", "self_attention.k_layernorm.bias", None),
    ("self_attention.dense.weight", "self_attention.linear_proj.weight", 1),
    ("self_attention.dense.bias", "self_attention.linear_proj.bias", None),
    ("post_attention_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", None),
    ("post_attention_layernorm.bias", "mlp.linear_fc1.layer_norm_bias", None),
))


def dense_mlp_rules(glu: bool) -> tuple[KeyRule, ...]:
    """The dense MLP's rows (``glu``: SwiGLU's two halves of ``dense_h_to_4h``)."""
    return _rules(LAYER, "decoder.layers.", (
        ("mlp.dense_h_to_4h.weight", "mlp.linear_fc1.weight", 0, glu),
        ("mlp.dense_h_to_4h.bias", "mlp.linear_fc1.bias", 0, glu),
        ("mlp.dense_4h_to_h.weight", "mlp.linear_fc2.weight", 1),
        ("mlp.dense_4h_to_h.bias", "mlp.linear_fc2.bias", None),
    ))


def moe_rules(glu: bool) -> tuple[KeyRule, ...]:
    """The MoE layer's rows: router, experts stacked ``[layers, experts, ...]``, shared expert.
    The pre-MLP norm keeps the dense row: Megatron-Core saves it as
    ``mlp.linear_fc1.layer_norm_weight`` with MoE too."""
    return _rules(LAYER, "decoder.layers.", (
        ("mlp.router.weight", "mlp.router.weight", None),
        ("mlp.router.bias", "mlp.router.bias", None),
        ("mlp.router.expert_bias", "mlp.router.expert_bias", None),
        ("mlp.local_experts.{expert}.dense_h_to_4h.weight",
         "mlp.experts.experts.linear_fc1.weight", 0, glu),
        ("mlp.local_experts.{expert}.dense_h_to_4h.bias",
         "mlp.experts.experts.linear_fc1.bias", 0, glu),
        ("mlp.local_experts.{expert}.dense_4h_to_h.weight",
         "mlp.experts.experts.linear_fc2.weight", 1),
        ("mlp.local_experts.{expert}.dense_4h_to_h.bias",
         "mlp.experts.experts.linear_fc2.bias", None),
        ("mlp.shared_experts.dense_h_to_4h.weight", "mlp.shared_experts.linear_fc1.weight", 0,
         glu),
        ("mlp.shared_experts.dense_h_to_4h.bias", "mlp.shared_experts.linear_fc1.bias", 0, glu),
        ("mlp.shared_experts.dense_4h_to_h.weight", "mlp.shared_experts.linear_fc2.weight", 1),
        ("mlp.shared_experts.dense_4h_to_h.bias", "mlp.shared_experts.linear_fc2.bias", None),
        ("mlp.shared_experts.gate_weight", "mlp.shared_experts.gate_weight", None),
    ))


HEAD_RULES = (
    KeyRule(LANGUAGE_MODEL + "encoder.final_layernorm.weight", "decoder.final_layernorm.weight",
            None),
    KeyRule(LANGUAGE_MODEL + "encoder.final_layernorm.bias", "decoder.final_layernorm.bias",
            None),
    KeyRule(LANGUAGE_MODEL + "output_layer.weight", "output_layer.weight", 0),
    # The last stage's copy of the tied embedding: read from stage 0's, never written.
    KeyRule(HEAD_COPY_MODULE + ".weight", "embedding.word_embeddings.weight", 0),
)
HEAD_COPY_KEY = HEAD_COPY_MODULE + ".weight"


def gpt_rules(swiglu: bool) -> tuple[KeyRule, ...]:
    """The GPT family's table (dense MLP and, when present, MoE rows)."""
    return EMBEDDING_RULES + ATTENTION_RULES + dense_mlp_rules(swiglu) + moe_rules(swiglu) + \
        HEAD_RULES


BERT_HEAD_RULES = (
    KeyRule(LANGUAGE_MODEL + "encoder.final_layernorm.weight", "encoder.final_layernorm.weight",
            None),
    KeyRule(LANGUAGE_MODEL + "encoder.final_layernorm.bias", "encoder.final_layernorm.bias",
            None),
    KeyRule(LANGUAGE_MODEL + "pooler.dense.weight", "pooler.dense.weight", None),
    KeyRule(LANGUAGE_MODEL + "pooler.dense.bias", "pooler.dense.bias", None),
    KeyRule("lm_head.bias", "output_layer.bias", 0),
    KeyRule("lm_head.dense.weight", "lm_head.dense.weight", None),
    KeyRule("lm_head.dense.bias", "lm_head.dense.bias", None),
    KeyRule("lm_head.layernorm.weight", "lm_head.layer_norm.weight", None),
    KeyRule("lm_head.layernorm.bias", "lm_head.layer_norm.bias", None),
    KeyRule("binary_head.weight", "binary_head.weight", None),
    KeyRule("binary_head.bias", "binary_head.bias", None),
    KeyRule(HEAD_COPY_MODULE + ".weight", "embedding.word_embeddings.weight", 0),
)
DECODER, ENCODER = "decoder", "encoder"
"""Megatron-Core's name of the layer stack: GPTModel's ``decoder``, BertModel's ``encoder``."""


def bert_rules(swiglu: bool) -> tuple[KeyRule, ...]:
    """BERT's table: GPT's embedding and dense layer rows with the layers under ``encoder.``,
    and BERT's heads (in the model's parameter order, which the converter writes)."""
    def in_encoder(rules: Iterable[KeyRule]) -> tuple[KeyRule, ...]:
        return tuple(replace(r, mcore=ENCODER + r.mcore[len(DECODER):]) for r in rules)
    return EMBEDDING_RULES + in_encoder(ATTENTION_RULES + dense_mlp_rules(swiglu)) + \
        BERT_HEAD_RULES


@dataclass(frozen=True)
class Placement:
    """Where one model chunk's tensors sit in the global ones."""

    num_layers: int
    """All the model's layers (the stacked dimension)."""
    layer_offset: int = 0
    """Global index of the chunk's first layer."""
    tp_rank: int = 0
    tp_size: int = 1
    num_experts: int = 0
    expert_offset: int = 0
    """Global index of this rank's first local expert."""
    local_experts: int | None = None
    """The experts this rank holds (None: all of them)."""
    expert_tp_rank: int | None = None
    expert_tp_size: int | None = None
    """Where the routed experts' weights are split (ETP); None: as the dense layers (TP)."""

    def split(self, expert: bool) -> tuple[int, int]:
        """(rank, size) of the tensor-parallel split of an expert's or another tensor."""
        if expert and self.expert_tp_size is not None:
            return self.expert_tp_rank or 0, self.expert_tp_size
        return self.tp_rank, self.tp_size


@dataclass
class Chunk:
    """A local piece of a global tensor: ``data`` (with the stacked dimensions as leading size-1
    dims) at ``offset`` in a tensor of ``global_shape``."""

    data: torch.Tensor
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]


def match(rules: Iterable[KeyRule], key: str) -> tuple[KeyRule, re.Match] | None:
    for rule in rules:
        found = rule.regex.fullmatch(key)
        if found is not None:
            return rule, found
    return None


def tensor_chunks(rule: KeyRule, found: re.Match, tensor: torch.Tensor,
                  where: Placement) -> list[Chunk]:
    """The chunks of ``tensor`` (our local parameter, a view of which each chunk's data is)."""
    shape, offset = list(tensor.shape), [0] * tensor.dim()
    pieces = [(tensor, offset)]
    if rule.tp_dim is not None:
        tp_rank, tp_size = where.split("expert" in found.groupdict())
        dim, local = rule.tp_dim, tensor.shape[rule.tp_dim]
        shape[dim] = local * tp_size
        if rule.glu:
            # [gate_r; up_r] -> gate_r at r*half, up_r at F + r*half (F = half * tp).
            half = local // 2
            gate, up = tensor.narrow(dim, 0, half), tensor.narrow(dim, half, half)
            gate_at, up_at = list(offset), list(offset)
            gate_at[dim] = tp_rank * half
            up_at[dim] = half * tp_size + tp_rank * half
            pieces = [(gate, gate_at), (up, up_at)]
        else:
            at = list(offset)
            at[dim] = tp_rank * local
            pieces = [(tensor, at)]
    lead_shape: list[int] = []
    lead_offset: list[int] = []
    if "layer" in found.groupdict():
        lead_shape.append(where.num_layers)
        lead_offset.append(where.layer_offset + int(found["layer"]))
    if "expert" in found.groupdict():
        lead_shape.append(where.num_experts)
        lead_offset.append(where.expert_offset + int(found["expert"]))
    out = []
    for data, at in pieces:
        data = data.reshape((1,) * len(lead_shape) + tuple(data.shape)) if lead_shape else data
        out.append(Chunk(data, tuple(lead_offset + list(at)), tuple(lead_shape + shape)))
    return out


def model_chunks(state: Mapping[str, torch.Tensor], rules: Iterable[KeyRule],
                 where: Placement) -> dict[str, list[Chunk]]:
    """Every tensor of one model chunk's flat ``state_dict()`` -> ``{mcore key: chunks}``.

    Raises:
        CheckpointError: a tensor the table does not describe.
    """
    rules = tuple(rules)
    out: dict[str, list[Chunk]] = {}
    unknown = []
    for key, tensor in state.items():
        found = match(rules, key)
        if found is None:
            unknown.append(key)
            continue
        rule, m = found
        out.setdefault(rule.mcore, []).extend(tensor_chunks(rule, m, tensor, where))
    if unknown:
        raise CheckpointError("the torch_dist key table has no Megatron-Core name for "
                              + ", ".join(unknown))
    return out


def extra_state_keys(where: Placement, local_layers: int,
                     names: Iterable[str] = (), stack: str = DECODER) -> list[str]:
    """The ``_extra_state`` objects of this chunk's layers, as Megatron-Core names their
    ``ShardedObject`` shards (``<linear>._extra_state/shard_<layer>_<num_layers>``; an
    expert's ``shard_<layer>.<expert>_<num_layers>.<num_experts>``). ``names``: the chunk's
    own state-dict names, which tell MoE layers (a router, shared experts) from dense ones;
    ``stack``: the layer stack's name (BERT's ``encoder``)."""
    out = _extra_state_keys(where, local_layers, set(names))
    return out if stack == DECODER else [stack + k[len(DECODER):] for k in out]


BERT_OUTPUT_EXTRA_STATE = "output_layer._extra_state/shard_0_1"
"""BertModel's output layer saves its ``_extra_state`` object even when tied to the embedding
(GPTModel drops it); Megatron-Core's load of a BERT asks for it."""


def _extra_state_keys(where: Placement, local_layers: int, names: set[str]) -> list[str]:
    out = []
    for i in range(local_layers):
        layer, prefix = where.layer_offset + i, LAYER.format(layer=i)
        at = f"shard_{layer}_{where.num_layers}"
        out += [f"decoder.layers.{linear}._extra_state/{at}" for linear in ATTENTION_LINEARS]
        if prefix + "mlp.router.weight" not in names:
            out += [f"decoder.layers.{linear}._extra_state/{at}" for linear in DENSE_LINEARS]
            continue
        local = where.num_experts if where.local_experts is None else where.local_experts
        out += [f"decoder.layers.{linear}._extra_state/shard_{layer}.{e}_{where.num_layers}."
                f"{where.num_experts}"
                for e in range(where.expert_offset, where.expert_offset + local)
                for linear in EXPERT_LINEARS]
        if prefix + "mlp.shared_experts.dense_h_to_4h.weight" in names:
            out += [f"decoder.layers.{linear}._extra_state/{at}" for linear in SHARED_LINEARS]
    return out
