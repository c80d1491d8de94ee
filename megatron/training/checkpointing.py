"""Megatron-LM's checkpoint layout, written atomically and loaded without running code.

Layout (``--ckpt-format torch``)::

    <save>/latest_checkpointed_iteration.txt        iteration number, or "release"
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt         PP == 1: mp_rank_{tp:02d}
    <save>/iter_0000100/mp_rank_01_002/model_optim_rng.pt     PP > 1: mp_rank_{tp:02d}_{pp:03d}
    <save>/iter_0000100/mp_rank_00/distrib_optim.pt           --use-distributed-optimizer

Every file is written under a temporary name, synced, then renamed, and the directories holding
the renamed files are synced; the tracker file is rewritten the same way by global rank 0 after
every rank has finished (then the save root is synced), so a crash at any moment leaves the
previous checkpoint loadable and the tracker never points at a partial one.

Loading uses ``torch.load(weights_only=True)`` with an allowlist of the few types a Megatron-LM
checkpoint holds (``argparse.Namespace`` for ``args``, numpy's RNG state arrays, and Megatron's
enums such as ``args.model_type``, read as inert stand-ins), so a checkpoint that would run code
is refused with a clear error. Checkpoints older than version 2.0 have another QKV row order and
are converted on load (Megatron-LM's ``fix_query_key_value_ordering``).
"""

from __future__ import annotations

import argparse
import enum
import errno
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import comm, device, parallel_state
from megatron.core.log import log_rank_0, warn_rank_0
from megatron.core.tensor_parallel.random import get_rng_tracker

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"

# Architecture flags that must agree between a checkpoint and the run loading it.
_ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                      "kv_channels", "max_position_embeddings", "add_position_embedding",
                      "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
                      "untie_embeddings_and_output_weights", "add_bias_linear")
_PARALLEL_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, unsafe, or does not match the flags."""


# Names ----------------------------------------------------------------------------------------
def checkpoint_dir(root: str | os.PathLike, iteration: int, release: bool = False) -> Path:
    return Path(root) / ("release" if release else f"iter_{iteration:07d}")


def get_checkpoint_name(root: str | os.PathLike, iteration: int, release: bool = False,
                        pipeline_parallel: bool | None = None, tensor_rank: int | None = None,
                        pipeline_rank: int | None = None) -> Path:
    """Path of this rank's ``model_optim_rng.pt`` (Megatron's ``mp_rank_XX[_YYY]`` naming)."""
    if pipeline_parallel is None:
        pipeline_parallel = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    sub = f"mp_rank_{tensor_rank:02d}" + (f"_{pipeline_rank:03d}" if pipeline_parallel else "")
    return checkpoint_dir(root, iteration, release) / sub / MODEL_FILENAME


def get_checkpoint_tracker_filename(root: str | os.PathLike) -> Path:
    return Path(root) / TRACKER_FILENAME


# Safe loading ---------------------------------------------------------------------------------
class MegatronEnum(enum.Enum):
    """Inert stand-in for an enum Megatron-LM pickles into ``args`` (``args.model_type =
    ModelType.encoder_or_decoder``, ``args.attention_backend = AttnBackend.auto``...).

    Unpickling calls ``EnumClass(value)``; these classes only hold the value (unknown values of
    newer Megatron versions become pseudo-members), so nothing from Megatron-LM is imported or
    run, and the checks on load never read them.
    """

    @classmethod
    def _missing_(cls, value):
        member = object.__new__(cls)
        member._name_, member._value_ = f"unknown_{value}", value
        return member


def _stub_enum(name: str, members: str) -> type[MegatronEnum]:
    return MegatronEnum(name, [(m, i) for i, m in enumerate(members.split(), start=1)],
                        module=__name__)


# Megatron-LM's enums (23.06 and core_v0.13 values) under every module path they have lived at.
_MODEL_TYPE = _stub_enum("ModelType", "encoder_or_decoder encoder_and_decoder retro_encoder "
                                      "retro_decoder")
_LAYER_TYPE = _stub_enum("LayerType", "encoder decoder retro_encoder retro_decoder "
                                      "retro_decoder_with_retriever")
_ATTN_TYPE = _stub_enum("AttnType", "self_attn cross_attn")
_ATTN_MASK_TYPE = _stub_enum("AttnMaskType", "padding causal no_mask padding_causal arbitrary")
_ATTN_BACKEND = _stub_enum("AttnBackend", "flash fused unfused local auto")
_POSITION_EMBEDDING_TYPE = _stub_enum("PositionEmbeddingType", "rotary absolute")
_FP8_RECIPE = _stub_enum("Fp8Recipe", "delayed tensorwise mxfp8")
_MEGATRON_ENUMS = {
    "megatron.core.enums": {"ModelType": _MODEL_TYPE, "Fp8Recipe": _FP8_RECIPE},
    "megatron.core.transformer.enums": {
        "ModelType": _MODEL_TYPE, "LayerType": _LAYER_TYPE, "AttnType": _ATTN_TYPE,
        "AttnMaskType": _ATTN_MASK_TYPE, "AttnBackend": _ATTN_BACKEND},
    "megatron.model.enums": {
        "ModelType": _MODEL_TYPE, "LayerType": _LAYER_TYPE, "AttnType": _ATTN_TYPE,
        "AttnMaskType": _ATTN_MASK_TYPE, "PositionEmbeddingType": _POSITION_EMBEDDING_TYPE},
    "megatron.legacy.model.enums": {
        "LayerType": _LAYER_TYPE, "AttnType": _ATTN_TYPE, "AttnMaskType": _ATTN_MASK_TYPE},
}


def _safe_globals() -> list:
    """Types a Megatron-LM checkpoint legitimately pickles (none of them can run code)."""
    allowed: list = [argparse.Namespace]
    multiarray = getattr(np, "_core", None) or np.core
    allowed += [multiarray.multiarray._reconstruct, np.ndarray, np.dtype]
    allowed += [getattr(np.dtypes, name) for name in dir(np.dtypes) if name.endswith("DType")]
    # (stand-in, "module.Name"): torch resolves the pickled global by that name.
    allowed += [(stub, f"{module}.{name}") for module, stubs in _MEGATRON_ENUMS.items()
                for name, stub in stubs.items()]
    return allowed


def load_checkpoint_file(path: str | os.PathLike) -> dict:
    """``torch.load`` with ``weights_only=True`` plus the allowlist; clear errors otherwise.

    Raises:
        CheckpointError: missing, truncated/corrupt, or holding types outside the allowlist.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises several types; all mean "refused"
        text = str(err)
        if "Weights only load failed" in text or "Unsupported global" in text:
            # torch names the offending callable/class as "GLOBAL module.name"; the rest of its
            # message is boilerplate about the weights_only default.
            found = re.search(r"GLOBAL ([\w.]+)", text)
            what = found.group(1).rstrip(".") if found else "an unsupported type"
            raise CheckpointError(
                f"refusing to load {path}: it holds {what}, outside the allowlist of checkpoint "
                "types; loading it could run code. Only load checkpoints you trust through other "
                "means") from None
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: "
                              f"{text.splitlines()[0][:200]}") from None


