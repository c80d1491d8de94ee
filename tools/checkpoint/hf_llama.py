"""Megatron Llama-style GPT <-> HuggingFace ``LlamaForCausalLM`` / ``MistralForCausalLM`` /
``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``, both directions (``--saver hf`` / ``--loader hf``).

==============================================  ==============================================
ours                                            LlamaForCausalLM
==============================================  ==============================================
language_model.embedding.word_embeddings        model.embed_tokens
layers.N.input_layernorm (RMSNorm)              model.layers.N.input_layernorm
layers.N.self_attention.query_key_value         self_attn.{q,k,v}_proj (rows regrouped)
layers.N.self_attention.{q,k}_layernorm         self_attn.{q,k}_norm (Qwen3, --qk-layernorm)
layers.N.self_attention.dense                   self_attn.o_proj
layers.N.post_attention_layernorm               model.layers.N.post_attention_layernorm
layers.N.mlp.dense_h_to_4h ([gate; up])         mlp.gate_proj, mlp.up_proj
layers.N.mlp.dense_4h_to_h                      mlp.down_proj
encoder.final_layernorm                         model.norm
language_model.output_layer (untied)            lm_head
==============================================  ==============================================

Rotary layout: HF Llama's ``rotate_half`` pairs dimension ``i`` of a head with ``i + hn/2``,
which is Megatron's default (non-interleaved) RoPE, so the q/k rows copy over unpermuted.
(transformers' ``convert_llama_weights_to_hf.py`` permutes q/k because Meta's original
checkpoints pair adjacent dimensions, ``(2i, 2i+1)``: Megatron's ``--rotary-interleaved``.) A
model trained with ``--rotary-interleaved`` is exported with that same permutation of each
head's q/k rows (dimension ``2i`` -> ``i``, ``2i+1`` -> ``i + hn/2``: q.k is unchanged by a
permutation applied to both) and imports back as a non-interleaved model.

QKV: our fused rows are Megatron's grouped layout ``[G, np/G + 2, hn]`` (a group's query heads,
then its key head, then its value head); HF keeps ``q_proj`` ``[np*hn, h]``, ``k_proj`` and
``v_proj`` ``[G*hn, h]``, query head ``i`` reading key/value head ``i // (np/G)`` in both.
Qwen2 is Llama with a bias on q/k/v only (``--add-qkv-bias --disable-bias-linear``). Qwen3 is
Llama with an RMSNorm over each q/k head before RoPE (``--qk-layernorm``), the same weight for
every head as ours; with ``--rotary-interleaved`` its weight takes the q/k rows' permutation.

Mistral is Llama's weights under Llama's names, with ``sliding_window`` W: each token attends to
the W latest tokens (itself included). Megatron has no such attention (Megatron-LM's
``loader_llama_mistral.py`` drops the window too): the import attends to the whole sequence,
which is the same computation for sequences of up to W tokens. So the import records the window
(``sliding_window`` in the checkpoint's args), sets ``seq_length`` to at most W (what
``--use-checkpoint-args`` trains at) and warns when the window is shorter than
``max_position_embeddings``; loading such a checkpoint for a run whose sequences can be longer
than W warns again (``megatron.training.checkpointing``). The export writes a checkpoint that
records a window back as ``MistralForCausalLM`` with it (``--hf-architecture LlamaForCausalLM``:
as Llama, the whole-sequence attention Megatron computes); ``--hf-architecture
MistralForCausalLM`` exports any other Llama-style model as Mistral without a window. (A run
that trains on from the import saves its own args, without the record.)
"""

from __future__ import annotations

import argparse

import torch

from megatron.checkpointing import CheckpointError
from megatron.core.log import warn_rank_0
from tools.checkpoint.hf_files import layers_beyond, optional_module
from tools.checkpoint.hf_mapping import fuse_grouped_qkv, split_grouped_qkv
from tools.checkpoint.model_description import OUTPUT_LAYER, WORD_EMBEDDINGS, ModelDescription

