"""Megatron BERT <-> HuggingFace ``MegatronBertForPreTraining`` / ``BertForPreTraining``, both
directions; which one follows from the checkpoint's ``args`` (:func:`architecture_for`).

Megatron's default BERT layer is the "rearranged" pre-LN one (LayerNorm before attention and
before the MLP, a final LayerNorm, no embedding LayerNorm): transformers' ``MegatronBert*``
classes hold exactly that arrangement. Names:

==============================================  ==============================================
ours                                            MegatronBertForPreTraining
==============================================  ==============================================
language_model.embedding.word_embeddings        bert.embeddings.word_embeddings (+ tied decoder)
  / position_embeddings / tokentype_embeddings    / position_embeddings / token_type_embeddings
layers.N.input_layernorm                         bert.encoder.layer.N.attention.ln
layers.N.self_attention.query_key_value         attention.self.{query,key,value} (rows split)
layers.N.self_attention.dense                   attention.output.dense
layers.N.post_attention_layernorm               bert.encoder.layer.N.ln
layers.N.mlp.dense_h_to_4h / dense_4h_to_h      intermediate.dense / output.dense
encoder.final_layernorm                         bert.encoder.ln
language_model.pooler.dense                     bert.pooler.dense
lm_head.dense / lm_head.layernorm / lm_head.bias  cls.predictions.transform.dense / .LayerNorm /
                                                  cls.predictions.bias (= decoder.bias)
binary_head                                     cls.seq_relationship
==============================================  ==============================================

With ``--apply-residual-connection-post-layernorm`` (the original BERT) a Megatron layer computes
``h = LN_in(x); g = LN_post(h + attn(h)); out = g + mlp(g)`` and the encoder ends with
``LN_final``; HF's ``BertForPreTraining`` computes ``x0 = LN_emb(e)``, per layer
``a = LN1(x + attn(x)); x' = LN2(a + mlp(a))``. Composed they are the same function with the
LayerNorms shifted by one: ``bert.embeddings.LayerNorm`` is layer 0's ``input_layernorm``, layer
N's ``attention.output.LayerNorm`` its ``post_attention_layernorm``, and layer N's
``output.LayerNorm`` is layer N+1's ``input_layernorm`` (the last layer's: ``final_layernorm``).
The other names are MegatronBert's (``attention.self.*``, ``attention.output.dense``,
``intermediate.dense``, ``output.dense``, the pooler and ``cls.*``).

transformers uses one ``hidden_act`` for the MLP and the LM head's transform; Megatron's MLP
uses the tanh GeLU when the bias-GeLU fusion is on (the default) while its LM head uses the
exact one: such a model is refused (export a model trained with ``--no-bias-gelu-fusion``, both
exact: ``gelu``, or ``--openai-gelu``, both tanh: ``gelu_new``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megatron.checkpointing import CheckpointError
from tools.checkpoint.hf_files import optional_module, read_config
from tools.checkpoint.hf_mapping import (fuse_grouped_qkv, gelu_is_tanh,
                                         split_grouped_qkv)
from tools.checkpoint.model_description import (LM_HEAD_BIAS, WORD_EMBEDDINGS,
                                                ModelDescription)

_EMB = "language_model.embedding."
_OURS_LAYER = "language_model.encoder.layers.{}."
_HF_LAYER = "bert.encoder.layer.{}."
EMBEDDINGS = ((_EMB + "word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
              (_EMB + "position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
              (_EMB + "tokentype_embeddings.weight",
               "bert.embeddings.token_type_embeddings.weight"))
LAYER = (("input_layernorm.weight", "attention.ln.weight"),
         ("input_layernorm.bias", "attention.ln.bias"),
         ("self_attention.dense.weight", "attention.output.dense.weight"),
         ("self_attention.dense.bias", "attention.output.dense.bias"),
         ("post_attention_layernorm.weight", "ln.weight"),
         ("post_attention_layernorm.bias", "ln.bias"),
         ("mlp.dense_h_to_4h.weight", "intermediate.dense.weight"),
         ("mlp.dense_h_to_4h.bias", "intermediate.dense.bias"),
         ("mlp.dense_4h_to_h.weight", "output.dense.weight"),
         ("mlp.dense_4h_to_h.bias", "output.dense.bias"))
LAYER_ORDER = ("input_layernorm.weight", "input_layernorm.bias",
               "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
               "self_attention.dense.weight", "self_attention.dense.bias",
               "post_attention_layernorm.weight", "post_attention_layernorm.bias",
               "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
               "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias")
HEAD = (("language_model.encoder.final_layernorm.weight", "bert.encoder.ln.weight"),
        ("language_model.encoder.final_layernorm.bias", "bert.encoder.ln.bias"),
        ("language_model.pooler.dense.weight", "bert.pooler.dense.weight"),
        ("language_model.pooler.dense.bias", "bert.pooler.dense.bias"),
        (LM_HEAD_BIAS, "cls.predictions.bias"),
        ("lm_head.dense.weight", "cls.predictions.transform.dense.weight"),
        ("lm_head.dense.bias", "cls.predictions.transform.dense.bias"),
        ("lm_head.layernorm.weight", "cls.predictions.transform.LayerNorm.weight"),
        ("lm_head.layernorm.bias", "cls.predictions.transform.LayerNorm.bias"),
        ("binary_head.weight", "cls.seq_relationship.weight"),
        ("binary_head.bias", "cls.seq_relationship.bias"))
_QKV = ("self_attention.query_key_value", ("query", "key", "value"))

PRE_LN, POST_LN = "MegatronBertForPreTraining", "BertForPreTraining"
ARCHITECTURES = (PRE_LN, POST_LN)
POST_LN_FLAG = "--apply-residual-connection-post-layernorm"
# Post-LN BertForPreTraining: the layer's own tensors (its LayerNorms are placed by _post_ln_*).
POST_LN_LAYER = (("self_attention.dense.weight", "attention.output.dense.weight"),
                 ("self_attention.dense.bias", "attention.output.dense.bias"),
                 ("post_attention_layernorm.weight", "attention.output.LayerNorm.weight"),
                 ("post_attention_layernorm.bias", "attention.output.LayerNorm.bias"),
                 ("mlp.dense_h_to_4h.weight", "intermediate.dense.weight"),
                 ("mlp.dense_h_to_4h.bias", "intermediate.dense.bias"),
                 ("mlp.dense_4h_to_h.weight", "output.dense.weight"),
                 ("mlp.dense_4h_to_h.bias", "output.dense.bias"))
_EMBEDDING_LN = "bert.embeddings.LayerNorm."
_FINAL_LN = "language_model.encoder.final_layernorm."


def architecture_for(args: argparse.Namespace, requested: str | None = None) -> str:
    """The HF class of a BERT with these args: post-LN (``--apply-residual-connection-post-
    layernorm``) -> ``BertForPreTraining``, else ``MegatronBertForPreTraining``.

    Raises:
        ValueError: ``requested`` is the other one (naming the flag that decides).
    """
    post_ln = bool(getattr(args, "apply_residual_connection_post_layernorm", False))
    natural = POST_LN if post_ln else PRE_LN
    if requested not in (None, natural):
        trained = f"with {POST_LN_FLAG} (the original post-LN BERT)" if post_ln else \
            f"without {POST_LN_FLAG} (Megatron's pre-LN arrangement)"
        raise ValueError(f"--hf-architecture {requested}: this BERT was trained {trained}, which "
                         f"only {natural} holds; leave --hf-architecture out (it follows the "
                         "checkpoint)")
    return natural


def hidden_act(args: argparse.Namespace) -> str:
    """transformers' one ``hidden_act`` for Megatron's MLP GeLU and LM-head GeLU.

    Raises:
        ValueError: the two differ (the default bias-GeLU fusion).
    """
    head_tanh = bool(getattr(args, "openai_gelu", False))
    if gelu_is_tanh(args) != head_tanh:
        raise ValueError("this BERT's MLP uses the tanh GeLU (the default --bias-gelu-fusion) and "
                         "its LM head the exact one: MegatronBertForPreTraining has one "
                         "hidden_act for both. Export a model trained with "
                         "--no-bias-gelu-fusion or --openai-gelu")
    return "gelu_new" if head_tanh else "gelu"


def check_bert_compatible(args: argparse.Namespace, architecture: str = PRE_LN) -> None:
    problems = [flag for flag, bad in (
        (POST_LN_FLAG, architecture == PRE_LN and
         getattr(args, "apply_residual_connection_post_layernorm", False)),
        ("--disable-bias-linear", not getattr(args, "add_bias_linear", True)),
        ("--bert-no-binary-head", not getattr(args, "bert_binary_head", True)),
        ("--untie-embeddings-and-output-weights",
         getattr(args, "untie_embeddings_and_output_weights", False)),
        ("--apply-layernorm-1p", getattr(args, "apply_layernorm_1p", False))) if bad]
    if problems:
        raise ValueError(f"{architecture} cannot hold a BERT trained with "
                         + ", ".join(problems))


def _qkv_tensors(layer: dict, prefix: str, hf: str, heads: int):
    for suffix in ("weight", "bias"):
        parts = split_grouped_qkv(layer[f"{prefix}{_QKV[0]}.{suffix}"], heads, heads)
        for name, part in zip(_QKV[1], parts):
            yield f"{hf}attention.self.{name}.{suffix}", part


def _ln(source: dict, prefix: str, hf: str):
    """A LayerNorm's weight and bias under HF's ``hf`` prefix."""
    yield hf + "weight", source[prefix + "weight"]
    yield hf + "bias", source[prefix + "bias"]


def bert_tensors(md: ModelDescription, vocab: int, architecture: str = PRE_LN):
    """(HF name, tensor) of ``md`` in model order (post-LN: a layer and the next one's input
    LayerNorm held at a time)."""
    heads = int(md.args.num_attention_heads)
    embeddings = md.embeddings()
    for ours, theirs in EMBEDDINGS:
        value = embeddings[ours]
        yield theirs, value[:vocab] if ours == WORD_EMBEDDINGS else value
    del embeddings
    post_ln = architecture == POST_LN
    layer = md.layer(0)
    if post_ln:
        yield from _ln(layer, _OURS_LAYER.format(0) + "input_layernorm.", _EMBEDDING_LN)
    head = None
    for i in range(md.num_layers):
        prefix, hf = _OURS_LAYER.format(i), _HF_LAYER.format(i)
        for ours, theirs in POST_LN_LAYER if post_ln else LAYER:
            yield hf + theirs, layer[prefix + ours]
        yield from _qkv_tensors(layer, prefix, hf, heads)
        if i + 1 < md.num_layers:
            layer = md.layer(i + 1)
            if post_ln:  # layer i's output LayerNorm is layer i+1's input one
                yield from _ln(layer, _OURS_LAYER.format(i + 1) + "input_layernorm.",
                               hf + "output.LayerNorm.")
        else:
            del layer
            head = md.head()
            if post_ln:
                yield from _ln(head, _FINAL_LN, hf + "output.LayerNorm.")
    for ours, theirs in HEAD:
        if post_ln and ours.startswith(_FINAL_LN):
            continue  # written as the last layer's output LayerNorm
        yield theirs, head[ours][:vocab] if ours == LM_HEAD_BIAS else head[ours]


def bert_config(md: ModelDescription, vocab: int, architecture: str = PRE_LN):
    """The HF config of ``architecture`` for ``md``.

    Raises:
        ValueError: a BERT that class cannot hold (naming the flag).
    """
    transformers = optional_module("transformers", "--saver hf")
    args = md.args
    check_bert_compatible(args, architecture)
    config_class = transformers.BertConfig if architecture == POST_LN else \
        transformers.MegatronBertConfig
    return config_class(
        vocab_size=vocab, hidden_size=int(args.hidden_size), num_hidden_layers=md.num_layers,
        num_attention_heads=int(args.num_attention_heads),
        intermediate_size=int(args.ffn_hidden_size), hidden_act=hidden_act(args),
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=int(args.max_position_embeddings), type_vocab_size=2,
        layer_norm_eps=float(getattr(args, "layernorm_epsilon", 1e-5)),
        tie_word_embeddings=True, architectures=[architecture])


MODEL_TYPES = {"megatron-bert": PRE_LN, "bert": POST_LN}


class HuggingFaceMegatronBert(ModelDescription):
    """A local ``MegatronBertForPreTraining`` (model_type ``megatron-bert``) or post-LN
    ``BertForPreTraining`` (model_type ``bert``) directory, read lazily."""

    def __init__(self, directory: str | Path, tensors) -> None:
        config = read_config(Path(directory) / "config.json")
        if config.get("model_type") not in MODEL_TYPES:
            raise CheckpointError(f"model_type {config.get('model_type')!r}: --loader hf reads "
                                  "BERT as MegatronBertForPreTraining (model_type megatron-bert) "
                                  "or BertForPreTraining (model_type bert)")
        self.architecture = MODEL_TYPES[config["model_type"]]
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise CheckpointError(f"position_embedding_type {config['position_embedding_type']!r}"
                                  ": Megatron's BERT has learned absolute positions only")
        act = config.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new"):
            raise CheckpointError(f"hidden_act {act!r} has no Megatron GeLU form")
        vocab = int(config["vocab_size"])
        args = argparse.Namespace(
            num_layers=int(config["num_hidden_layers"]), hidden_size=int(config["hidden_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            ffn_hidden_size=int(config["intermediate_size"]),
            kv_channels=int(config["hidden_size"]) // int(config["num_attention_heads"]),
            max_position_embeddings=int(config["max_position_embeddings"]),
            seq_length=int(config["max_position_embeddings"]),
            layernorm_epsilon=float(config.get("layer_norm_eps", 1e-12)),
            openai_gelu=act == "gelu_new", bias_gelu_fusion=False, add_bias_linear=True,
            bert_binary_head=True, untie_embeddings_and_output_weights=False,
            apply_residual_connection_post_layernorm=self.architecture == POST_LN,
            make_vocab_size_divisible_by=128,
            padded_vocab_size=vocab, tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=None,
            tokenizer_type="BertWordPieceLowerCase", vocab_file=None, iteration=0,
            consumed_train_samples=0, consumed_valid_samples=0)
        if (Path(directory) / "vocab.txt").is_file():
            args.vocab_file = str((Path(directory) / "vocab.txt").resolve())
        super().__init__(family="BERT", args=args, true_vocab_size=vocab, repad=True)
        self.tensors = tensors

    def embeddings(self) -> dict[str, torch.Tensor]:
        return {ours: self.tensors.get(theirs) for ours, theirs in EMBEDDINGS}

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        heads = int(self.args.num_attention_heads)
        prefix, hf = _OURS_LAYER.format(index), _HF_LAYER.format(index)
        if self.architecture == POST_LN:
            out = {prefix + ours: self.tensors.get(hf + theirs) for ours, theirs in POST_LN_LAYER}
            source = _EMBEDDING_LN if index == 0 else \
                _HF_LAYER.format(index - 1) + "output.LayerNorm."
            for suffix in ("weight", "bias"):
                out[f"{prefix}input_layernorm.{suffix}"] = self.tensors.get(source + suffix)
        else:
            out = {prefix + ours: self.tensors.get(hf + theirs) for ours, theirs in LAYER}
        for suffix in ("weight", "bias"):
            out[f"{prefix}{_QKV[0]}.{suffix}"] = fuse_grouped_qkv(
                *(self.tensors.get(f"{hf}attention.self.{n}.{suffix}") for n in _QKV[1]), heads)
        return {prefix + name: out[prefix + name] for name in LAYER_ORDER}

    def head(self) -> dict[str, torch.Tensor]:
        out = {}
        for ours, theirs in HEAD:
            if self.architecture == POST_LN and ours.startswith(_FINAL_LN):
                theirs = _HF_LAYER.format(self.num_layers - 1) + "output.LayerNorm." + \
                    ours[len(_FINAL_LN):]
            out[ours] = self.tensors.get(theirs)
        return out
