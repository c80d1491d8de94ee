"""Training-time checkpoints: which rank writes and reads which shard, RNG state, the optimizer,
on top of the format in ``megatron.checkpointing``
(names, safe loading, atomic writes with checksums, QKV versions, the TP/PP layout) and its
checks against the run's flags (``megatron.checkpointing.compat``).

Layout (``--ckpt-format torch``)::

    <save>/latest_checkpointed_iteration.txt        iteration number, or "release"
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt         PP == 1: mp_rank_{tp:02d}
    <save>/iter_0000100/mp_rank_01_002/model_optim_rng.pt     PP > 1: mp_rank_{tp:02d}_{pp:03d}
    <save>/iter_0000100/mp_rank_00_001/model_optim_rng.pt     EP > 1: mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}
    <save>/iter_0000100/mp_rank_00/distrib_optim.pt           --use-distributed-optimizer

Every file is written under a temporary name, synced, then renamed, and the directories holding
the renamed files are synced; the tracker file is rewritten the same way by global rank 0 after
every rank has finished (then the save root is synced), so a crash at any moment leaves the
previous checkpoint loadable and the tracker never points at a partial one. The sha256 of every
shard is recorded in the iteration directory's ``checksums.sha256`` (global rank 0 writes it,
before the tracker) and checked on load (``megatron.checkpointing.files``: checksums, temporary
files of interrupted saves, out-of-space errors).

Lineage: training refuses to start from random weights when ``--save`` already holds checkpoints
(a mistyped ``--load`` would otherwise overwrite them), and a save that moves the tracker back
to an older iteration says so.

``--ckpt-format torch_dist`` (Megatron-Core's format, any layout at load, ``--async-save``) is
dispatched to ``megatron.checkpointing.dist``; ``--auto-detect-ckpt-format`` reads either.

Loading uses ``torch.load(weights_only=True)`` with an allowlist of the few types a Megatron-LM
checkpoint holds (``megatron.checkpointing.load_checkpoint_file``), so a checkpoint that would
run code is refused with a clear error. Checkpoints older than version 2.0 have another QKV row
order and are converted on load (``megatron.checkpointing.fix_query_key_value_ordering``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron.checkpointing import (  # noqa: F401 - re-exported for existing callers
    CHECKPOINT_VERSION, CHECKSUM_SUFFIX, DISTRIB_OPTIM_FILENAME, MANIFEST_FILENAME,
    MODEL_FILENAME, TRACKER_FILENAME, CheckpointError, MegatronEnum, checkpoint_dir,
    checkpoint_name, checkpoint_version, corrupt_file_error, fix_query_key_value_ordering,
    load_checkpoint_file, manifest_entry, parse_tracker, publish_tracker,
    remove_stale_temp_files, save_file, shard_dir_name, verify_checksum, write_manifest)
from megatron.checkpointing import tracker_path as get_checkpoint_tracker_filename
from megatron.checkpointing.compat import CONVERTER, check_compatible, warn_past_a_sliding_window
from megatron.checkpointing.dist.detect import is_torch_dist_dir
from megatron.checkpointing.experts import dense_expert_rank, expert_file_ranks, with_dense_part

# megatron.checkpointing.dist (torch.distributed.checkpoint under it) is imported where a
# torch_dist checkpoint is read or written: a second or more at start-up that runs in the
# legacy format need not pay.
from megatron.core import comm, device, parallel_state
from megatron.core.log import log_rank_0, warn_rank_0
from megatron.core.tensor_parallel.random import get_rng_tracker


# Names and tracker, as this rank sees them ------------------------------------------------------
def get_checkpoint_name(root: str | os.PathLike, iteration: int, release: bool = False,
                        pipeline_parallel: bool | None = None, tensor_rank: int | None = None,
                        pipeline_rank: int | None = None, expert_rank: int | None = None) -> Path:
    """Path of this rank's ``model_optim_rng.pt`` (Megatron's ``mp_rank_XX[_YYY]`` naming);
    the ranks and sizes left out come from ``parallel_state``."""
    if pipeline_parallel is None:
        pipeline_parallel = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    if expert_rank is None:
        expert_rank = parallel_state.get_expert_model_parallel_rank()
    expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
    return checkpoint_name(root, iteration, release, tensor_rank=tensor_rank,
                           pipeline_rank=pipeline_rank, pipeline_parallel=pipeline_parallel,
                           expert_rank=expert_rank,
                           expert_parallel=expert_parallel)


def read_tracker(root: str | os.PathLike) -> tuple[int, bool] | None:
    """(iteration, release) from the tracker file, agreed across ranks; None without one.

    Collective over all ranks (each takes part whether or not it sees the file).

    Raises:
        CheckpointError: the tracker is not an iteration number or "release".
    """
    tracker = get_checkpoint_tracker_filename(root)
    local = parse_tracker(tracker)
    iteration, release = local if local is not None else (-1, False)
    value = torch.tensor([iteration], dtype=torch.long, device=device.get_device())
    comm.all_reduce(value, comm.world_group(), op="max")
    if int(value) < 0:
        return None
    if int(value) != iteration:
        warn_rank_0(f"ranks disagree on the iteration in {tracker}; using the largest, "
                    f"{int(value)}")
    return int(value), release


def _writes_model_file() -> bool:
    if parallel_state.has_expert_grid():
        return comm.rank(parallel_state.get_expert_data_parallel_group()) == 0
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0


# RNG ------------------------------------------------------------------------------------------
def _rng_state() -> dict:
    return {"random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": device.accelerator_rng_state(),
            "rng_tracker_states": get_rng_tracker().get_states()}


_LEGACY_RNG_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state")


def _load_rng_state(sd: dict, cfg, name: Path) -> None:
    """This rank's RNG states from ``rng_state`` (one per DP rank), or the top-level keys of
    checkpoints older than Megatron-LM's ``rng_state`` list.

    Raises:
        CheckpointError: no RNG state at all, as Megatron-LM refuses (not silently reseeded).
    """
    states = sd.get("rng_state")
    if states:
        index = parallel_state.get_data_parallel_rank() \
            if cfg.model.data_parallel_random_init and len(states) > 1 else 0
        _set_rng_state(states[index])
    elif all(key in sd for key in _LEGACY_RNG_KEYS):
        _set_rng_state(sd)
    else:
        raise CheckpointError(f"{name} holds no RNG state (saved with --no-save-rng?): pass "
                              "--no-load-rng or --finetune to load it without")


def _set_rng_state(state: dict) -> None:
    random.setstate(_as_python_random_state(state["random_rng_state"]))
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    device.set_accelerator_rng_state(state.get("cuda_rng_state"))
    saved = state.get("rng_tracker_states")
    if saved:
        tracker = get_rng_tracker()
        current = tracker.get_states()
        if any(name in current and value.numel() != current[name].numel()
               for name, value in saved.items()):
            # A CUDA generator state (a Megatron-LM GPU run) cannot seed the CPU generator, or
            # the reverse: keep the freshly seeded streams rather than fail at the first dropout.
            warn_rank_0("the checkpoint's model-parallel RNG tracker states belong to another "
                        "device type; keeping the seeded ones (dropout will not replay the "
                        "saved run; --no-load-rng silences this)")
            return
        tracker.set_states(saved)


def _as_python_random_state(state):
    # weights_only loading turns tuples into lists in some torch versions.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def _gather_rng_states(data_parallel_random_init: bool) -> list[dict]:
    state = _rng_state()
    if not data_parallel_random_init or parallel_state.get_data_parallel_world_size() == 1:
        return [state]
    return comm.all_gather_object(state, parallel_state.get_data_parallel_group())


# Save -----------------------------------------------------------------------------------------
def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def _model_state(chunk: torch.nn.Module) -> dict:
    inner = _unwrap(chunk)
    if hasattr(inner, "state_dict_for_save_checkpoint"):
        return inner.state_dict_for_save_checkpoint()
    return inner.state_dict()


def save_checkpoint(iteration: int, model: Sequence[torch.nn.Module], optimizer, scheduler,
                    cfg, consumed_train_samples: int, consumed_valid_samples: int,
                    num_floating_point_operations_so_far: float = 0.0) -> Path:
    """Save every rank's shard under ``--save``; returns the iteration directory.

    Only data-parallel rank 0 of each model-parallel shard writes ``model_optim_rng.pt``; with the
    distributed optimizer every rank takes part in gathering ``distrib_optim.pt``. The writers'
    checksums are gathered and global rank 0 records them in the iteration directory's manifest.

    Raises:
        CheckpointError: a file could not be written (out of space, naming the directory, the
            bytes needed and the bytes free); its temporary file is removed.
    """
    root = Path(cfg.checkpoint.save)
    args = cfg.to_namespace()
    args.consumed_train_samples = consumed_train_samples
    args.consumed_valid_samples = consumed_valid_samples
    args.iteration = iteration
    rng_states = None if cfg.checkpoint.no_save_rng else \
        _gather_rng_states(cfg.model.data_parallel_random_init)
    if cfg.checkpoint.ckpt_format == "torch_dist":
        return _save_torch_dist(iteration, model, optimizer, scheduler, cfg, args, rng_states,
                                num_floating_point_operations_so_far)
    name = get_checkpoint_name(root, iteration)
    digests: dict[str, str] = {}  # this rank's files: manifest entry -> sha256
    distributed_optimizer = cfg.parallel.use_distributed_optimizer and optimizer is not None
    if distributed_optimizer and not cfg.checkpoint.no_save_optim:
        # Collective over the data-parallel group; DP rank 0 receives the gathered state (with
        # expert parallelism expert-DP rank 0 the experts' part too: Megatron-LM's
        # [dense, expert] list in each EP rank's directory).
        state = optimizer.save_parameter_state()
        if state is not None:
            distrib = name.with_name(DISTRIB_OPTIM_FILENAME)
            digests[manifest_entry(distrib)] = save_file(state, distrib)
    # Context-parallel ranks hold the same weights: one of them writes. With expert
    # parallelism one rank of each expert-data-parallel group (its own experts, own file).
    if _writes_model_file():
        sd: dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": iteration,
                    "num_floating_point_operations_so_far": num_floating_point_operations_so_far}
        sd.update(_model_states(model))
        if optimizer is not None and not cfg.checkpoint.no_save_optim:
            sd["optimizer"] = optimizer.state_dict()
            if scheduler is not None:
                sd["opt_param_scheduler"] = scheduler.state_dict()
        if rng_states is not None:
            sd["rng_state"] = rng_states
        # Its directory synced too: this shard's renames are durable.
        digests[manifest_entry(name)] = save_file(sd, name)
    # Every rank's, once every shard is in (the gather waits for all, as a barrier would).
    every_digest = {entry: digest for ranks in comm.all_gather_object(digests, comm.world_group())
                    for entry, digest in ranks.items()}
    if _is_global_rank_0():
        # The manifest, then the tracker: the new mp_rank / iter directories are durable before
        # the tracker can point at them.
        write_manifest(name.parent.parent, every_digest)
        _publish(root, iteration, name.parent.parent)
    comm.barrier(comm.world_group())
    log_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {root}")
    return checkpoint_dir(root, iteration)


def _save_torch_dist(iteration: int, model, optimizer, scheduler, cfg, args, rng_states,
                     flops: float) -> Path:
    """``--ckpt-format torch_dist``: every rank writes its chunks; then global rank 0 writes
    the checksums and moves the tracker."""
    from megatron.checkpointing.dist import storage as dist_storage
    from megatron.checkpointing.dist import training as dist_training

    root = Path(cfg.checkpoint.save)
    if cfg.checkpoint.async_save:
        return _start_async_save(iteration, model, optimizer, scheduler, cfg, args, rng_states,
                                 flops)
    directory, digests = dist_training.save(iteration, model, optimizer, scheduler, cfg, args,
                                            rng_states, flops)
    every = {name: digest for ranks in comm.all_gather_object(digests, comm.world_group())
             for name, digest in ranks.items()}
    if _is_global_rank_0():
        dist_storage.finish(directory, every)
        _publish(root, iteration, directory)
    comm.barrier(comm.world_group())
    log_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {root} "
               "[torch_dist]")
    return directory


def _start_async_save(iteration: int, model, optimizer, scheduler, cfg, args, rng_states,
                      flops: float) -> Path:
    """--async-save: wait for the save in flight, copy the state to host memory and hand it to
    the background writer; the tracker moves once every rank's write is complete."""
    from megatron.checkpointing.dist import storage as dist_storage
    from megatron.checkpointing.dist import training as dist_training
    from megatron.checkpointing.dist.async_save import SAVER as ASYNC_SAVER

    start = time.perf_counter()
    waited = ASYNC_SAVER.wait()
    root = Path(cfg.checkpoint.save)
    directory, state = dist_training.stage(iteration, model, optimizer, scheduler, cfg, args,
                                           rng_states, flops, to_host=True)

    def publish(every: dict[str, str]) -> None:
        dist_storage.finish(directory, every)
        _publish(root, iteration, directory)

    ASYNC_SAVER.start(directory, state, cfg.checkpoint.ckpt_fully_parallel_save, publish)
    log_rank_0(f"  started the asynchronous save of iteration {iteration:7d} to {root}: the "
               f"loop was blocked {time.perf_counter() - start:.3f} s ({waited:.3f} s of it "
               "waiting for the previous save)")
    return directory


