"""A static description of how every tensor of a Megatron-LM checkpoint is split over tensor-
and pipeline-parallel ranks, usable from a plain script (no process group, no config).

A model family's :class:`CheckpointLayout` is a table of key patterns (dotted model-dict keys,
``checkpoint_keys.flatten_model_state``) -> :class:`TensorRule`: the dimension split over TP
ranks (or none: every TP rank holds the whole tensor) and the pipeline stage that holds the
tensor (the first, the last, or the one holding its layer). Megatron's legacy language models
(GPT, and BERT's shared part):

=========================================================  =======  =============================
key                                                        TP dim   stage
=========================================================  =======  =============================
language_model.embedding.word_embeddings.weight            0 vocab  first
language_model.embedding.{position,tokentype}_embeddings   -        first
layers.N.{input,post_attention}_layernorm.*                -        layer N's
layers.N.self_attention.query_key_value.* (column-par.)    0        layer N's
layers.N.self_attention.{q,k}_layernorm.* (per head, hn)  -        layer N's
layers.N.self_attention.dense.weight (row-parallel)        1        layer N's
layers.N.self_attention.dense.bias (after the reduce)      -        layer N's
layers.N.mlp.dense_h_to_4h.* (column-parallel)             0        layer N's
layers.N.mlp.dense_4h_to_h.weight / .bias                  1 / -    layer N's
language_model.encoder.final_layernorm.*                   -        last
language_model.output_layer.weight (untied)                0 vocab  last
word_embeddings_for_head.weight (tied, PP > 1)             0 vocab  last: copy of the embedding
BERT: language_model.pooler.dense.*                         -        last
BERT: lm_head.bias (the logits' own bias)                   0 vocab  last
BERT: lm_head.{dense,layernorm}.*, binary_head.*            -        last
=========================================================  =======  =============================

(``layers.N`` is ``language_model.encoder.layers.N``; older checkpoints say ``transformer`` and
``.attention.``, which match too.) A TP split is contiguous and even: rank ``r`` holds slice
``r`` of ``tp`` (QKV rows must be in the current ``[np, 3, hn]`` order, ``versions.py``, so that
each rank holds whole heads). A converter changing TP/PP is a loop over this table::

    full = layout.merge_pipeline([layout.merge_tensor_parallel(tp_shards) for each chunk], old)
    for chunk, state in zip(new.chunks(), layout.split_pipeline(full, new)):
        for tp_rank, shard in enumerate(layout.split_tensor_parallel(state, tp)): ...

Other families extend the table: :data:`BERT_LAYOUT` is
``GPT_LAYOUT.extended("BERT", (TensorRule(...), ...))`` with ``pooler``, ``lm_head``,
``binary_head``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.stages import PipelineStages, StageChunk
from megatron.core.checkpoint_keys import HEAD_COPY_WEIGHT, LANGUAGE_MODEL_NESTED_SECTIONS

Stage = Literal["first", "last", "layers"]


def _compile(pattern: str) -> re.Pattern:
    """``a.{x,y}.layers.{layer}.w`` -> a regex: ``{layer}`` is a layer number, ``{expert}`` a
    local expert's index, ``{x,y}`` one of the alternatives, everything else literal."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(re.escape(part))
        elif part == "layer":
            out.append(r"(?P<layer>\d+)")
        elif part == "expert":
            out.append(r"\d+")
        else:
            out.append("(?:" + "|".join(re.escape(p) for p in part.split(",")) + ")")
    return re.compile("".join(out))


@dataclass(frozen=True)
class TensorRule:
    """How the tensors whose key matches ``pattern`` are laid out over the parallel ranks."""

    pattern: str
    """Dotted key, with ``{layer}`` for a layer number and ``{a,b}`` for alternatives."""
    tp_dim: int | None
    """Dimension split evenly over TP ranks; None: every TP rank holds the whole tensor."""
    stage: Stage
    """The pipeline stage holding it: ``first`` (embedding), ``last`` (head), or ``layers``
    (the stage holding layer ``{layer}``, which numbers it locally)."""
    what: str = ""
    padded_vocab: bool = False
    """``tp_dim`` is the padded vocabulary (``padded_vocab_size`` = the vocabulary rounded up
    to ``make_vocab_size_divisible_by`` x TP): changing TP may change its padding."""
    copy_of: str | None = None
    """Key of the tensor this one duplicates on the last stage (``word_embeddings_for_head``);
    present only when the first and last stages differ, dropped when merging stages."""
    copy_unless: str | None = None
    """No copy when the model has this key (the untied ``output_layer``)."""
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regex = _compile(self.pattern)
        if (self.stage == "layers") != ("layer" in regex.groupindex):
            raise ValueError(f"rule {self.pattern!r}: stage 'layers' and a {{layer}} in the "
                             "pattern go together")
        if self.copy_of is not None and (self.stage != "last" or regex.groupindex
                                         or "{" in self.pattern):
            raise ValueError(f"rule {self.pattern!r}: a copy is one literal key on the last "
                             "stage")
        object.__setattr__(self, "regex", regex)


