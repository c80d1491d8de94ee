"""Start a run: parse and validate flags, start torch.distributed, build groups, seed RNGs."""

from __future__ import annotations

import argparse
import copy
import random
from collections.abc import Sequence

import numpy as np
import torch

from megatron.config import MegatronConfig
from megatron.config.cli import (ExtraArgsProvider, ToolSection, parse_command_line,
                                 validate_or_exit)
from megatron.config.validate import ToolChecks
from megatron.core import device, parallel_state
from megatron.core.log import log_rank_0
from megatron.core.tensor_parallel.random import model_parallel_manual_seed
from megatron.training import fault


def initialize_megatron(argv: Sequence[str] | None = None,
                        extra_args_provider: ExtraArgsProvider | None = None,
                        require_model: bool = True,
                        require_train_length: bool = False,
                        tool_sections: Sequence[ToolSection] = (),
                        require_data: bool = False) -> MegatronConfig:
    """Parse ``argv`` and initialize from it: :func:`initialize_from_config` of the flags.

    Args:
        argv: the flags (``sys.argv[1:]`` when None).
        extra_args_provider: a Megatron-LM style hook adding untyped flags (``cfg.extra``).
        require_model, require_train_length, require_data: as :func:`validated_config`.
        tool_sections: the script's typed flag sections (``cfg.section(cls)``).

    Returns:
        The validated, read-only configuration.
    """
    flags, parser = parse_command_line(argv, tool_sections=tool_sections,
                                       extra_args_provider=extra_args_provider)
    return initialize_from_config(flags, parser, require_model=require_model,
                                  require_train_length=require_train_length,
                                  require_data=require_data)


def initialize_from_config(flags: MegatronConfig, parser: argparse.ArgumentParser | None = None,
                           *, require_model: bool = True, require_train_length: bool = False,
                           require_data: bool = False,
                           tool_checks: ToolChecks | None = None) -> MegatronConfig:
    """The config entry point: validate parsed ``flags`` (:func:`validated_config`), before any
    process group exists, then start torch.distributed, build the groups and seed the RNGs.

    A script that parsed its flags once derives the run's flags from them
    (:func:`megatron.config.cli.replace_flags`) and passes those here.

    Returns:
        The validated, read-only configuration.
    """
    cfg = validated_config(flags, parser, require_model=require_model,
                           require_train_length=require_train_length, require_data=require_data,
                           tool_checks=tool_checks)
    initialize_distributed(cfg)
    set_random_seed(cfg.model.seed, cfg.model.data_parallel_random_init)
    return cfg


def validated_config(flags: MegatronConfig, parser: argparse.ArgumentParser | None = None, *,
                     require_model: bool = True, require_train_length: bool = False,
                     require_data: bool = False,
                     tool_checks: ToolChecks | None = None) -> MegatronConfig:
    """``flags`` (as parsed; left unchanged) with ``--use-checkpoint-args`` applied, validated;
    starts nothing. A bad combination exits with ``parser``'s usage and a one-line error.

    Args:
        require_model: the architecture flags must be present.
        require_train_length: the script trains: a run length is required.
        require_data: the script reads the --data-path flags: a data source is required.
        tool_checks: the script's own checks, run by validate() (an error exits on one line).
    """
    if flags.checkpoint.use_checkpoint_args:
        flags = copy.deepcopy(flags)  # the checkpoint's values go into a copy
        apply_checkpoint_args(flags)
    return validate_or_exit(flags, require_model=require_model,
                            require_train_length=require_train_length, parser=parser,
                            require_data=require_data, tool_checks=tool_checks)


def initialize_distributed(cfg: MegatronConfig) -> None:
    """torch.distributed from torchrun's environment, then the model-parallel groups."""
    device.init_distributed(cfg.parallel.distributed_backend,
                            cfg.parallel.distributed_timeout_minutes)
    if torch.distributed.get_world_size() != cfg.world_size:
        raise RuntimeError(f"flags were validated for {cfg.world_size} ranks but the world has "
                           f"{torch.distributed.get_world_size()}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
            cfg.virtual_pipeline_model_parallel_size,
            cfg.parallel.pipeline_model_parallel_split_rank,
            distributed_timeout_minutes=cfg.parallel.distributed_timeout_minutes,
            context_parallel_size=cfg.parallel.context_parallel_size,
            expert_model_parallel_size=cfg.parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=cfg.parallel.expert_tensor_parallel_size)
    # Under fault.run_rank: hear at once when another rank fails (and watch for hangs).
    fault.watch_peers(cfg.parallel.watchdog_timeout_seconds)
    log_rank_0(f"> initialized tensor model parallel with size "
               f"{parallel_state.get_tensor_model_parallel_world_size()}, pipeline model parallel "
               f"with size {parallel_state.get_pipeline_model_parallel_world_size()}, context "
               f"parallel with size {parallel_state.get_context_parallel_world_size()}, data "
               f"parallel with size {parallel_state.get_data_parallel_world_size()} "
               f"(backend {torch.distributed.get_backend()})")