def finish_async_save() -> None:
    """Wait for the asynchronous save in flight (at the end of training), logging the wait."""
    async_save = sys.modules.get("megatron.checkpointing.dist.async_save")
    if async_save is None:
        return  # never imported: nothing was saved asynchronously
    ASYNC_SAVER = async_save.SAVER
    if ASYNC_SAVER.in_flight:
        waited = ASYNC_SAVER.wait()
        log_rank_0(f"  waited {waited:.3f} s for the asynchronous checkpoint save to complete")
    else:
        ASYNC_SAVER.wait()  # reports a failed one


def _model_states(model: Sequence[torch.nn.Module]) -> dict:
    """``model``, or ``model0``, ``model1``... with virtual pipeline stages."""
    if len(model) == 1:
        return {"model": _model_state(model[0])}
    return {f"model{i}": _model_state(chunk) for i, chunk in enumerate(model)}


def _is_global_rank_0() -> bool:
    return dist.get_rank() == 0 if dist.is_initialized() else True


def remove_interrupted_save_files(root: Path) -> None:
    """At start-up, global rank 0 deletes the temporary files killed saves left under --save
    (a failed save removes its own); nobody writes there before that (barrier)."""
    if _is_global_rank_0() and root.is_dir():
        removed = remove_stale_temp_files(root)
        if removed:
            log_rank_0(f"  removed {len(removed)} temporary file(s) of an interrupted save "
                       f"under {root}: {', '.join(str(p.relative_to(root)) for p in removed)}")
    comm.barrier(comm.world_group())