@dataclass(frozen=True)
class CheckpointLayout:
    """The layout of one model family's checkpoints: rules tried in order, first match wins."""

    family: str
    rules: tuple[TensorRule, ...]
    nested_sections: tuple[str, ...] = LANGUAGE_MODEL_NESTED_SECTIONS
    """Model-dict sections holding sections (``checkpoint_keys.nest_model_state``)."""

    def extended(self, family: str, rules: Iterable[TensorRule]) -> CheckpointLayout:
        """Another family's layout: this table plus ``rules`` (tried after these)."""
        return CheckpointLayout(family, self.rules + tuple(rules), self.nested_sections)

    # Keys ----------------------------------------------------------------------------------
    def match(self, key: str) -> tuple[TensorRule, re.Match] | None:
        """The first rule matching ``key`` and its match (``match["layer"]``); None if none."""
        for rule in self.rules:
            found = rule.regex.fullmatch(key)
            if found is not None:
                return rule, found
        return None

    def rule(self, key: str) -> TensorRule:
        """The rule of ``key``.

        Raises:
            CheckpointError: no rule matches.
        """
        return self._matched(key)[0]

    def unknown_keys(self, keys: Iterable[str]) -> list[str]:
        return [k for k in keys if self.match(k) is None]

    def check_keys(self, keys: Iterable[str], source: str = "the checkpoint") -> None:
        """Raises CheckpointError naming every key of ``keys`` without a rule."""
        unknown = self.unknown_keys(keys)
        if unknown:
            raise CheckpointError(f"{source} holds tensors the {self.family} checkpoint layout "
                                  f"does not describe: {', '.join(unknown)}")

    def _matched(self, key: str) -> tuple[TensorRule, re.Match]:
        found = self.match(key)
        if found is None:
            raise CheckpointError(f"the checkpoint holds {key}, a tensor the {self.family} "
                                  "checkpoint layout does not describe")
        return found

    # Tensor parallelism --------------------------------------------------------------------
    def merge_tensor_parallel(self, shards: Sequence[Mapping[str, torch.Tensor]]
                              ) -> dict[str, torch.Tensor]:
        """The flat states of one model chunk on TP ranks 0, 1, ... -> the unsplit state
        (split tensors concatenated on their dim; others taken from rank 0).

        Raises:
            CheckpointError: the shards differ in their keys, a key has no rule, or replicated
                tensors differ in shape.
        """
        keys = list(shards[0])
        for rank, shard in enumerate(shards[1:], start=1):
            if set(shard) != set(keys):
                raise CheckpointError(f"TP rank {rank} holds other tensors than TP rank 0: "
                                      f"{sorted(set(shard) ^ set(keys))}")
        out = {}
        for key in keys:
            rule, parts = self.rule(key), [shard[key] for shard in shards]
            if rule.tp_dim is not None:
                # One shard is already whole: no copy (a converter streaming mapped files).
                out[key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=rule.tp_dim)
            elif any(p.shape != parts[0].shape for p in parts):
                raise CheckpointError(f"{key} is whole on every TP rank, but the ranks hold "
                                      f"shapes {[tuple(p.shape) for p in parts]}")
            else:
                out[key] = parts[0]
        return out

    def split_tensor_parallel(self, state: Mapping[str, torch.Tensor], tp_size: int
                              ) -> list[dict[str, torch.Tensor]]:
        """An unsplit flat state -> one per TP rank (slices are copies: saving one does not
        save the whole tensor's storage).

        Raises:
            CheckpointError: a key has no rule, or a split dim is not a multiple of ``tp_size``.
        """
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
        for key, value in state.items():
            dim = self.rule(key).tp_dim
            if dim is None or tp_size == 1:  # whole on every rank (one rank: no copy either)
                for shard in out:
                    shard[key] = value
                continue
            size = value.shape[dim]
            if size % tp_size:
                raise CheckpointError(f"{key}: dim {dim} ({size}) does not split evenly over "
                                      f"{tp_size} TP ranks")
            for shard, piece in zip(out, value.split(size // tp_size, dim=dim)):
                shard[key] = piece.clone()
        return out

    # Pipeline parallelism ------------------------------------------------------------------
    def merge_pipeline(self, chunks: Sequence[Mapping[str, torch.Tensor]],
                       stages: PipelineStages) -> dict[str, torch.Tensor]:
        """The flat states of every model chunk, in ``stages.chunks()`` order -> one state with
        global layer numbers, in model order, without the last stage's tied copies.

        Raises:
            CheckpointError: a key has no rule, sits on a stage that should not hold it, or
                appears twice; the number of chunks does not match ``stages``.
        """
        plan = stages.chunks()
        if len(chunks) != len(plan):
            raise CheckpointError(f"{len(chunks)} model chunks for a pipeline of {len(plan)} "
                                  f"(pipeline_size {stages.pipeline_size}, virtual_size "
                                  f"{stages.virtual_size})")
        out: dict[str, torch.Tensor] = {}
        # By first layer: the embedding comes first and the head last, as in one stage's dict.
        for i in sorted(range(len(plan)), key=lambda i: plan[i].first_layer):
            for key, value in chunks[i].items():
                rule, match = self._matched(key)
                if rule.copy_of is not None:
                    continue
                name = self._global_key(key, rule, match, plan[i])
                if name in out:
                    raise CheckpointError(f"{name} is held by two pipeline stages")
                out[name] = value
        return out

    def split_pipeline(self, state: Mapping[str, torch.Tensor], stages: PipelineStages
                       ) -> list[dict[str, torch.Tensor]]:
        """An unsplit flat state (global layer numbers) -> one state per model chunk, in
        ``stages.chunks()`` order, layers numbered locally, the last stage's tied copies added.

        Raises:
            CheckpointError: a key has no rule, or names a layer the model does not have.
        """
        plan = stages.chunks()
        out: list[dict[str, torch.Tensor]] = [{} for _ in plan]
        first = next(i for i, c in enumerate(plan) if c.pre_process)
        last = next(i for i, c in enumerate(plan) if c.post_process)
        for key, value in state.items():
            rule, match = self._matched(key)
            if rule.copy_of is not None:
                continue  # derived below
            if rule.stage == "layers":
                layer = int(match["layer"])
                try:
                    index = stages.chunk_index_of_layer(layer)
                except ValueError as err:
                    raise CheckpointError(f"{key}: {err}") from None
                out[index][_renumbered(key, match, layer - plan[index].first_layer)] = value
            else:
                out[first if rule.stage == "first" else last][key] = value
        if first != last:
            for rule in self.rules:
                if rule.copy_of in state and rule.copy_unless not in state:
                    out[last][rule.pattern] = state[rule.copy_of]
        return out

    def _global_key(self, key: str, rule: TensorRule, match: re.Match,
                    chunk: StageChunk) -> str:
        where = f"pipeline stage {chunk.pipeline_rank}" + \
            (f" (model{chunk.virtual_rank})" if chunk.virtual_rank is not None else "")
        if rule.stage == "layers":
            local = int(match["layer"])
            if local >= chunk.num_layers:
                raise CheckpointError(f"{key} on {where}, which holds {chunk.num_layers} layers")
            return _renumbered(key, match, chunk.first_layer + local)
        if (rule.stage == "first" and not chunk.pre_process) or \
                (rule.stage == "last" and not chunk.post_process):
            raise CheckpointError(f"{key} on {where}: it belongs to the {rule.stage} stage")
        return key


def _renumbered(key: str, match: re.Match, layer: int) -> str:
    return f"{key[:match.start('layer')]}{layer}{key[match.end('layer'):]}"


_LAYER = "language_model.{encoder,transformer}.layers.{layer}."
_ATTENTION = _LAYER + "{self_attention,attention}."
_WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
_OUTPUT_LAYER = "language_model.output_layer.weight"

LANGUAGE_MODEL_RULES: tuple[TensorRule, ...] = (
    TensorRule(_WORD_EMBEDDINGS, 0, "first", "vocab-parallel embedding", padded_vocab=True),
    TensorRule("language_model.embedding.{position_embeddings,tokentype_embeddings}.weight",
               None, "first", "learned position / token-type embedding"),
    TensorRule(_LAYER + "{input_layernorm,post_attention_layernorm}.{weight,bias}", None,
               "layers", "layer norm"),
    TensorRule(_ATTENTION + "query_key_value.{weight,bias}", 0, "layers",
               "column-parallel: whole heads, rows [np, 3, hn]"),
    TensorRule(_ATTENTION + "{q_layernorm,k_layernorm}.{weight,bias}", None, "layers",
               "--qk-layernorm: one norm over hn shared by all heads (Megatron core's names)"),
    TensorRule(_ATTENTION + "dense.weight", 1, "layers", "row-parallel"),
    TensorRule(_ATTENTION + "dense.bias", None, "layers", "row-parallel bias (after the reduce)"),
    TensorRule(_LAYER + "mlp.dense_h_to_4h.{weight,bias}", 0, "layers", "column-parallel"),
    TensorRule(_LAYER + "mlp.dense_4h_to_h.weight", 1, "layers", "row-parallel"),
    TensorRule(_LAYER + "mlp.dense_4h_to_h.bias", None, "layers",
               "row-parallel bias (after the reduce)"),
    # Mixture of experts (Megatron-LM's legacy SwitchMLP names; the experts split over TP as
    # the dense MLP, the router and the shared experts' gate whole on every TP rank).
    TensorRule(_LAYER + "mlp.router.{weight,bias,expert_bias}", None, "layers",
               "MoE router (and its aux-loss-free balancing bias)"),
    TensorRule(_LAYER + "mlp.local_experts.{expert}.dense_h_to_4h.{weight,bias}", 0, "layers",
               "routed expert fc1 (column-parallel)"),
    TensorRule(_LAYER + "mlp.local_experts.{expert}.dense_4h_to_h.weight", 1, "layers",
               "routed expert fc2 (row-parallel)"),
    TensorRule(_LAYER + "mlp.local_experts.{expert}.dense_4h_to_h.bias", None, "layers",
               "routed expert fc2 bias (after the reduce)"),
    TensorRule(_LAYER + "mlp.shared_experts.dense_h_to_4h.{weight,bias}", 0, "layers",
               "shared experts fc1 (column-parallel)"),
    TensorRule(_LAYER + "mlp.shared_experts.dense_4h_to_h.weight", 1, "layers",
               "shared experts fc2 (row-parallel)"),
    TensorRule(_LAYER + "mlp.shared_experts.dense_4h_to_h.bias", None, "layers",
               "shared experts fc2 bias (after the reduce)"),
    TensorRule(_LAYER + "mlp.shared_experts.gate_weight", None, "layers",
               "shared experts' sigmoid gate"),
    TensorRule("language_model.{encoder,transformer}.final_layernorm.{weight,bias}", None,
               "last", "final layer norm"),
    TensorRule(_OUTPUT_LAYER, 0, "last", "untied output layer (column-parallel)",
               padded_vocab=True),
    TensorRule(HEAD_COPY_WEIGHT, 0, "last",
               "the last stage's copy of the tied word embedding", padded_vocab=True,
               copy_of=_WORD_EMBEDDINGS, copy_unless=_OUTPUT_LAYER),
)
"""Megatron-LM's legacy language model (embedding, encoder, output weight): GPT's whole table,
and the part BERT shares."""

GPT_LAYOUT = CheckpointLayout("GPT", LANGUAGE_MODEL_RULES)

BERT_LAYOUT = GPT_LAYOUT.extended("BERT", (
    TensorRule("language_model.pooler.dense.{weight,bias}", None, "last",
               "pooler (first position -> dense -> tanh)"),
    TensorRule("lm_head.bias", 0, "last", "LM head's own bias over the vocab-split logits",
               padded_vocab=True),
    TensorRule("lm_head.{dense,layernorm}.{weight,bias}", None, "last",
               "LM head transform (dense -> GeLU -> LayerNorm)"),
    TensorRule("binary_head.{weight,bias}", None, "last", "sentence-order head"),
    TensorRule("classification_head.{weight,bias}", None, "last",
               "finetuning: Classification head (tasks/glue)"),
    TensorRule("multichoice_head.{weight,bias}", None, "last",
               "finetuning: MultipleChoice head (tasks/race)"),
))
"""Megatron-LM's legacy BERT: the language model's table plus the pooler and the heads."""

LAYOUTS: dict[str, CheckpointLayout] = {"GPT": GPT_LAYOUT, "BERT": BERT_LAYOUT}
"""Layouts by model family (a converter's choice)."""