LAYER = "language_model.encoder.layers.{}."
HF_LAYER = "model.layers.{}."
FINAL_NORM = "language_model.encoder.final_layernorm.weight"
# (ours, HF): whole-tensor renames of one layer.
LAYER_TENSORS = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.dense.weight", "self_attn.o_proj.weight"),
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.dense_4h_to_h.weight", "mlp.down_proj.weight"),
)
LAYER_ORDER = ("input_layernorm.weight", "self_attention.query_key_value.weight",
               "self_attention.query_key_value.bias", "self_attention.q_layernorm.weight",
               "self_attention.k_layernorm.weight", "self_attention.dense.weight",
               "post_attention_layernorm.weight", "mlp.dense_h_to_4h.weight",
               "mlp.dense_4h_to_h.weight")
"""A layer's tensors in the order Megatron's modules hold them (the bias only with Qwen2's, the
q/k norms only with Qwen3's)."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""model_type -> class: the ones whose weights and forward are Llama's (Mistral's up to its
sliding window, Qwen2 with its q/k/v bias, Qwen3 with its q/k norms)."""


def is_llama_style(args: argparse.Namespace) -> bool:
    """A GPT checkpoint that exports as Llama rather than GPT-2: RoPE or RMSNorm or SwiGLU."""
    return (getattr(args, "position_embedding_type", "learned_absolute") == "rope"
            or getattr(args, "use_rotary_position_embeddings", False)
            or getattr(args, "normalization", "LayerNorm") == "RMSNorm"
            or bool(getattr(args, "swiglu", False)))


def check_llama_compatible(args: argparse.Namespace) -> None:
    """Refuse Megatron GPTs ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` cannot express.

    Raises:
        ValueError: naming the flags (what is missing, what is extra).
    """
    qk_norm = bool(getattr(args, "qk_layernorm", False))
    rope = (getattr(args, "position_embedding_type", "learned_absolute") == "rope"
            or getattr(args, "use_rotary_position_embeddings", False))
    problems = [flag for flag, bad in (
        ("no --position-embedding-type rope", not rope),
        ("no --normalization RMSNorm", getattr(args, "normalization", "LayerNorm") != "RMSNorm"),
        ("no --swiglu", not getattr(args, "swiglu", False)),
        ("no --disable-bias-linear", getattr(args, "add_bias_linear", True)),
        ("--rotary-percent < 1", float(getattr(args, "rotary_percent", 1.0)) != 1.0),
        ("--apply-layernorm-1p", getattr(args, "apply_layernorm_1p", False)),
        ("--apply-residual-connection-post-layernorm",
         getattr(args, "apply_residual_connection_post_layernorm", False)),
        ("--qk-layernorm with --add-qkv-bias (Qwen3's attention_bias covers o_proj too)",
         qk_norm and getattr(args, "add_qkv_bias", False)),
    ) if bad]
    if problems:
        raise ValueError("--saver hf: LlamaForCausalLM cannot hold this model ("
                         + ", ".join(problems) + "); keep it a Megatron checkpoint")


def query_groups(args: argparse.Namespace) -> int:
    if getattr(args, "group_query_attention", False) and getattr(args, "num_query_groups", None):
        return int(args.num_query_groups)
    return int(args.num_attention_heads)


def head_dim(args: argparse.Namespace) -> int:
    kv = getattr(args, "kv_channels", None)
    return int(kv) if kv else int(args.hidden_size) // int(args.num_attention_heads)


def halves_from_interleaved(t: torch.Tensor, hn: int) -> torch.Tensor:
    """Each head's rows (``hn`` of them) reordered from adjacent rotary pairs ``(2i, 2i+1)`` to
    halves ``(i, i + hn/2)``: transformers' ``permute`` of Meta's q/k weights."""
    heads = t.shape[0] // hn
    return t.reshape(heads, hn // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def split_qkv(t: torch.Tensor, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Our grouped ``[G*(np/G+2)*hn, ...]`` rows -> HF (q, k, v)."""
    q, k, v = split_grouped_qkv(t, int(args.num_attention_heads), query_groups(args))
    if getattr(args, "rotary_interleaved", False):
        hn = head_dim(args)
        q, k = halves_from_interleaved(q, hn), halves_from_interleaved(k, hn)
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             args: argparse.Namespace) -> torch.Tensor:
    """HF (q, k, v) -> our grouped rows (the inverse of :func:`split_qkv`, non-interleaved)."""
    return fuse_grouped_qkv(q, k, v, query_groups(args))


