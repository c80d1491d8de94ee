"""Loader plug-in: a local HuggingFace GPT-2 (or ``LlamaForCausalLM`` / Mistral / Qwen2,
``hf_llama``; ``MegatronBertForPreTraining`` / post-LN ``BertForPreTraining``, ``hf_bert``)
model directory (``config.json`` +
``model.safetensors``, ``pytorch_model.bin``, or the shards of either with their
``*.index.json``: ``hf_files``) -> a model description. Tensors are read lazily, layer by
layer; nothing is downloaded.

The description's ``args`` are Megatron's for that architecture (``--tokenizer-type
GPT2BPETokenizer`` with the directory's ``vocab.json`` / ``merges.txt`` when present;
``--make-vocab-size-divisible-by 128``): the saver pads the vocabulary as a Megatron run would,
so the result loads with ``--use-checkpoint-args``. A model with the exact erf GeLU
(``activation_function: gelu``) is recorded with ``bias_gelu_fusion = False``, which
``--use-checkpoint-args`` restores (with explicit flags, pass ``--no-bias-gelu-fusion``: the
fusion computes the tanh form).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megatron.checkpointing import CheckpointError
from tools.checkpoint.hf_files import HuggingFaceWeights, layers_beyond, read_config
from tools.checkpoint.hf_llama import ARCHITECTURES, HuggingFaceLlama, warn_about_the_window
from tools.checkpoint.hf_moe import MOE_ARCHITECTURES, HuggingFaceMoE
from tools.checkpoint.hf_mapping import (ATTENTION, GPT2_LAYER, GPT2_LAYER_TENSORS, GPT2_QKV,
                                         LAYER, LAYER_ORDER, qkv_from_hf)
from tools.checkpoint.model_description import OUTPUT_LAYER, WORD_EMBEDDINGS, ModelDescription

_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def gpt2_args(config: dict) -> argparse.Namespace:
    """Megatron's args of a ``GPT2Config``."""
    if config.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"model_type {config.get('model_type')!r}: --loader hf reads the "
                              "GPT-2 and Llama families (model_type gpt2, llama, "
                              "mistral, qwen2, qwen3)")
    hidden, heads = int(config["n_embd"]), int(config["n_head"])
    activation = config.get("activation_function", "gelu_new")
    if activation not in (*_TANH_GELUS, "gelu"):
        raise CheckpointError(f"activation_function {activation!r} has no Megatron GeLU form")
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        raise CheckpointError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn have "
                              "no Megatron equivalent")
    vocab = int(config["vocab_size"])
    return argparse.Namespace(
        num_layers=int(config["n_layer"]), hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=int(config.get("n_inner") or 4 * hidden), kv_channels=hidden // heads,
        max_position_embeddings=int(config["n_positions"]),
        seq_length=int(config["n_positions"]),
        layernorm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", True),
        openai_gelu=False, bias_gelu_fusion=activation in _TANH_GELUS, add_bias_linear=True,
        add_position_embedding=True, use_rotary_position_embeddings=False,
        apply_residual_connection_post_layernorm=False, apply_layernorm_1p=False,
        swiglu=False, squared_relu=False, make_vocab_size_divisible_by=128,
        padded_vocab_size=vocab, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        num_layers_per_virtual_pipeline_stage=None, tokenizer_type="GPT2BPETokenizer",
        vocab_file=None, merge_file=None, iteration=0, consumed_train_samples=0,
        consumed_valid_samples=0)


class HuggingFaceGPT2(ModelDescription):
    """A local ``GPT2LMHeadModel`` directory."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"--load-dir {directory} holds no config.json (a local "
                                  "HuggingFace model directory is needed; nothing is "
                                  "downloaded)")
        config = read_config(config_file)
        args = gpt2_args(config)
        for flag, name in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
            if (directory / name).is_file():
                setattr(args, flag, str((directory / name).resolve()))
        super().__init__(family="GPT", args=args, true_vocab_size=int(config["vocab_size"]))
        self.repad = True
        self.tensors = HuggingFaceWeights(directory)
        extra = layers_beyond(self.tensors.keys(), r"(?:^|\.)h\.(\d+)\.", self.num_layers)
        if extra:
            raise CheckpointError(f"{directory} holds tensors of layer(s) "
                                  f"{', '.join(map(str, extra))}, beyond the n_layer "
                                  f"{self.num_layers} of {config_file}: they would be dropped; "
                                  "correct n_layer (or use the model's own config.json)")

    def embeddings(self) -> dict[str, torch.Tensor]:
        return {WORD_EMBEDDINGS: self.tensors.get("transformer.wte.weight"),
                "language_model.embedding.position_embeddings.weight":
                    self.tensors.get("transformer.wpe.weight")}

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        heads = int(self.args.num_attention_heads)
        out = {}
        for ours, theirs, transposed in GPT2_LAYER_TENSORS:
            value = self.tensors.get(GPT2_LAYER.format(index) + theirs)
            out[LAYER.format(index) + ours] = value.t().contiguous() if transposed else value
        for ours, theirs in GPT2_QKV:
            out[ATTENTION.format(index) + ours.split(".", 1)[1]] = qkv_from_hf(
                self.tensors.get(GPT2_LAYER.format(index) + theirs), heads)
        prefix = LAYER.format(index)
        return {prefix + name: out[prefix + name] for name in LAYER_ORDER}

    def head(self) -> dict[str, torch.Tensor]:
        out = {"language_model.encoder.final_layernorm.weight":
               self.tensors.get("transformer.ln_f.weight"),
               "language_model.encoder.final_layernorm.bias":
               self.tensors.get("transformer.ln_f.bias")}
        if self.untied:
            out[OUTPUT_LAYER] = self.tensors.get("lm_head.weight")
        return out


def load(directory: str | Path, family: str) -> ModelDescription:
    """The loader's entry point (``--loader hf``)."""
    if family == "BERT":
        from tools.checkpoint.hf_bert import HuggingFaceMegatronBert
        if not (Path(directory) / "config.json").is_file():
            raise CheckpointError(f"--load-dir {directory} holds no config.json")
        return HuggingFaceMegatronBert(directory, HuggingFaceWeights(Path(directory)))
    config_file = Path(directory) / "config.json"
    config = read_config(config_file) if config_file.is_file() else {}
    if config.get("model_type") in (*MOE_ARCHITECTURES, "olmoe"):
        md = HuggingFaceMoE(config, HuggingFaceWeights(Path(directory)))
        _llama_tokenizer(md.args, Path(directory))
        return md
    if config.get("model_type") in ARCHITECTURES:
        md = HuggingFaceLlama(config, HuggingFaceWeights(Path(directory)))
        warn_about_the_window(config, directory)
        _llama_tokenizer(md.args, Path(directory))
        return md
    return HuggingFaceGPT2(directory)


def _llama_tokenizer(args: argparse.Namespace, directory: Path) -> None:
    """The directory's own tokenizer as Megatron's flags: ``tokenizer.json`` ->
    ``HuggingFaceTokenizer`` of the directory, else ``tokenizer.model`` -> ``Llama2Tokenizer``."""
    if (directory / "tokenizer.json").is_file():
        args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", str(directory.resolve())
    elif (directory / "tokenizer.model").is_file():
        args.tokenizer_type = "Llama2Tokenizer"
        args.tokenizer_model = str((directory / "tokenizer.model").resolve())