def _publish(root: Path, iteration: int, iteration_dir: Path) -> None:
    """Point the tracker at ``iteration``, saying so when that moves it back."""
    previous = publish_tracker(root, iteration, iteration_dir)
    if previous is not None and not previous[1] and previous[0] > iteration:
        warn_rank_0(f"{get_checkpoint_tracker_filename(root)} moves back from iteration "
                    f"{previous[0]} to {iteration}: {checkpoint_dir(root, previous[0]).name} "
                    "stays on disk but is no longer the checkpoint --load resumes from")


# Lineage ----------------------------------------------------------------------------------------
def check_fresh_start(cfg, load_dir: str | os.PathLike | None = None) -> None:
    """Refuse to train from random weights into a --save that already holds checkpoints.

    Called when there is nothing to load (no --load, or ``load_dir`` holds no checkpoint): the
    run's saves would overwrite those checkpoints and move their tracker back, and the next
    resume from --save would silently continue the wrong run. Collective over all ranks.

    Raises:
        CheckpointError: --save holds a tracker file, without --allow-overwrite-checkpoints.
    """
    ck = cfg.checkpoint
    if ck.save is None or ck.allow_overwrite_checkpoints or cfg.training.skip_train:
        return
    tracker = get_checkpoint_tracker_filename(ck.save)
    try:
        tracked = parse_tracker(tracker)
    except CheckpointError:
        tracked = (0, False)  # unreadable, but a checkpoint was saved there
    latest = torch.tensor([-1 if tracked is None else tracked[0]], dtype=torch.long,
                          device=device.get_device())
    comm.all_reduce(latest, comm.world_group(), op="max")  # every rank refuses, or none
    if int(latest) < 0:
        return
    where = f"--load {load_dir} holds no checkpoint ({TRACKER_FILENAME})" \
        if load_dir is not None else "no --load was given"
    raise CheckpointError(
        f"{where}, but --save {ck.save} already holds checkpoints (its tracker names "
        f"iteration {int(latest)}): training from random weights would overwrite them. "
        f"Check the --load path (to resume that run: --load {ck.save}), save elsewhere, or "
        "pass --allow-overwrite-checkpoints to start from scratch anyway")


