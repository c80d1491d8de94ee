"""HuggingFace mixture-of-experts models -> Megatron MoE GPTs (``--loader hf``):
``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` (shared expert with its sigmoid gate) and
``Qwen3MoeForCausalLM``; the attention, norms and embeddings map as in :mod:`hf_llama`.

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
become ``--moe-layer-freq``. OLMoE normalizes q and k over the whole projection (not per head):
refused.
"""

from __future__ import annotations

import argparse

import torch

from megatron.checkpointing import CheckpointError
from tools.checkpoint.hf_llama import HuggingFaceLlama, LAYER_ORDER, llama_args

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM"}
_LLAMA_KIND = {"mixtral": "llama", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


def moe_layer_pattern(config: dict) -> list[int]:
    """1 for each sparse layer: Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``
    (Mixtral's layers are all sparse)."""
    layers = int(config["num_hidden_layers"])
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def moe_args(config: dict) -> argparse.Namespace:
    """Megatron's args of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json."""
    kind = config.get("model_type")
    if kind == "olmoe":
        raise CheckpointError("model_type 'olmoe': OLMoE's q/k norms act on the whole "
                              "projection, not per head as --qk-layernorm; not converted")
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
    return args


class HuggingFaceMoE(HuggingFaceLlama):
    """A local ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM``
    directory."""

    def __init__(self, config: dict, tensors) -> None:
        args = moe_args(config)  # refuses what cannot convert, before anything is read
        super().__init__({**config, "model_type": _LLAMA_KIND[config["model_type"]]}, tensors)
        self.kind = config["model_type"]
        self.args = args
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
