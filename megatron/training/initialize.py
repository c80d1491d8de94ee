"""Start a run: parse and validate flags, start torch.distributed, build groups, seed RNGs."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch

from megatron.config import MegatronConfig, parse_args
from megatron.config.cli import ExtraArgsProvider
from megatron.core import device, parallel_state
from megatron.core.log import log_rank_0
from megatron.core.tensor_parallel.random import model_parallel_manual_seed


def initialize_megatron(argv: Sequence[str] | None = None,
                        extra_args_provider: ExtraArgsProvider | None = None,
                        require_model: bool = True) -> MegatronConfig:
    """Validate flags (before any process group exists), then initialize everything.

    Returns:
        The validated configuration.
    """
    cfg = parse_args(argv, extra_args_provider=extra_args_provider, require_model=require_model)
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