# Load -----------------------------------------------------------------------------------------
def _find_any_shard(iter_dir: Path) -> Path | None:
    shards = sorted(iter_dir.glob(f"mp_rank_*/{MODEL_FILENAME}"))
    return shards[0] if shards else None


def read_checkpoint_args(load_dir: str | os.PathLike,
                         iteration: int | None = None) -> argparse.Namespace | None:
    """The ``args`` Namespace stored in a checkpoint (any shard), for --use-checkpoint-args.

    Returns:
        The Namespace; None when ``load_dir`` holds no checkpoint.

    Raises:
        CheckpointError: the checkpoint is corrupt, or holds no args.
    """
    tracked = read_tracker(load_dir) if iteration is None else (iteration, False)
    if tracked is None:
        return None
    iter_dir = checkpoint_dir(load_dir, *tracked)
    if is_torch_dist_dir(iter_dir):
        from megatron.checkpointing.dist import training as dist_training
        shard, args = iter_dir, dist_training.read_common(iter_dir).get("args")
    else:
        shard = _find_any_shard(iter_dir)
        if shard is None:
            return None
        args = load_checkpoint_file(shard).get("args")
    if isinstance(args, types.SimpleNamespace):  # how some other tools store them
        args = argparse.Namespace(**vars(args))
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"--use-checkpoint-args: {shard} holds no args to take the "
                              "architecture from; give the architecture flags instead")
    return args


