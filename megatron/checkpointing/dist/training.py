"""A training run's ``--ckpt-format torch_dist`` checkpoint, laid out as Megatron-LM's
training saves it::

    <save>/latest_checkpointed_iteration.txt   written last, by global rank 0
    <save>/iter_0000100/.metadata, __<rank>_0.distcp, metadata.json, checksums.sha256

Inside the iteration directory: the model under Megatron-Core's keys (:mod:`.keys`), one
``rng_state`` object per (PP, TP) position (``rng_state/shard_<pp>.<tp>_<PP>.<TP>``, the list
of RNG states of its data-parallel ranks) and the common state (``common_state``: ``args``,
``checkpoint_version``, ``iteration``, ``num_floating_point_operations_so_far``,
``opt_param_scheduler``). Loading reads this rank's chunks at whatever TP / PP / virtual-stage /
DP layout the run has.

The optimizer state is stored in Megatron's reshardable form: ``optimizer.state.*`` per
parameter, param groups and grad scaler in the common state; :mod:`.optimizer` for the
distributed optimizer, :mod:`.plain_optimizer` for the others. Either loads what the other
saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from megatron.checkpointing.dist import optimizer as dist_optimizer
from megatron.checkpointing.dist import plain_optimizer
from megatron.checkpointing.dist import storage
from megatron.checkpointing.dist.model import (Layout, check_strictness, duplicate_chunks,
                                               model_objects, model_tensors)
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.names import checkpoint_dir
from megatron.checkpointing.versions import CHECKPOINT_VERSION

RNG_STATE = "rng_state"
MAIN_PREFIX = dist_optimizer.PREFIX + dist_optimizer.MAIN + "."


def _layout(cfg) -> Layout:
    return Layout.from_parallel_state(cfg.model.num_layers, cfg.model.num_experts)


def _rng_key(layout: Layout) -> str:
    return storage.object_key(RNG_STATE, (layout.pp_rank, layout.tp_rank),
                              (layout.pp_size, layout.tp_size))


def stage(iteration: int, model: Sequence[torch.nn.Module], optimizer, scheduler, cfg, args,
          rng_states: list[dict] | None, flops_so_far: float, to_host: bool = False
          ) -> tuple[Path, dict]:
    """(the iteration directory, this rank's DCP state dict of iteration ``iteration``);
    ``to_host`` copies the tensors to host memory (an asynchronous save). Collective over the
    data-parallel group with the distributed optimizer."""
    directory = checkpoint_dir(cfg.checkpoint.save, iteration)
    layout = _layout(cfg)
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": flops_so_far}
    if scheduler is not None and not cfg.checkpoint.no_save_optim:
        common["opt_param_scheduler"] = scheduler.state_dict()
    objects: dict = {storage.COMMON_STATE_KEY: common}
    objects.update(model_objects(model, layout))
    if rng_states is not None:
        objects[_rng_key(layout)] = rng_states
    tensors = model_tensors(model, layout, cfg.model.swiglu, for_save=True)
    if optimizer is not None and not cfg.checkpoint.no_save_optim:
        if dist_optimizer.is_supported(optimizer):
            common["optimizer"] = optimizer.state_dict()
            opt_tensors, _ = dist_optimizer.state_tensors(
                model, optimizer, layout, cfg.model.swiglu, _dp_group(), for_save=True,
                expert_dp_group=_expert_dp_group())
        else:
            common["optimizer"] = plain_optimizer.common_state(optimizer)
            opt_tensors, _ = plain_optimizer.state_tensors(model, optimizer, layout,
                                                           cfg.model.swiglu, for_save=True)
        tensors.update(opt_tensors)
    return directory, storage.stage(tensors, objects, to_host)


def save(iteration: int, model: Sequence[torch.nn.Module], optimizer, scheduler, cfg, args,
         rng_states: list[dict] | None, flops_so_far: float) -> tuple[Path, dict[str, str]]:
    """Write this rank's part of iteration ``iteration`` (collective over the world).

    Returns:
        (the iteration directory, ``{file: sha256}`` of the files this rank wrote).
    """
    directory, state = stage(iteration, model, optimizer, scheduler, cfg, args, rng_states,
                             flops_so_far)
    return directory, storage.write(directory, state, cfg.checkpoint.ckpt_fully_parallel_save)


def read_common(directory: Path) -> dict:
    """The common state of a ``torch_dist`` iteration directory (no process group needed)."""
    return storage.read_common_state(directory)


def _dp_group():
    """The group the distributed optimizer shards its state over: DP x CP (pretrain's), so
    that with context parallelism every CP rank's shard is in the saved state."""
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _expert_dp_group():
    """The group the experts' distributed-optimizer state is sharded over (on the expert grid:
    EP > 1 or ETP != TP), else None."""
    from megatron.core import parallel_state
    if not parallel_state.has_expert_grid():
        return None
    return parallel_state.get_expert_data_parallel_group()


def load(directory: Path, model: Sequence[torch.nn.Module], cfg, load_rng: bool,
         optimizer=None, log=None) -> tuple[dict, list[dict] | None]:
    """Read this rank's model chunks in place, and its RNG states (collective).

    Returns:
        (the common state, this (PP, TP) position's RNG state list or None when not asked).

    Raises:
        CheckpointError: a missing, corrupt or mismatched checkpoint (file or key named).
    """
    layout = _layout(cfg)
    metadata = storage.read_metadata(directory)
    storage.check_files(directory, metadata, cfg.checkpoint.verify_checkpoint_checksums)
    common = storage.read_common_state(directory)
    tensors = model_tensors(model, layout, cfg.model.swiglu, for_save=False)
    wholes = None
    if optimizer is not None:
        if "optimizer" not in common:
            raise CheckpointError(f"{directory} holds no optimizer state (saved with "
                                  "--no-save-optim?): pass --no-load-optim or --finetune")
        distributed = dist_optimizer.is_supported(optimizer)
        if distributed:
            opt_tensors, wholes = dist_optimizer.state_tensors(
                model, optimizer, layout, cfg.model.swiglu, _dp_group(), for_save=False,
                expert_dp_group=_expert_dp_group())
        else:
            opt_tensors, wholes = plain_optimizer.state_tensors(
                model, optimizer, layout, cfg.model.swiglu, for_save=False)
        has_main = any(k.startswith(MAIN_PREFIX) for k in metadata.state_dict_metadata)
        if not has_main:
            # Saved by an fp32 run's plain optimizer (no main copies): the main params are
            # the loaded weights, as the optimizer built them.
            opt_tensors = {k: v for k, v in opt_tensors.items()
                           if not k.startswith(MAIN_PREFIX)}
            wholes = [w for w in wholes if w[1] != dist_optimizer.MAIN]
        tensors.update(opt_tensors)
    objects = []
    rng_key = _rng_key(layout)
    if load_rng and rng_key not in metadata.state_dict_metadata and any(
            k.startswith(RNG_STATE + "/") for k in metadata.state_dict_metadata):
        # Saved at another TP/PP layout: its RNG streams do not carry over (Megatron-LM
        # ignores them too).
        if log is not None:
            log(f"{directory} was saved at another tensor/pipeline-parallel layout: its RNG "
                "states are not loaded (the seeded ones are kept)")
        load_rng = False
    if load_rng:
        if rng_key not in metadata.state_dict_metadata:
            raise CheckpointError(
                f"{directory} holds no RNG state for pipeline stage {layout.pp_rank} of "
                f"{layout.pp_size}, tensor rank {layout.tp_rank} of {layout.tp_size} (saved with "
                "--no-save-rng, or at another TP/PP layout, whose RNG streams do not carry "
                "over): pass --no-load-rng")
        objects.append(rng_key)
    mismatch = storage.compare(metadata, tensors, objects, directory)
    mismatch.missing = [k for k in mismatch.missing if "/shard_" not in k
                        and not k.startswith("optimizer.")]
    check_strictness(mismatch, cfg.checkpoint.dist_ckpt_strictness, directory, log)
    wanted = {k: v for k, v in tensors.items() if k not in set(mismatch.unexpected)}
    loaded = storage.load(directory, wanted, objects, metadata)
    with torch.no_grad():
        for kept, copy in duplicate_chunks(model, layout, cfg.model.swiglu):
            copy.data.copy_(kept.data)
    if optimizer is not None:
        if not has_main:
            optimizer.reload_model_params()
        try:
            if distributed:
                optimizer.load_state_dict(common["optimizer"])
            else:
                plain_optimizer.restore(optimizer, common["optimizer"], wholes)
        except (KeyError, ValueError, TypeError) as err:
            raise CheckpointError(f"the optimizer state in {directory} does not fit this run's "
                                  f"optimizer ({err}); pass --no-load-optim") from None
        if distributed:
            dist_optimizer.scatter_back(optimizer, wholes)
    return common, loaded.get(rng_key)