def llama_tensors(md: ModelDescription, vocab: int):
    """(HF name, tensor) of ``md``, a piece at a time."""
    args = md.args
    yield "model.embed_tokens.weight", md.embeddings()[WORD_EMBEDDINGS][:vocab]
    for i in range(md.num_layers):
        layer = md.layer(i)
        ours, theirs = LAYER.format(i), HF_LAYER.format(i)
        for name, hf_name in LAYER_TENSORS:
            yield theirs + hf_name, layer[ours + name]
        q, k, v = split_qkv(layer[ours + "self_attention.query_key_value.weight"], args)
        yield from ((theirs + f"self_attn.{n}_proj.weight", x) for n, x in zip("qkv", (q, k, v)))
        bias = layer.get(ours + "self_attention.query_key_value.bias")
        if bias is not None:
            q, k, v = split_qkv(bias, args)
            yield from ((theirs + f"self_attn.{n}_proj.bias", x) for n, x in zip("qkv", (q, k, v)))
        gate, up = torch.chunk(layer[ours + "mlp.dense_h_to_4h.weight"], 2, dim=0)
        yield from _qk_norms(layer, ours, theirs, args)
        yield theirs + "mlp.gate_proj.weight", gate
        yield theirs + "mlp.up_proj.weight", up
        del layer
    head = md.head()
    yield "model.norm.weight", head[FINAL_NORM]
    if md.untied:
        yield "lm_head.weight", head[OUTPUT_LAYER][:vocab]


def _qk_norms(layer: dict, ours: str, theirs: str, args: argparse.Namespace):
    """Qwen3's ``self_attn.{q,k}_norm`` of ``--qk-layernorm`` (none without it)."""
    for n in "qk":
        weight = layer.get(ours + f"self_attention.{n}_layernorm.weight")
        if weight is not None:
            if getattr(args, "rotary_interleaved", False):
                weight = halves_from_interleaved(weight, weight.shape[0])
            yield theirs + f"self_attn.{n}_norm.weight", weight


def hf_architecture(args: argparse.Namespace, requested: str | None = None) -> str:
    """The HF class a Llama-style GPT exports as: the one its flags need (Qwen3 for the q/k
    norms, Qwen2 for the q/k/v bias, Mistral for a recorded sliding window, else Llama), or
    ``requested`` (``--hf-architecture``) where that class holds the same model (Llama and
    Mistral for each other).

    Raises:
        ValueError: ``requested`` cannot hold this model.
    """
    if getattr(args, "qk_layernorm", False):
        needed = "Qwen3ForCausalLM"
    elif getattr(args, "add_qkv_bias", False):
        needed = "Qwen2ForCausalLM"
    elif getattr(args, "sliding_window", None):
        needed = "MistralForCausalLM"
    else:
        needed = "LlamaForCausalLM"
    if requested in (None, needed):
        return needed
    # Either holds our model exactly (Mistral without a window, or Llama: the whole-sequence
    # attention Megatron computed, also for a Mistral import).
    if {requested, needed} == {"LlamaForCausalLM", "MistralForCausalLM"}:
        return requested
    raise ValueError(f"--hf-architecture {requested}: this GPT exports as {needed}")


