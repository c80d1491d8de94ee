"""HuggingFace mixture-of-experts models <-> Megatron MoE GPTs (``--loader hf`` /
``--saver hf``):
``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` (shared expert with its sigmoid gate),
``Qwen3MoeForCausalLM`` and ``OlmoeForCausalLM``; the attention, norms and embeddings map as in
:mod:`hf_llama`.

==================================================  ============================================
ours (layers.N.)                                    HF (model.layers.N.)
==================================================  ============================================
mlp.router.weight [E, h]                            mlp.gate.weight (Mixtral files: block_sparse_
                                                    moe.gate.weight)
mlp.local_experts.e.dense_h_to_4h [gate; up]        mlp.experts.gate_up_proj[e] (transformers 5),
                                                    or experts.e.{gate,up}_proj / Mixtral w1, w3
mlp.local_experts.e.dense_4h_to_h                   mlp.experts.down_proj[e], experts.e.down_proj
                                                    / Mixtral w2
mlp.shared_experts.dense_h_to_4h [gate; up]         mlp.shared_expert.{gate,up}_proj (Qwen2-MoE)
mlp.shared_experts.dense_4h_to_h / gate_weight      mlp.shared_expert.down_proj / shared_expert_gate
==================================================  ============================================

Routing: Mixtral's softmax over the top-k logits is Megatron's default; Qwen's softmax over all
experts then top-k is ``--moe-router-pre-softmax``, renormalized over the k (``norm_topk_prob``)
it equals the default again. Qwen's dense layers (``mlp_only_layers``, ``decoder_sparse_step``)
become ``--moe-layer-freq``. OLMoE normalizes q and k over the whole projection (all heads),
not per head: ``--qk-layernorm --qk-layernorm-full-projection`` (its ``self_attn.{q,k}_norm``
are our ``{q,k}_layernorm`` as they are, heads in the same order); its routing is Qwen's.
"""

from __future__ import annotations

import argparse

import torch

from megatron.checkpointing import CheckpointError
from tools.checkpoint.hf_files import optional_module
from tools.checkpoint.hf_llama import (FINAL_NORM, HF_LAYER, LAYER, LAYER_ORDER, LAYER_TENSORS,
                                       HuggingFaceLlama, _qk_norms, check_llama_compatible,
                                       head_dim, llama_args, llama_config, split_qkv)
from tools.checkpoint.model_description import OUTPUT_LAYER, WORD_EMBEDDINGS

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
_LLAMA_KIND = {"mixtral": "llama", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "olmoe": "qwen3"}


def moe_layer_pattern(config: dict) -> list[int]:
    """1 for each sparse layer: Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``
    (Mixtral's layers are all sparse)."""
    layers = int(config["num_hidden_layers"])
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def moe_args(config: dict) -> argparse.Namespace:
    """Megatron's args of a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE config.json."""
    kind = config.get("model_type")
    if kind == "olmoe":
        _check_olmoe(config)
    if kind == "mixtral" and config.get("sliding_window"):
        raise CheckpointError("mixtral with a sliding_window: Megatron attends to the whole "
                              "sequence; not converted")
    args = llama_args({**config, "model_type": _LLAMA_KIND[kind]})
    if kind == "qwen2_moe":
        args.add_qkv_bias = bool(config.get("qkv_bias", True))
    experts = int(config.get("num_local_experts") or config.get("num_experts"))
    pattern = moe_layer_pattern(config)
    args.num_experts = experts
    args.moe_layer_freq = 1 if all(pattern) else pattern
    args.moe_router_topk = int(config["num_experts_per_tok"])
    args.moe_ffn_hidden_size = int(config.get("moe_intermediate_size")
                                   or config["intermediate_size"])
    args.moe_router_pre_softmax = kind != "mixtral" and not config.get("norm_topk_prob", False)
    args.moe_router_load_balancing_type = "aux_loss"
    args.moe_aux_loss_coeff = float(config.get("router_aux_loss_coef") or 0.0)
    jitter = float(config.get("router_jitter_noise") or 0.0)
    args.moe_input_jitter_eps = jitter or None
    shared = config.get("shared_expert_intermediate_size") if kind == "qwen2_moe" else None
    args.moe_shared_expert_intermediate_size = int(shared) if shared else None
    args.moe_shared_expert_gate = bool(shared)
    args.qk_layernorm_full_projection = kind == "olmoe"
    return args