# Tracker --------------------------------------------------------------------------------------
def read_tracker(root: str | os.PathLike) -> tuple[int, bool] | None:
    """(iteration, release) from the tracker file, agreed across ranks; None without one."""
    tracker = get_checkpoint_tracker_filename(root)
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        iteration, release = 0, True
    else:
        try:
            iteration, release = int(text), False
        except ValueError:
            raise CheckpointError(f"{tracker} should hold an iteration number or 'release', "
                                  f"found {text[:50]!r}") from None
    value = torch.tensor([iteration], dtype=torch.long)
    comm.all_reduce(value, None, op="max")
    if int(value) != iteration:
        warn_rank_0(f"ranks disagree on the iteration in {tracker}; using the largest, "
                    f"{int(value)}")
    return int(value), release


def _atomic_write(write, path: Path) -> None:
    """Write via ``write(tmp_path)``, fsync, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _atomic_torch_save(obj, path: Path) -> None:
    _atomic_write(lambda tmp: torch.save(obj, tmp), path)


def _fsync_dir(path: Path) -> None:
    """fsync a directory, so the renames and new entries in it survive a power loss.

    Skipped where directories cannot be opened (no ``os.O_DIRECTORY``, e.g. Windows) or synced
    (file systems answering EINVAL / ENOTSUP).
    """
    flag = getattr(os, "O_DIRECTORY", None)
    if flag is None:
        return
    fd = os.open(path, os.O_RDONLY | flag)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


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
    out: list = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(out, state, group=parallel_state.get_data_parallel_group())
    return out


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
    distributed optimizer every rank takes part in gathering ``distrib_optim.pt``.
    """
    root = Path(cfg.checkpoint.save)
    args = cfg.to_namespace()
    args.consumed_train_samples = consumed_train_samples
    args.consumed_valid_samples = consumed_valid_samples
    args.iteration = iteration
    rng_states = None if cfg.checkpoint.no_save_rng else \
        _gather_rng_states(cfg.model.data_parallel_random_init)
    name = get_checkpoint_name(root, iteration)
    distributed_optimizer = cfg.parallel.use_distributed_optimizer and optimizer is not None
    if distributed_optimizer and not cfg.checkpoint.no_save_optim:
        # Collective over the data-parallel group; DP rank 0 receives the gathered state.
        state = optimizer.save_parameter_state()
        if parallel_state.get_data_parallel_rank() == 0:
            _atomic_torch_save(state, name.with_name(DISTRIB_OPTIM_FILENAME))
    if parallel_state.get_data_parallel_rank() == 0:
        sd: dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": iteration,
                    "num_floating_point_operations_so_far": num_floating_point_operations_so_far}
        if len(model) == 1:
            sd["model"] = _model_state(model[0])
        else:
            for i, chunk in enumerate(model):
                sd[f"model{i}"] = _model_state(chunk)
        if optimizer is not None and not cfg.checkpoint.no_save_optim:
            sd["optimizer"] = optimizer.state_dict()
            if scheduler is not None:
                sd["opt_param_scheduler"] = scheduler.state_dict()
        if rng_states is not None:
            sd["rng_state"] = rng_states
        _atomic_torch_save(sd, name)
        _fsync_dir(name.parent)  # this shard's renames are durable
    comm.barrier()
    if dist.get_rank() == 0 if dist.is_initialized() else True:
        # Once, after every shard is in: the new mp_rank / iter directories are durable before
        # the tracker can point at them.
        for directory in (name.parent.parent, root):
            _fsync_dir(directory)
        _atomic_write(lambda tmp: tmp.write_text(str(iteration)),
                      get_checkpoint_tracker_filename(root))
        _fsync_dir(root)
    comm.barrier()
    log_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {root}")
    return checkpoint_dir(root, iteration)