def load_checkpoint(model: Sequence[torch.nn.Module], optimizer, scheduler, cfg,
                    load_dir: str | None = None, strict: bool = True) -> tuple[int, int, int]:
    """Load the latest (or ``--ckpt-step``) checkpoint of ``--load`` into the model and optimizer.

    Every file read is first checked against the sha256 its iteration's manifest records (or,
    saved before the manifest, the ``.sha256`` beside it); files without either, as Megatron-LM
    writes them, have their zip CRC32s checked; --no-verify-checkpoint-checksums skips both.

    Returns:
        (iteration, consumed_train_samples, consumed_valid_samples); zeros without a checkpoint.

    Raises:
        CheckpointError: corrupt (or not matching its checksum), unsafe or mismatched
            checkpoint; missing with --exit-on-missing-checkpoint, or while --save holds
            checkpoints (:func:`check_fresh_start`); no args when resuming training.
    """
    ck = cfg.checkpoint
    root = Path(load_dir or ck.load)
    tracked = read_tracker(root)
    if ck.ckpt_step is not None:
        tracked = (ck.ckpt_step, False)
    if tracked is None and is_torch_dist_dir(root) \
            and _format_of(root, ck) == "torch_dist":
        # A bare torch_dist directory, as dist_checkpointing.save(model.sharded_state_dict(),
        # dir) writes it: its weights, loaded as a release checkpoint.
        return _load_torch_dist(model, optimizer, scheduler, cfg, root, 0, True, directory=root)
    if tracked is None:
        if ck.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {root} holds no {TRACKER_FILENAME} and "
                                  "--exit-on-missing-checkpoint is set")
        check_fresh_start(cfg, load_dir=root)
        warn_rank_0(f"could not find {get_checkpoint_tracker_filename(root)}: starting from "
                    "random weights")
        return 0, 0, 0
    iteration, release = tracked
    if _format_of(checkpoint_dir(root, iteration, release), ck) == "torch_dist":
        return _load_torch_dist(model, optimizer, scheduler, cfg, root, iteration, release)
    name, dense_name = _torch_format_files(root, iteration, release)
    if not name.is_file():
        shard = _find_any_shard(name.parent.parent)
        if shard is None:
            raise CheckpointError(f"checkpoint directory {name.parent.parent} has no "
                                  f"{MODEL_FILENAME} (incomplete save, or wrong --ckpt-step)")
        check_compatible(load_checkpoint_file(shard).get("args"), cfg, shard)
        raise CheckpointError(f"checkpoint file {name} is missing")
    unverified: list[Path] = []
    sd = _read_verified(name, cfg, unverified)
    if dense_name is not None:
        sd = _with_dense_part(sd, _read_verified(dense_name, cfg, unverified), optimizer)
    check_compatible(sd.get("args"), cfg, name)
    warn_past_a_sliding_window(sd.get("args"), cfg, name, weights_only=optimizer is None)
    fresh = release or ck.finetune  # weights only: counters, optimizer and RNG start afresh
    iteration = 0 if fresh else _saved_iteration(sd, name)
    # Resuming training (pretrain passes the optimizer; tools that only read weights do not).
    training = optimizer is not None and not cfg.training.skip_train
    consumed_train, consumed_valid = (0, 0) if fresh else \
        _consumed_samples(sd, name, cfg, iteration, training)
    _fix_qkv_ordering(sd, name, cfg)
    _load_model_chunks(model, sd, strict, name)

    load_optim = not (fresh or ck.no_load_optim)
    if load_optim and optimizer is not None:
        _load_optimizer(optimizer, scheduler, sd, cfg, name, unverified)
    elif optimizer is not None:
        # The optimizer was built before the load: its fp32 main params still hold the initial
        # weights, and the first step would copy them back over the loaded ones.
        optimizer.reload_model_params()
    if not (release or ck.finetune or ck.no_load_rng):
        _load_rng_state(sd, cfg, name)
    if unverified:
        # Quietly, once: Megatron-LM's checkpoints (and ours from before checksums) have none.
        log_rank_0(f"  no sha256 recorded for {', '.join(p.name for p in unverified)} in "
                   f"{name.parent} (no {MANIFEST_FILENAME} entry, no {CHECKSUM_SUFFIX} file): "
                   "loaded after checking its zip CRC32s only (a checkpoint written by "
                   "Megatron-LM?)")
    comm.barrier(comm.world_group())
    log_rank_0(f"  successfully loaded checkpoint from {root} at iteration {iteration}")
    return iteration, consumed_train, consumed_valid