def llama_config(md: ModelDescription, vocab: int, architecture: str | None = None,
                 special: tuple[int | None, int | None] | None = None):
    """The ``LlamaConfig`` (``Qwen2Config`` with ``--add-qkv-bias``, ``Qwen3Config`` with
    ``--qk-layernorm``, ``MistralConfig`` with a recorded sliding window or when asked) of
    ``md``; ``special``: its (bos, eos) token ids (None: see :func:`special_token_ids`)."""
    check_llama_compatible(md.args)
    transformers = optional_module("transformers", "--saver hf")
    args = md.args
    architecture = hf_architecture(args, architecture)
    dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(
        getattr(args, "params_dtype", torch.float32), "float32")
    bos, eos = special if special is not None else special_token_ids(md, vocab)
    common = dict(
        vocab_size=vocab, hidden_size=int(args.hidden_size),
        intermediate_size=int(args.ffn_hidden_size), num_hidden_layers=md.num_layers,
        num_attention_heads=int(args.num_attention_heads),
        num_key_value_heads=query_groups(args),
        max_position_embeddings=int(args.max_position_embeddings),
        rms_norm_eps=float(getattr(args, "layernorm_epsilon", 1e-5)),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(getattr(args, "rotary_base", 10000))},
        tie_word_embeddings=not md.untied, hidden_act="silu", attention_dropout=0.0,
        bos_token_id=bos, eos_token_id=eos, torch_dtype=dtype)
    if architecture == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(architectures=[architecture], **common)
    if architecture == "Qwen3ForCausalLM":  # its head_dim defaults to 128: always written
        return transformers.Qwen3Config(architectures=[architecture], head_dim=head_dim(args),
                                        attention_bias=False, **common)
    if architecture == "MistralForCausalLM":  # no biases to switch off; head_dim always set
        window = getattr(args, "sliding_window", None)  # a Mistral import's, else none
        return transformers.MistralConfig(architectures=[architecture], head_dim=head_dim(args),
                                          sliding_window=int(window) if window else None,
                                          **common)
    if head_dim(args) * int(args.num_attention_heads) != int(args.hidden_size):
        common["head_dim"] = head_dim(args)
    return transformers.LlamaConfig(architectures=["LlamaForCausalLM"], attention_bias=False,
                                    mlp_bias=False, **common)


def special_token_ids(md: ModelDescription, vocab: int) -> tuple[int | None, int | None]:
    """(bos, eos) recorded by the import (the HF config's ``bos_token_id`` / ``eos_token_id``),
    else the last token of the true vocabulary for both (GPT-2's ``<|endoftext|>``)."""
    bos, eos = (getattr(md.args, name, None) for name in ("bos_token_id", "eos_token_id"))
    if bos is None and eos is None:
        eod = vocab - 1 if md.true_vocab_size is None else md.true_vocab_size - 1
        return eod, eod
    return bos, eos


def for_every_reader(config: dict, args: argparse.Namespace) -> dict:
    """A config.json written by transformers 5 with the keys transformers 4.x (and readers that
    parse the file themselves: vLLM, llama.cpp's converter) look for: the top-level
    ``rope_theta`` (else they silently use 10000), ``rope_scaling`` (None: Megatron's
    --rotary-base RoPE is unscaled) and ``torch_dtype``."""
    out = dict(config)
    rope = out.get("rope_parameters") or {}
    out["rope_theta"] = float(rope.get("rope_theta", getattr(args, "rotary_base", 10000)))
    out.setdefault("rope_scaling", None)
    if "torch_dtype" not in out and "dtype" in out:
        out["torch_dtype"] = out["dtype"]
    return out


def _rope_theta(config: dict) -> float:
    """``rope_theta`` of a config.json (transformers 5 nests it in ``rope_parameters``)."""
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise CheckpointError(f"rope_type {kind!r}: --loader hf maps the default RoPE only "
                              "(Megatron's --rotary-base); no scaled variants")
    if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise CheckpointError("partial_rotary_factor != 1: not mapped by --loader hf")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _check_llama_config(config: dict) -> None:
    kind = config.get("model_type")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {config.get('hidden_act')!r}: Megatron's --swiglu "
                              "is SiLU-gated")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise CheckpointError("attention_bias / mlp_bias (a bias on o_proj or the MLP): not "
                              "mapped by --loader hf")
    if kind in ("qwen2", "qwen3") and config.get("sliding_window") and \
            config.get("use_sliding_window"):
        # Qwen's window covers only the layers from max_window_layers on.
        raise CheckpointError(f"{kind} with use_sliding_window: Megatron attends to the whole "
                              "sequence in every layer; not converted")


def sliding_window(config: dict) -> int | None:
    """Mistral's attention window (tokens each token attends to, itself included), or None."""
    window = config.get("sliding_window") if config.get("model_type") == "mistral" else None
    return int(window) if window else None