# Load -----------------------------------------------------------------------------------------
def _check_compatible(ckpt_args: argparse.Namespace | None, cfg, path: Path) -> None:
    if ckpt_args is None:
        return
    ours = cfg.to_namespace()
    diffs = []
    for name in _PARALLEL_ARGS + _ARCHITECTURE_ARGS:
        theirs = getattr(ckpt_args, name, None)
        if theirs is None and name == "tensor_model_parallel_size":
            # checkpoint_version < 3.0 named the TP size model_parallel_size.
            theirs = getattr(ckpt_args, "model_parallel_size", None)
        mine = getattr(ours, name, None)
        if theirs is None or mine is None or theirs == mine:
            continue
        diffs.append(f"--{name.replace('_', '-')}: checkpoint {theirs}, flags {mine}")
    if diffs:
        raise CheckpointError(f"checkpoint {path} does not match this run:\n  "
                              + "\n  ".join(diffs)
                              + "\n(change the flags to the checkpoint's, or pass "
                                "--use-checkpoint-args; converting a checkpoint to other TP/PP "
                                "sizes is not available yet)")


def _find_any_shard(iter_dir: Path) -> Path | None:
    shards = sorted(iter_dir.glob(f"mp_rank_*/{MODEL_FILENAME}"))
    return shards[0] if shards else None


def read_checkpoint_args(load_dir: str | os.PathLike,
                         iteration: int | None = None) -> argparse.Namespace | None:
    """The ``args`` Namespace stored in a checkpoint (any shard), for --use-checkpoint-args."""
    tracked = read_tracker(load_dir) if iteration is None else (iteration, False)
    if tracked is None:
        return None
    shard = _find_any_shard(checkpoint_dir(load_dir, *tracked))
    return load_checkpoint_file(shard).get("args") if shard else None


def load_checkpoint(model: Sequence[torch.nn.Module], optimizer, scheduler, cfg,
                    load_dir: str | None = None, strict: bool = True) -> tuple[int, int, int]:
    """Load the latest (or ``--ckpt-step``) checkpoint of ``--load`` into the model and optimizer.

    Returns:
        (iteration, consumed_train_samples, consumed_valid_samples); zeros without a checkpoint.

    Raises:
        CheckpointError: corrupt, unsafe or mismatched checkpoint, or missing with
            --exit-on-missing-checkpoint.
    """
    ck = cfg.checkpoint
    root = Path(load_dir or ck.load)
    tracked = read_tracker(root)
    if ck.ckpt_step is not None:
        tracked = (ck.ckpt_step, False)
    if tracked is None:
        if ck.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {root} holds no {TRACKER_FILENAME} and "
                                  "--exit-on-missing-checkpoint is set")
        warn_rank_0(f"could not find {get_checkpoint_tracker_filename(root)}: starting from "
                    "random weights")
        return 0, 0, 0
    iteration, release = tracked
    name = get_checkpoint_name(root, iteration, release)
    if not name.is_file():
        shard = _find_any_shard(name.parent.parent)
        if shard is None:
            raise CheckpointError(f"checkpoint directory {name.parent.parent} has no "
                                  f"{MODEL_FILENAME} (incomplete save, or wrong --ckpt-step)")
        _check_compatible(load_checkpoint_file(shard).get("args"), cfg, shard)
        raise CheckpointError(f"checkpoint file {name} is missing")
    sd = load_checkpoint_file(name)
    _check_compatible(sd.get("args"), cfg, name)
    fix_query_key_value_ordering(sd, _checkpoint_version(sd, name), cfg, name)
    _load_model_chunks(model, sd, strict, name)

    if release or ck.finetune:
        iteration = 0
    else:
        iteration = int(sd.get("iteration", sd.get("total_iters", 0)))
    load_optim = not (release or ck.finetune or ck.no_load_optim)
    if load_optim and optimizer is not None:
        _load_optimizer(optimizer, scheduler, sd, cfg, name)
    elif optimizer is not None:
        # The optimizer was built before the load: its fp32 main params still hold the initial
        # weights, and the first step would copy them back over the loaded ones.
        optimizer.reload_model_params()
    if not (release or ck.finetune or ck.no_load_rng):
        _load_rng_state(sd, cfg, name)
    ckpt_args = sd.get("args")
    consumed_train = 0 if ck.finetune or release else \
        int(getattr(ckpt_args, "consumed_train_samples", 0))
    consumed_valid = 0 if ck.finetune or release else \
        int(getattr(ckpt_args, "consumed_valid_samples", 0))
    comm.barrier()
    log_rank_0(f"  successfully loaded checkpoint from {root} at iteration {iteration}")
    return iteration, consumed_train, consumed_valid