def _torch_format_files(root: Path, iteration: int, release: bool) -> tuple[Path, Path | None]:
    """(the file holding this rank's experts, or its own; the file holding its dense TP slice
    where that is another one, else None).

    On the expert grid the writers are the expert-data-parallel rank-0 ranks: this rank's
    experts' ETP slice is in the file of the writer with its ETP and EP ranks, which holds the
    dense TP slice of that writer's TP rank; where that is not this rank's (TP does not divide
    ETP x EP), the dense slice is read from the file of this TP rank's data-parallel rank 0."""
    if not parallel_state.has_expert_grid():
        return get_checkpoint_name(root, iteration, release), None
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    etp_size = comm.world_size(parallel_state.get_expert_tensor_parallel_group())
    writer_tp, ep_rank = expert_file_ranks(
        tp_size, parallel_state.get_expert_tensor_parallel_rank(), etp_size,
        parallel_state.get_expert_model_parallel_rank())
    name = get_checkpoint_name(root, iteration, release, tensor_rank=writer_tp,
                               expert_rank=ep_rank)
    if writer_tp == tp_rank:
        return name, None
    return name, get_checkpoint_name(root, iteration, release, tensor_rank=tp_rank,
                                     expert_rank=dense_expert_rank(tp_rank, tp_size, etp_size))


def _with_dense_part(expert_sd: dict, dense_sd: dict, optimizer) -> dict:
    """``expert_sd`` (this rank's experts, another TP rank's dense slice) with what
    ``dense_sd`` (this TP rank's) holds of the dense parameters (see
    :func:`megatron.checkpointing.experts.with_dense_part`), the optimizer's parameters told
    apart by Megatron's ``allreduce = False`` expert mark."""
    def is_expert(param) -> bool:
        return not getattr(param, "allreduce", True)

    flags = mains = None
    if optimizer is not None:
        flags = [is_expert(p) for group in optimizer.optimizer.param_groups
                 for p in group["params"]]
        groups = getattr(optimizer, "fp32_from_float16_groups", None)
        mains = None if groups is None else [[is_expert(p) for p in g] for g in groups]
    return with_dense_part(expert_sd, dense_sd, flags, mains)


def _format_of(iter_dir: Path, ck) -> str:
    """The format to read ``iter_dir`` in: --ckpt-format's, or with --auto-detect-ckpt-format
    the one on disk.

    Raises:
        CheckpointError: the directory holds the other format.
    """
    found = "torch_dist" if is_torch_dist_dir(iter_dir) else "torch"
    if found == ck.ckpt_format or ck.auto_detect_ckpt_format or not iter_dir.is_dir():
        return found if iter_dir.is_dir() else ck.ckpt_format
    raise CheckpointError(f"{iter_dir} holds a {found} checkpoint, and this run reads "
                          f"--ckpt-format {ck.ckpt_format}: pass --ckpt-format {found} or "
                          "--auto-detect-ckpt-format")