def warn_about_the_window(config: dict, load_dir) -> None:
    """Mistral's window is dropped on import (Megatron attends to the whole sequence): say so
    where it is shorter than the positions the model takes."""
    window = sliding_window(config)
    positions = int(config.get("max_position_embeddings", 2048))
    if window is None or window >= positions:
        return
    warn_rank_0(f"--loader hf: {load_dir} is a MistralForCausalLM whose attention is a sliding "
                f"window of {window} tokens (sliding_window); Megatron attends to the whole "
                f"sequence, so the import computes the same model only for sequences of up to "
                f"{window} tokens (its max_position_embeddings is {positions}). The checkpoint "
                f"records seq_length {window} (what --use-checkpoint-args trains at); train and "
                f"evaluate with --seq-length <= {window} to keep Mistral's model")


def llama_args(config: dict) -> argparse.Namespace:
    """Megatron's args of a Llama / Mistral / Qwen2 config.json."""
    _check_llama_config(config)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    theta = _rope_theta(config)
    max_positions = int(config.get("max_position_embeddings", 2048))
    window = sliding_window(config)
    return argparse.Namespace(
        num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
        num_attention_heads=heads, ffn_hidden_size=int(config["intermediate_size"]),
        kv_channels=int(config.get("head_dim") or hidden // heads),
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads
        else None, max_position_embeddings=max_positions,
        seq_length=min(max_positions, window or max_positions), sliding_window=window,
        position_embedding_type="rope", use_rotary_position_embeddings=False,
        rotary_base=int(theta) if theta.is_integer() else theta, rotary_percent=1.0,
        rotary_interleaved=False, normalization="RMSNorm",
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)), swiglu=True,
        squared_relu=False, add_bias_linear=False,
        add_qkv_bias=config.get("model_type") == "qwen2",
        qk_layernorm=config.get("model_type") == "qwen3", add_position_embedding=False,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        apply_residual_connection_post_layernorm=False, apply_layernorm_1p=False,
        openai_gelu=False, bias_gelu_fusion=False, make_vocab_size_divisible_by=128,
        padded_vocab_size=int(config["vocab_size"]), tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=None,
        tokenizer_type=None, tokenizer_model=None, vocab_file=None, merge_file=None,
        iteration=0, consumed_train_samples=0, consumed_valid_samples=0,
        true_vocab_size=int(config["vocab_size"]),
        bos_token_id=_token_id(config, "bos_token_id"),
        eos_token_id=_token_id(config, "eos_token_id"))


def _token_id(config: dict, key: str) -> int | None:
    """An HF config's bos/eos id (the first of a list: Llama 3 instruct lists several eos)."""
    value = config.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


class HuggingFaceLlama(ModelDescription):
    """A local ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` /
    ``Qwen3ForCausalLM`` directory."""

    def __init__(self, config: dict, tensors) -> None:
        super().__init__(family="GPT", args=llama_args(config),
                         true_vocab_size=int(config["vocab_size"]))
        self.repad = True
        self.tensors = tensors
        check_tensors_match_config(config, tensors)

    def embeddings(self) -> dict[str, torch.Tensor]:
        return {WORD_EMBEDDINGS: self.tensors.get("model.embed_tokens.weight")}

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        ours, theirs = LAYER.format(index), HF_LAYER.format(index)
        out = {ours + name: self.tensors.get(theirs + hf_name) for name, hf_name in LAYER_TENSORS
               if not name.startswith("mlp.")}
        qkv = [self.tensors.get(theirs + f"self_attn.{n}_proj.weight") for n in "qkv"]
        out[ours + "self_attention.query_key_value.weight"] = fuse_qkv(*qkv, self.args)
        if self.args.add_qkv_bias:
            qkv = [self.tensors.get(theirs + f"self_attn.{n}_proj.bias") for n in "qkv"]
            out[ours + "self_attention.query_key_value.bias"] = fuse_qkv(*qkv, self.args)
        if self.args.qk_layernorm:
            for n in "qk":
                out[ours + f"self_attention.{n}_layernorm.weight"] = self.tensors.get(
                    theirs + f"self_attn.{n}_norm.weight")
        out.update(self.mlp(index, ours, theirs))
        return {ours + name: out[ours + name] for name in self.layer_order(index)
                if ours + name in out}

    def mlp(self, index: int, ours: str, theirs: str) -> dict[str, torch.Tensor]:
        """Layer ``index``'s MLP tensors under our names (the dense SwiGLU MLP here)."""
        return {ours + "mlp.dense_h_to_4h.weight": torch.cat(
            [self.tensors.get(theirs + "mlp.gate_proj.weight"),
             self.tensors.get(theirs + "mlp.up_proj.weight")], dim=0),
            ours + "mlp.dense_4h_to_h.weight": self.tensors.get(theirs + "mlp.down_proj.weight")}

    def layer_order(self, index: int) -> tuple[str, ...]:
        """Layer ``index``'s tensor names in the order Megatron's modules hold them."""
        return LAYER_ORDER

    def head(self) -> dict[str, torch.Tensor]:
        out = {FINAL_NORM: self.tensors.get("model.norm.weight")}
        if self.untied:
            out[OUTPUT_LAYER] = self.tensors.get("lm_head.weight")
        return out


