"""Start a run: parse and validate flags, start torch.distributed, build groups, seed RNGs."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch

from megatron.config import MegatronConfig, parse_args
from megatron.config.cli import ExtraArgsProvider, validate_or_exit
from megatron.core import device, parallel_state
from megatron.core.log import log_rank_0
from megatron.core.tensor_parallel.random import model_parallel_manual_seed


def initialize_megatron(argv: Sequence[str] | None = None,
                        extra_args_provider: ExtraArgsProvider | None = None,
                        require_model: bool = True,
                        require_train_length: bool = False) -> MegatronConfig:
    """Validate flags (before any process group exists), then initialize everything.

    Returns:
        The validated configuration.
    """
    cfg = parse_args(argv, extra_args_provider=extra_args_provider, validate_config=False)
    if cfg.checkpoint.use_checkpoint_args:
        apply_checkpoint_args(cfg)
    validate_or_exit(cfg, require_model=require_model, require_train_length=require_train_length)
    initialize_distributed(cfg)
    set_random_seed(cfg.model.seed, cfg.model.data_parallel_random_init)
    return cfg


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
            cfg.parallel.pipeline_model_parallel_split_rank)
    log_rank_0(f"> initialized tensor model parallel with size "
               f"{parallel_state.get_tensor_model_parallel_world_size()}, pipeline model parallel "
               f"with size {parallel_state.get_pipeline_model_parallel_world_size()}, data "
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


# Flags --use-checkpoint-args copies from the checkpoint's saved args.
_CHECKPOINT_ARCH_FIELDS = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
              "max_position_embeddings", "add_position_embedding", "make_vocab_size_divisible_by",
              "layernorm_epsilon", "apply_residual_connection_post_layernorm", "openai_gelu",
              "untie_embeddings_and_output_weights", "add_bias_linear",
              "apply_query_key_layer_scaling"),
    "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
    "data": ("seq_length",),
    "tokenizer": ("tokenizer_type", "vocab_file", "merge_file", "vocab_size", "tokenizer_model"),
}


def apply_checkpoint_args(cfg: MegatronConfig) -> None:
    """--use-checkpoint-args: take the architecture (and tokenizer, where the flags give none)
    from the ``args`` saved in the ``--load`` checkpoint."""
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
            if value is None:
                continue
            if section == "tokenizer" and getattr(sec, name) is not None:
                continue  # flags given on the command line win for file paths
            setattr(sec, name, value)


def build_tokenizer_from_config(cfg: MegatronConfig):
    """The tokenizer of ``--tokenizer-type`` (a NullTokenizer of ``--vocab-size``, default GPT-2's
    50257, for ``--mock-data``); records the padded vocabulary size the model is built with."""
    from megatron.tokenizer import build_tokenizer

    tok_cfg = cfg.tokenizer
    if tok_cfg.tokenizer_type is None and cfg.data.mock_data:
        tok_cfg.tokenizer_type = "NullTokenizer"
        tok_cfg.vocab_size = tok_cfg.vocab_size or 50257
    tokenizer = build_tokenizer(tok_cfg, cfg.parallel.tensor_model_parallel_size,
                                cfg.model.make_vocab_size_divisible_by)
    cfg.padded_vocab_size = tokenizer.padded_vocab_size
    return tokenizer