def _load_torch_dist(model, optimizer, scheduler, cfg, root: Path, iteration: int,
                     release: bool, directory: Path | None = None) -> tuple[int, int, int]:
    """``load_checkpoint`` for a torch_dist iteration directory (``directory``, default the
    one of ``iteration`` under ``root``), at this run's layout."""
    from megatron.checkpointing.dist import training as dist_training

    ck = cfg.checkpoint
    directory = directory or checkpoint_dir(root, iteration, release)
    common = dist_training.read_common(directory)
    check_compatible(common.get("args"), cfg, directory, any_layout=True)
    fresh = release or ck.finetune
    iteration = 0 if fresh else _saved_iteration(common, directory)
    training = optimizer is not None and not cfg.training.skip_train
    consumed = (0, 0) if fresh else _consumed_samples(common, directory, cfg, iteration,
                                                       training)
    load_rng = not (fresh or ck.no_load_rng)
    load_optim = optimizer is not None and not (fresh or ck.no_load_optim)
    _, rng_states = dist_training.load(directory, model, cfg, load_rng,
                                       optimizer if load_optim else None, log=warn_rank_0)
    if load_optim and scheduler is not None and "opt_param_scheduler" in common:
        scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None and not load_optim:
        optimizer.reload_model_params()
    if load_rng and rng_states is not None:
        _load_rng_state({"rng_state": rng_states}, cfg, directory)
    comm.barrier(comm.world_group())
    log_rank_0(f"  successfully loaded checkpoint from {root} at iteration {iteration} "
               "[torch_dist]")
    return iteration, consumed[0], consumed[1]


def _read_verified(path: Path, cfg, unverified: list[Path]) -> dict:
    """:func:`load_checkpoint_file` after checking ``path`` against its recorded sha256; files
    without one are appended to ``unverified``."""
    if cfg.checkpoint.verify_checkpoint_checksums and path.is_file() \
            and not verify_checksum(path):
        unverified.append(path)
    return load_checkpoint_file(path)


def _saved_iteration(sd: dict, name: Path) -> int:
    """The checkpoint's ``iteration`` (very old ones: ``total_iters``).

    Raises:
        CheckpointError: missing, or not a non-negative integer.
    """
    key = "iteration" if "iteration" in sd else "total_iters"
    if key not in sd:
        raise corrupt_file_error(name, "it holds no 'iteration' (pass --finetune to load its "
                                       "weights only)")
    return _count(sd[key], f"'{key}'", name)