# Tensor -> its shape, from the config's fields (named in the error when it differs).
_LLAMA_SHAPES = (
    ("model.embed_tokens.weight", ("vocab_size", "hidden_size")),
    (HF_LAYER + "self_attn.q_proj.weight", ("num_attention_heads x head_dim", "hidden_size")),
    (HF_LAYER + "self_attn.k_proj.weight", ("num_key_value_heads x head_dim", "hidden_size")),
    (HF_LAYER + "self_attn.v_proj.weight", ("num_key_value_heads x head_dim", "hidden_size")),
    (HF_LAYER + "self_attn.o_proj.weight", ("hidden_size", "num_attention_heads x head_dim")),
    (HF_LAYER + "mlp.gate_proj.weight", ("intermediate_size", "hidden_size")),
    (HF_LAYER + "mlp.up_proj.weight", ("intermediate_size", "hidden_size")),
    (HF_LAYER + "mlp.down_proj.weight", ("hidden_size", "intermediate_size")))


def check_tensors_match_config(config: dict, tensors) -> None:
    """Every tensor has the shape config.json gives it, and no layer lies beyond
    ``num_hidden_layers`` (else the import would fail deep in a reshape, or silently drop
    layers / build another model).

    Raises:
        CheckpointError: naming config.json's fields, their values and the tensor.
    """
    args = llama_args(config)
    hidden, heads, groups = args.hidden_size, args.num_attention_heads, query_groups(args)
    hd = args.kv_channels
    value = {"vocab_size": int(config["vocab_size"]), "hidden_size": hidden,
             "intermediate_size": args.ffn_hidden_size,
             "num_attention_heads x head_dim": heads * hd,
             "num_key_value_heads x head_dim": groups * hd}
    where = tensors.directory / "config.json"
    keys = [_LLAMA_SHAPES[0]] + [(pattern.format(index), fields) for index in
                                 range(args.num_layers) for pattern, fields in _LLAMA_SHAPES[1:]]
    for key, fields in keys:
        shape, expected = tensors.shape(key), tuple(value[f] for f in fields)
        if shape is not None and shape != expected:
            said = ", ".join(f"{f} = {value[f]}" for f in dict.fromkeys(fields))
            raise CheckpointError(
                f"{key} is {list(shape)}, but {where} describes {list(expected)} ({said}; "
                f"head_dim {hd}, num_key_value_heads {groups}): the config does not describe "
                "these weights; correct config.json (or use the model's own)")
    extra = layers_beyond(tensors.keys(), r"^model\.layers\.(\d+)\.", args.num_layers)
    if extra:
        raise CheckpointError(f"{tensors.directory} holds tensors of layer(s) "
                              f"{', '.join(map(str, extra))}, beyond the num_hidden_layers "
                              f"{args.num_layers} of {where}: they would be dropped; correct "
                              "num_hidden_layers (or use the model's own config.json)")