def _load_optimizer(optimizer, scheduler, sd: dict, cfg, name: Path) -> None:
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
            f"{'uses' if ours else 'does not use'} it: the optimizer states do not convert; "
            f"{'drop' if ours else 'add'} --use-distributed-optimizer, or pass --no-load-optim "
            "to load the weights only")
    try:
        optimizer.load_state_dict(sd["optimizer"])
        if ours:
            # Every rank reads the gathered state and keeps its own shard (re-sharding when the
            # data-parallel size differs from the one that saved it).
            optimizer.load_parameter_state(load_checkpoint_file(distrib_file))
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


# QKV row order by checkpoint_version (FORMATS.md 2d): 0 -> [3, np, hn], 1.0 -> [np, hn, 3],
# >= 2.0 -> [np, 3, hn] (what the attention reads); np, hn are this TP rank's heads / head size.
def _checkpoint_version(sd: dict, name: Path) -> float:
    if "checkpoint_version" not in sd:
        # Megatron-LM reads a missing version as 0 (its oldest QKV order) as well.
        warn_rank_0(f"{name} has no checkpoint_version: reading it as version 0 (QKV rows "
                    "[3, np, hn]), as Megatron-LM does")
        return 0.0
    return float(sd["checkpoint_version"])


def fix_query_key_value_ordering(sd: dict, version: float, cfg, name: Path) -> None:
    """Reorder the fused QKV rows of a checkpoint older than version 2.0, in place.

    Raises:
        CheckpointError: a version other than 0, 1.0 or >= 2.0.
    """
    if version >= 2.0:
        return
    if version not in (0.0, 1.0):
        raise CheckpointError(f"{name} has checkpoint_version {version}: only 0, 1.0 and "
                              ">= 2.0 exist (this run writes 3.0); the QKV row order is unknown")
    heads = cfg.model.num_attention_heads // cfg.parallel.tensor_model_parallel_size
    splits_first = version == 0.0
    converted = 0

    def walk(node: dict, prefix: str) -> None:
        nonlocal converted
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, path + ".")
            elif path.endswith((".query_key_value.weight", ".query_key_value.bias",
                                ".key_value.weight", ".key_value.bias")):
                splits = 3 if ".query_key_value." in path else 2
                if value.shape[0] % (splits * heads):
                    raise CheckpointError(
                        f"{path} in {name} has {value.shape[0]} rows, not a multiple of "
                        f"{splits} x {heads} heads per TP rank: check --num-attention-heads "
                        "and --tensor-model-parallel-size")
                node[key] = _reorder_rows(value, splits, heads, splits_first)
                converted += 1

    for key in [k for k in sd if k == "model" or re.fullmatch(r"model\d+", k)]:
        walk(sd[key], "")
    log_rank_0(f"  converted {converted} QKV tensors of {name} from checkpoint version "
               f"{version} to the [np, 3, hn] row order")


def _reorder_rows(t: torch.Tensor, splits: int, heads: int, splits_first: bool) -> torch.Tensor:
    """[splits*np*hn, ...] in order [splits, np, hn] (or [np, hn, splits]) -> [np, splits, hn]."""
    head_dim = t.shape[0] // (splits * heads)
    rest = tuple(t.shape[1:])
    if splits_first:
        out = t.view(splits, heads, head_dim, *rest).transpose(0, 1)  # [np, splits, hn, ...]
    else:
        out = t.view(heads, head_dim, splits, *rest).transpose(1, 2)  # [np, splits, hn, ...]
    return out.contiguous().view(t.shape)


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