def _count(value, what: str, name: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise corrupt_file_error(name, f"{what} is {value!r}, not a non-negative integer")
    return int(value)


def _consumed_samples(sd: dict, name: Path, cfg, iteration: int,
                      training: bool) -> tuple[int, int]:
    """(train, valid) samples consumed before the checkpoint, from its ``args``.

    Without them the sampler would start from the first sample again, replaying the data of the
    iterations already trained: resuming training is refused, or with
    --allow-resume-without-checkpoint-args warned about (tools reading weights are not).

    Raises:
        CheckpointError: no counters while resuming training; counters that are not integers.
    """
    args = sd.get("args")
    train = getattr(args, "consumed_train_samples", None)
    if train is None:
        what = "no args" if args is None else "no consumed_train_samples in its args"
        if training and iteration > 0 and \
                not cfg.checkpoint.allow_resume_without_checkpoint_args:
            raise CheckpointError(
                f"{name} holds {what}: the number of samples consumed by its {iteration} "
                "iterations is unknown, and resuming would restart the data order from the "
                "first sample. Pass --allow-resume-without-checkpoint-args to resume anyway, or "
                "--finetune to train from its weights as a new run")
        if training and iteration > 0:
            warn_rank_0(f"{name} holds {what}: the consumed-sample counters restart at 0 (the "
                        "data order starts from the first sample again)")
        return 0, 0
    valid = getattr(args, "consumed_valid_samples", None)
    return (_count(train, "args.consumed_train_samples", name),
            0 if valid is None else _count(valid, "args.consumed_valid_samples", name))


def _load_optimizer(optimizer, scheduler, sd: dict, cfg, name: Path,
                    unverified: list[Path]) -> None:
    """Optimizer (+ ``distrib_optim.pt``) and scheduler state of a checkpoint.

    Raises:
        CheckpointError: no optimizer state, state of the other optimizer kind (distributed or
            not), or state that does not fit this model.
    """
    if "optimizer" not in sd:
        raise CheckpointError(f"{name} holds no optimizer state (saved with "
                              "--no-save-optim?): pass --no-load-optim or --finetune")
    distrib_file = name.with_name(DISTRIB_OPTIM_FILENAME)
    saved_distributed = getattr(sd.get("args"), "use_distributed_optimizer", None)
    if saved_distributed is None:
        saved_distributed = distrib_file.is_file()
    ours = cfg.parallel.use_distributed_optimizer
    if bool(saved_distributed) != ours:
        how = ("with --use-distributed-optimizer (its per-parameter state is in "
               f"{DISTRIB_OPTIM_FILENAME})") if saved_distributed else \
            "without --use-distributed-optimizer"
        raise CheckpointError(
            f"{name} was saved {how}, and this run "
            f"{'uses' if ours else 'does not use'} it: its optimizer state does not load here; "
            f"{'drop' if ours else 'add'} --use-distributed-optimizer, convert the checkpoint "
            f"with {CONVERTER} --keep-optimizer-state "
            f"--{'' if ours else 'no-'}target-use-distributed-optimizer, or pass "
            "--no-load-optim to load the weights only")
    try:
        optimizer.load_state_dict(sd["optimizer"])
        if ours:
            # Every rank reads the gathered state and keeps its own shard (re-sharding when the
            # data-parallel size differs from the one that saved it).
            optimizer.load_parameter_state(_distrib_state(
                distrib_file, name, cfg, unverified, optimizer.has_expert_buffers))
    except (KeyError, ValueError, RuntimeError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"the optimizer state in {name} does not fit this run's "
                              f"optimizer ({type(err).__name__}: {err}); pass --no-load-optim "
                              "to load the weights only") from None
    if scheduler is not None:
        key = "opt_param_scheduler" if "opt_param_scheduler" in sd else "lr_scheduler"
        if key in sd:
            scheduler.load_state_dict(sd[key])


def _distrib_state(distrib_file: Path, name: Path, cfg, unverified: list[Path],
                   has_experts: bool):
    """This rank's ``distrib_optim.pt`` (beside its experts' file ``name``); on the expert grid
    the ``[dense, expert]`` parts the optimizer loads: the dense one from the file of this TP
    rank's data-parallel rank 0 (only that one holds it: EP rank TP rank // ETP's), and on a
    pipeline stage without MoE layers (``has_experts`` False) that file's dense dict alone."""
    if not parallel_state.has_expert_grid():
        return _read_verified(distrib_file, cfg, unverified)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dense_ep = dense_expert_rank(tp_rank, parallel_state.get_tensor_model_parallel_world_size(),
                                 cfg.parallel.expert_tensor_parallel_size)
    first = name.parent.parent / shard_dir_name(
        tp_rank, parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size() > 1, dense_ep, True) \
        / DISTRIB_OPTIM_FILENAME
    dense = _read_verified(first, cfg, unverified)
    if not has_experts:
        return dense
    own = dense if first == distrib_file else _read_verified(distrib_file, cfg, unverified)
    if not isinstance(dense, list) or not isinstance(own, list) or len(dense) != 2 or \
            len(own) != 2:
        raise CheckpointError(f"{first} / {distrib_file}: not the [dense, expert] lists of an "
                              "expert-parallel distributed optimizer checkpoint")
    return [dense[0], own[1]]


# QKV row order by checkpoint_version: the conversion itself is in megatron.checkpointing.
def _checkpoint_version(sd: dict, name: Path) -> float:
    version = checkpoint_version(sd)
    if version is None:
        # Megatron-LM reads a missing version as 0 (its oldest QKV order) as well.
        warn_rank_0(f"{name} has no checkpoint_version: reading it as version 0 (QKV rows "
                    "[3, np, hn]), as Megatron-LM does")
        return 0.0
    return version


def _fix_qkv_ordering(sd: dict, name: Path, cfg) -> None:
    """Megatron-LM's ``fix_query_key_value_ordering`` with this run's heads and TP size."""
    version = _checkpoint_version(sd, name)
    if version >= 2.0:
        return
    converted = fix_query_key_value_ordering(sd, version, cfg.model.num_attention_heads,
                                             cfg.parallel.tensor_model_parallel_size, str(name))
    log_rank_0(f"  converted {converted} QKV tensors of {name} from checkpoint version "
               f"{version} to the [np, 3, hn] row order")


def _load_model_chunks(model: Sequence[torch.nn.Module], sd: dict, strict: bool,
                       name: Path) -> None:
    keys = ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]
    for chunk, key in zip(model, keys):
        if key not in sd:
            raise CheckpointError(f"{name} has no '{key}' entry")
        try:
            _unwrap(chunk).load_state_dict(sd[key], strict=strict)
        except (RuntimeError, KeyError, ValueError) as err:
            raise CheckpointError(f"model weights in {name} do not fit this model: {err}") \
                from None