def _check_olmoe(config: dict) -> None:
    """Refuse the OLMoE configs whose forward ours does not compute."""
    for key, why in (("clip_qkv", "clamps q, k and v"),
                     ("attention_bias", "adds biases to q/k/v and o_proj")):
        if config.get(key):
            raise CheckpointError(f"model_type 'olmoe' with {key} = {config[key]}: OLMoE {why}, "
                                  "which Megatron's attention does not; not converted")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if config.get("head_dim") and int(config["head_dim"]) * heads != hidden:
        raise CheckpointError(f"model_type 'olmoe' with head_dim {config['head_dim']} x "
                              f"num_attention_heads {heads} != hidden_size {hidden}: OLMoE's q "
                              "norm spans hidden_size; not converted")


class HuggingFaceMoE(HuggingFaceLlama):
    """A local ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM`` /
    ``OlmoeForCausalLM`` directory."""

    def __init__(self, config: dict, tensors) -> None:
        args = moe_args(config)  # refuses what cannot convert, before anything is read
        super().__init__({**config, "model_type": _LLAMA_KIND[config["model_type"]]}, tensors)
        self.kind = config["model_type"]
        self.args = args
        if self.kind == "olmoe":
            _check_qk_norm_shapes(args, tensors)
        self.pattern = moe_layer_pattern(config)

    def _moe_prefix(self, theirs: str) -> str:
        legacy = theirs + "block_sparse_moe."
        return legacy if legacy + "gate.weight" in self.tensors else theirs + "mlp."

    def mlp(self, index: int, ours: str, theirs: str) -> dict[str, torch.Tensor]:
        if not self.pattern[index]:
            return super().mlp(index, ours, theirs)
        hf = self._moe_prefix(theirs)
        out = {ours + "mlp.router.weight": self.tensors.get(hf + "gate.weight")}
        for e in range(self.args.num_experts):
            fc1, fc2 = self._expert(hf, e)
            out[ours + f"mlp.local_experts.{e}.dense_h_to_4h.weight"] = fc1
            out[ours + f"mlp.local_experts.{e}.dense_4h_to_h.weight"] = fc2
        if self.args.moe_shared_expert_intermediate_size:
            shared = hf + "shared_expert."
            out[ours + "mlp.shared_experts.dense_h_to_4h.weight"] = torch.cat(
                [self.tensors.get(shared + "gate_proj.weight"),
                 self.tensors.get(shared + "up_proj.weight")], dim=0)
            out[ours + "mlp.shared_experts.dense_4h_to_h.weight"] = self.tensors.get(
                shared + "down_proj.weight")
            out[ours + "mlp.shared_experts.gate_weight"] = self.tensors.get(
                hf + "shared_expert_gate.weight")
        return out

    def _expert(self, hf: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s (fc1 [gate; up], fc2): transformers 5's stacked tensors, or the
        per-expert files (Qwen's gate/up/down_proj, Mixtral's w1/w3/w2)."""
        if hf + "experts.gate_up_proj" in self.tensors:
            return (self.tensors.get(hf + "experts.gate_up_proj")[e].clone(),
                    self.tensors.get(hf + "experts.down_proj")[e].clone())
        one = hf + f"experts.{e}."
        if one + "w1.weight" in self.tensors:
            names = ("w1", "w3", "w2")
        else:
            names = ("gate_proj", "up_proj", "down_proj")
        gate, up, down = (self.tensors.get(one + f"{n}.weight") for n in names)
        return torch.cat([gate, up], dim=0), down

    def layer_order(self, index: int) -> tuple[str, ...]:
        if not self.pattern[index]:
            return LAYER_ORDER
        experts = [f"mlp.local_experts.{e}.{fc}.weight" for e in range(self.args.num_experts)
                   for fc in ("dense_h_to_4h", "dense_4h_to_h")]
        shared = ["mlp.shared_experts.dense_h_to_4h.weight",
                  "mlp.shared_experts.dense_4h_to_h.weight", "mlp.shared_experts.gate_weight"]
        mlp_free = tuple(n for n in LAYER_ORDER if not n.startswith("mlp."))
        return (*mlp_free, "mlp.router.weight", *experts, *shared)


def _check_qk_norm_shapes(args: argparse.Namespace, tensors) -> None:
    """OLMoE's q/k norms are as wide as all query heads / all key heads (else config.json
    describes other weights)."""
    widths = {"q": int(args.num_attention_heads) * int(args.kv_channels),
              "k": (int(args.num_query_groups or args.num_attention_heads)
                    * int(args.kv_channels))}
    for i in range(int(args.num_layers)):
        for n, width in widths.items():
            key = HF_LAYER.format(i) + f"self_attn.{n}_norm.weight"
            shape = tensors.shape(key)
            if shape is not None and tuple(shape) != (width,):
                raise CheckpointError(f"{key} is {list(shape)}, but config.json describes an "
                                      f"OLMoE {n} norm over [{width}] (all heads)")


# --- export (``--saver hf``) -------------------------------------------------------------------

def check_moe_exportable(args: argparse.Namespace) -> str:
    """The HF class an MoE GPT exports as: Qwen2-MoE with gated shared experts, OLMoE with q/k
    norms over the whole projection, Qwen3-MoE with per-head q/k norms, else Mixtral (softmax
    over the top-k, every layer sparse, no q/k/v bias).

    Raises:
        ValueError: naming what none of the classes holds.
    """
    check_llama_compatible(args)
    problems = [flag for flag, bad in (
        ("--moe-router-score-function other than softmax",
         getattr(args, "moe_router_score_function", "softmax") != "softmax"),
        ("--moe-router-topk-scaling-factor", getattr(args, "moe_router_topk_scaling_factor",
                                                     None)),
        ("--moe-router-group-topk", getattr(args, "moe_router_group_topk", None)),
        ("--moe-router-enable-expert-bias", getattr(args, "moe_router_enable_expert_bias",
                                                    False)),
        ("--moe-expert-capacity-factor", getattr(args, "moe_expert_capacity_factor", None)),
    ) if bad]
    shared = getattr(args, "moe_shared_expert_intermediate_size", None)
    if shared and not getattr(args, "moe_shared_expert_gate", False):
        problems.append("shared experts without --moe-shared-expert-gate")
    if shared and getattr(args, "qk_layernorm", False):
        problems.append("shared experts with --qk-layernorm")
    if not shared and not getattr(args, "qk_layernorm", False):
        if getattr(args, "moe_router_pre_softmax", False):
            problems.append("--moe-router-pre-softmax without shared experts or q/k norms")
        if getattr(args, "add_qkv_bias", False):
            problems.append("--add-qkv-bias without shared experts")
        if getattr(args, "moe_layer_freq", 1) not in (1, None) and \
                not all(_pattern(args)):
            problems.append("dense layers (--moe-layer-freq) without shared experts or q/k "
                            "norms")
    if getattr(args, "qk_layernorm_full_projection", False):
        problems += _olmoe_problems(args, shared)
    if problems:
        raise ValueError("--saver hf: no HuggingFace MoE class holds this model ("
                         + ", ".join(problems) + "); keep it a Megatron checkpoint")
    if shared:
        return "Qwen2MoeForCausalLM"
    if getattr(args, "qk_layernorm_full_projection", False):
        return "OlmoeForCausalLM"
    return "Qwen3MoeForCausalLM" if getattr(args, "qk_layernorm", False) else \
        "MixtralForCausalLM"


def _olmoe_problems(args: argparse.Namespace, shared) -> list[str]:
    """What ``OlmoeForCausalLM`` (every layer sparse, no shared expert, q norm over
    hidden_size) cannot hold of a model with ``--qk-layernorm-full-projection``."""
    problems = []
    if shared:
        problems.append("shared experts with --qk-layernorm-full-projection")
    if not all(_pattern(args)):
        problems.append("dense layers (--moe-layer-freq) with --qk-layernorm-full-projection")
    if head_dim(args) * int(args.num_attention_heads) != int(args.hidden_size):
        problems.append("--kv-channels x --num-attention-heads != --hidden-size with "
                        "--qk-layernorm-full-projection")
    return problems


def _pattern(args: argparse.Namespace) -> list[int]:
    freq, layers = getattr(args, "moe_layer_freq", 1) or 1, int(args.num_layers)
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(layers)]
    return [int(v) for v in freq]


def moe_config(md, vocab: int, architecture: str, special=None):
    """The ``MixtralConfig`` / ``Qwen2MoeConfig`` / ``Qwen3MoeConfig`` / ``OlmoeConfig`` of
    ``md``; ``special``:
    its (bos, eos) token ids, as for ``llama_config``."""
    transformers = optional_module("transformers", "--saver hf")
    args = md.args
    base = {"Qwen2MoeForCausalLM": "Qwen2ForCausalLM", "Qwen3MoeForCausalLM":
            "Qwen3ForCausalLM", "OlmoeForCausalLM": "Qwen3ForCausalLM",
            "MixtralForCausalLM": "LlamaForCausalLM"}[architecture]
    common = llama_config(md, vocab, base, special).to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "hidden_act", "attention_dropout", "bos_token_id",
            "eos_token_id")
    kw = {k: common[k] for k in keep if k in common}
    kw["torch_dtype"] = common.get("torch_dtype") or common.get("dtype") or "float32"
    experts, topk = int(args.num_experts), int(args.moe_router_topk)
    moe_ffn = int(getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size)
    coeff = float(getattr(args, "moe_aux_loss_coeff", 0.0) or 0.0)
    if architecture == "MixtralForCausalLM":
        return transformers.MixtralConfig(
            architectures=[architecture], intermediate_size=moe_ffn, num_local_experts=experts,
            num_experts_per_tok=topk, router_aux_loss_coef=coeff, sliding_window=None,
            head_dim=head_dim(args), **kw)
    if architecture == "OlmoeForCausalLM":
        return transformers.OlmoeConfig(
            architectures=[architecture], intermediate_size=moe_ffn, num_experts=experts,
            num_experts_per_tok=topk, router_aux_loss_coef=coeff,
            norm_topk_prob=not getattr(args, "moe_router_pre_softmax", False),
            attention_bias=False, clip_qkv=None, **kw)
    pattern = _pattern(args)
    qwen = dict(intermediate_size=int(args.ffn_hidden_size), moe_intermediate_size=moe_ffn,
                num_experts=experts, num_experts_per_tok=topk, router_aux_loss_coef=coeff,
                norm_topk_prob=not getattr(args, "moe_router_pre_softmax", False),
                decoder_sparse_step=1, mlp_only_layers=[i for i, v in enumerate(pattern) if not v],
                **kw)
    if architecture == "Qwen2MoeForCausalLM":
        return transformers.Qwen2MoeConfig(
            architectures=[architecture], qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
            shared_expert_intermediate_size=int(args.moe_shared_expert_intermediate_size),
            **qwen)
    return transformers.Qwen3MoeConfig(architectures=[architecture], head_dim=head_dim(args),
                                       attention_bias=False, **qwen)


def moe_tensors(md, vocab: int, architecture: str):
    """(HF name, tensor) of ``md`` in the per-expert layout HF's files hold, a piece at a
    time."""
    args = md.args
    pattern = _pattern(args)
    yield "model.embed_tokens.weight", md.embeddings()[WORD_EMBEDDINGS][:vocab]
    for i in range(md.num_layers):
        layer = md.layer(i)
        ours, theirs = LAYER.format(i), HF_LAYER.format(i)
        for name, hf_name in LAYER_TENSORS:
            if not name.startswith("mlp."):
                yield theirs + hf_name, layer[ours + name]
        for kind in ("weight", "bias"):
            fused = layer.get(ours + f"self_attention.query_key_value.{kind}")
            if fused is not None:
                for n, x in zip("qkv", split_qkv(fused, args)):
                    yield theirs + f"self_attn.{n}_proj.{kind}", x
        yield from _qk_norms(layer, ours, theirs, args)
        if pattern[i]:
            yield from _moe_mlp(layer, ours, theirs, args, architecture)
        else:
            gate, up = torch.chunk(layer[ours + "mlp.dense_h_to_4h.weight"], 2, dim=0)
            yield theirs + "mlp.gate_proj.weight", gate
            yield theirs + "mlp.up_proj.weight", up
            yield theirs + "mlp.down_proj.weight", layer[ours + "mlp.dense_4h_to_h.weight"]
        del layer
    head = md.head()
    yield "model.norm.weight", head[FINAL_NORM]
    if md.untied:
        yield "lm_head.weight", head[OUTPUT_LAYER][:vocab]


def _moe_mlp(layer: dict, ours: str, theirs: str, args, architecture: str):
    mixtral = architecture == "MixtralForCausalLM"
    hf = theirs + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    yield hf + "gate.weight", layer[ours + "mlp.router.weight"]
    for e in range(int(args.num_experts)):
        gate, up = torch.chunk(layer[ours + f"mlp.local_experts.{e}.dense_h_to_4h.weight"], 2)
        down = layer[ours + f"mlp.local_experts.{e}.dense_4h_to_h.weight"]
        for n, x in zip(names, (gate, up, down)):
            yield hf + f"experts.{e}.{n}.weight", x
    if getattr(args, "moe_shared_expert_intermediate_size", None):
        gate, up = torch.chunk(layer[ours + "mlp.shared_experts.dense_h_to_4h.weight"], 2)
        yield hf + "shared_expert.gate_proj.weight", gate
        yield hf + "shared_expert.up_proj.weight", up
        yield hf + "shared_expert.down_proj.weight", \
            layer[ours + "mlp.shared_experts.dense_4h_to_h.weight"]
        yield hf + "shared_expert_gate.weight", layer[ours + "mlp.shared_experts.gate_weight"]