def set_random_seed(seed: int, data_parallel_random_init: bool = False) -> None:
    """Megatron's seeding: ``seed + 100 * pp_rank`` (+ ``10 * dp_rank`` with
    ``--data-parallel-random-init``) for python, numpy and torch; then the model-parallel
    stream ``seed + 2718 + tp_rank`` for dropout inside the tensor-parallel region."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_manual_seed(seed, parallel_state.get_tensor_model_parallel_rank())


# Flags --use-checkpoint-args copies from the checkpoint's saved args. The activation is part
# of the architecture: bias_gelu_fusion picks the tanh GeLU over the exact erf one (with
# openai_gelu, onnx_safe and add_bias_linear: gelu_tanh_approximation), which Megatron-LM does
# not restore; nor does it restore qk_layernorm, whose q/k norm weights a model built without
# it could not load.
_CHECKPOINT_ARCH_FIELDS = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
              "max_position_embeddings", "add_position_embedding", "make_vocab_size_divisible_by",
              "layernorm_epsilon", "apply_residual_connection_post_layernorm", "openai_gelu",
              "bias_gelu_fusion", "onnx_safe", "swiglu", "squared_relu",
              "untie_embeddings_and_output_weights", "add_bias_linear",
              "apply_query_key_layer_scaling", "bert_binary_head", "position_embedding_type",
              "rotary_percent", "rotary_base", "rotary_interleaved", "normalization",
              "apply_layernorm_1p", "group_query_attention", "num_query_groups",
              "add_qkv_bias", "qk_layernorm", "qk_layernorm_full_projection", "num_experts",
              "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
              "moe_shared_expert_gate",
              "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
              "moe_router_topk_scaling_factor", "moe_router_num_groups",
              "moe_router_group_topk", "moe_router_dtype", "moe_router_enable_expert_bias",
              "moe_expert_capacity_factor", "moe_token_drop_policy",
              "moe_pad_expert_input_to_capacity"),
    "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
    "data": ("seq_length",),
    "tokenizer": ("tokenizer_type", "vocab_file", "merge_file", "vocab_size", "tokenizer_model"),
}

_NEWER_NAMES = {"layernorm_epsilon": "norm_epsilon"}
"""Our field -> the name Megatron-LM core_v0.13 saves it under (read when ours is absent)."""


def apply_checkpoint_args(cfg: MegatronConfig) -> None:
    """--use-checkpoint-args: take the architecture (and tokenizer, where the flags give none)
    from the ``args`` saved in the ``--load`` checkpoint, into the flags before validation."""
    from megatron.training.checkpointing import CheckpointError, read_checkpoint_args

    if cfg.checkpoint.load is None:
        raise ValueError("--use-checkpoint-args needs --load")
    saved = read_checkpoint_args(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    if saved is None:
        raise CheckpointError(f"--use-checkpoint-args: no checkpoint found in "
                              f"{cfg.checkpoint.load}")
    for section, names in _CHECKPOINT_ARCH_FIELDS.items():
        sec = getattr(cfg, section)
        for name in names:
            value = getattr(saved, name, None)
            if value is None and name in _NEWER_NAMES:
                value = getattr(saved, _NEWER_NAMES[name], None)
            if value is None:
                continue
            if section == "tokenizer" and getattr(sec, name) is not None:
                continue  # flags given on the command line win for file paths
            setattr(sec, name, value)
    # The checkpoint's embedding size wins over --make-vocab-size-divisible-by x TP (as in
    # Megatron-LM), e.g. after a converter changed the TP size but kept the padding.
    cfg.padded_vocab_size = getattr(saved, "padded_vocab_size", None)


def build_tokenizer_from_config(cfg: MegatronConfig):
    """The tokenizer of ``--tokenizer-type`` (validation already chose the NullTokenizer of
    ``--mock-data`` and the padded vocabulary size the model is built with)."""
    from megatron.tokenizer import build_tokenizer

    # validate() chose the padded size (the checkpoint's with --use-checkpoint-args).
    return build_tokenizer(cfg.tokenizer, cfg.parallel.tensor_model_parallel_size,
                           cfg.model.make_vocab_size_divisible_by, cfg.padded_vocab_size)
