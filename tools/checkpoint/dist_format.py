"""``convert.py --source-ckpt-format / --target-ckpt-format torch_dist``: Megatron-Core's
``torch_dist`` directory <-> a TP1.PP1 ``--ckpt-format torch`` checkpoint, which the megatron
loader and saver then re-split as usual.

GPT and (``--model-type BERT``) BERT, whose layers Megatron-Core stacks under ``encoder.``.
The model weights, ``args``, ``iteration``, the RNG states of the first (PP, TP) position and
the floating-point operation count are carried (the key table of
``megatron.checkpointing.dist.keys``; the stacked ``decoder.layers.*`` tensors split into one
per layer, MoE experts into one per layer and expert, and back). With ``--keep-optimizer-state``
so is the optimizer state: each ``optimizer.state.<name>.<Megatron-Core key>`` tensor (Adam's
moments, SGD's momentum, ``fp32_param`` the main params) goes through the same table as its
parameter, into the TP1.PP1 shard's plain or distributed optimizer layout
(``tools.checkpoint.optimizer_state``; ``fp32_param`` is its ``param``), and back; the param
groups with the step count, the grad scaler and the LR scheduler as they are. Writing runs DCP
in a world of one process (a gloo group on an in-memory store: nothing listens on a port).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.checkpointing import (DISTRIB_OPTIM_FILENAME, CheckpointError, checkpoint_dir,
                                    checkpoint_name, load_checkpoint_file, nest_model_state,
                                    parse_tracker, publish_tracker, save_file, tracker_path)
from megatron.checkpointing.dist import storage
from megatron.checkpointing.dist.keys import (BERT_OUTPUT_EXTRA_STATE, DECODER, ENCODER,
                                              HEAD_COPY_KEY, LANGUAGE_MODEL, KeyRule,
                                              Placement, bert_rules, extra_state_keys,
                                              gpt_rules, model_chunks)
from megatron.checkpointing.dist.optimizer import MAIN as DIST_MAIN
from megatron.checkpointing.dist.optimizer import PREFIX as OPTIMIZER_PREFIX
from megatron.checkpointing.dist.training import RNG_STATE
from megatron.checkpointing.versions import CHECKPOINT_VERSION
from megatron.core.checkpoint_keys import flatten_checkpoint_state_dict
from tools.checkpoint import optimizer_state

FLOPS = "num_floating_point_operations_so_far"


def _iteration_dir(root: Path) -> tuple[Path, int, bool]:
    """(iteration directory, iteration, release) of a --save root or an iteration directory."""
    tracked = parse_tracker(tracker_path(root))
    if tracked is None:
        return root, 0, root.name == "release"
    return checkpoint_dir(root, *tracked), tracked[0], tracked[1]


def key_rules(family: str, args) -> tuple[KeyRule, ...]:
    """The key table of ``--model-type`` ``family`` (GPT or BERT)."""
    swiglu = bool(getattr(args, "swiglu", False))
    return bert_rules(swiglu) if family == "BERT" else gpt_rules(swiglu)


@contextlib.contextmanager
def _one_process_world():
    """A world of this process alone, for DCP's collectives (torn down after, if made here)."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if made:
            dist.destroy_process_group()


def legacy_to_torch_dist(source_root: Path, target_root: Path, family: str = "GPT") -> Path:
    """A TP1.PP1 torch-format checkpoint -> a torch_dist one under ``target_root`` (with its
    tracker); returns the iteration directory. Its optimizer state, when it holds one, is
    written in the reshardable ``optimizer.state.*`` form.

    Raises:
        CheckpointError: the source is not TP1.PP1 or has tensors without a Megatron-Core name.
    """
    iter_dir, iteration, release = _iteration_dir(Path(source_root))
    path = checkpoint_name(source_root, iteration, release)
    sd = load_checkpoint_file(path)
    args = sd.get("args")
    flat = flatten_checkpoint_state_dict(sd["model"])
    flat.pop(HEAD_COPY_KEY, None)  # one stage: the embedding itself is the head's weight
    placement = Placement(num_layers=args.num_layers,
                          num_experts=getattr(args, "num_experts", None) or 0)
    rules = key_rules(family, args)
    tensors = model_chunks(flat, rules, placement)
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": sd.get("iteration", iteration)}
    if FLOPS in sd:
        common[FLOPS] = sd[FLOPS]
    objects: dict = {storage.COMMON_STATE_KEY: common}
    objects.update(dict.fromkeys(extra_state_keys(placement, args.num_layers, flat,
                                                  ENCODER if family == "BERT" else DECODER)))
    if family == "BERT":
        objects[BERT_OUTPUT_EXTRA_STATE] = None
    if sd.get("rng_state"):
        # The position (PP 0, TP 0) of a TP1.PP1 layout: loaded at that layout only.
        objects[storage.object_key(RNG_STATE, (0, 0), (1, 1))] = sd["rng_state"]
    if sd.get("optimizer"):
        state, head, scheduler = _legacy_optimizer(sd, args, flat, path)
        common["optimizer"] = head
        if scheduler is not None:
            common["opt_param_scheduler"] = scheduler
        for name, per_key in state.items():
            stored = DIST_MAIN if name == optimizer_state.MAIN else name
            for key, chunks in model_chunks(per_key, rules, placement).items():
                tensors[OPTIMIZER_PREFIX + stored + "." + key] = chunks
    out = checkpoint_dir(target_root, iteration, release)
    with _one_process_world():
        storage.finish(out, storage.save(out, tensors, objects))
    _publish(Path(target_root), iteration, release, out)
    return out


def _legacy_optimizer(sd: dict, args, flat: dict[str, torch.Tensor], path: Path
                      ) -> tuple[dict[str, dict[str, torch.Tensor]], dict, dict | None]:
    """A TP1.PP1 shard's optimizer -> (``{state name: {model key: whole tensor}}``, the common
    state's ``optimizer`` entry, the LR scheduler's state). The main params are written as a
    training save writes them: with the distributed optimizer or half-precision weights (an
    fp32 run's plain optimizer steps the weights themselves)."""
    distrib_path = path.with_name(DISTRIB_OPTIM_FILENAME)
    desc = optimizer_state.describe(sd, args, path, distrib_path)
    distrib = load_checkpoint_file(distrib_path) if desc.distributed else None
    state = optimizer_state.read_shard(sd, [flat], desc, distrib, path)[0]
    for name in desc.state_keys:  # before the first step: Adam's zeros, as a save writes them
        state.setdefault(name, {k: torch.zeros(v.shape, dtype=torch.float32, device="cpu")
                                for k, v in flat.items()})
    if desc.distributed or desc.mixed_precision:
        state.setdefault(optimizer_state.MAIN, {k: v.float() for k, v in flat.items()})
    return state, optimizer_state.common_head(desc, [flat]), desc.scheduler


def _publish(root: Path, iteration: int, release: bool, iteration_dir: Path) -> None:
    if release:
        tracker_path(root).write_text("release")
    else:
        publish_tracker(root, iteration, iteration_dir)


def torch_dist_to_legacy(source: Path, target_root: Path, keep_optimizer: bool = False,
                         family: str = "GPT") -> Path:
    """A torch_dist checkpoint (a --save root or an iteration directory) -> a TP1.PP1
    torch-format checkpoint under ``target_root``; returns ``target_root``. ``keep_optimizer``:
    with its optimizer state, in the source's optimizer layout (plain or distributed).

    Raises:
        CheckpointError: no args in its common state, tensors the key table does not know, or
            (``keep_optimizer``) no optimizer state.
    """
    iter_dir, iteration, release = _iteration_dir(Path(source))
    common = storage.read_common_state(iter_dir)
    args = common.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{iter_dir} holds no args (the model's flags): it cannot be "
                              "converted without them")
    iteration = int(common.get("iteration", iteration))
    global_tensors = storage.read_plain_tensors(iter_dir)
    rules = key_rules(family, args)
    flat = _legacy_names(global_tensors, rules, iter_dir)
    args = copy.copy(args)
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.expert_model_parallel_size = 1  # the global expert tensors: every expert whole
    if getattr(args, "expert_tensor_parallel_size", None) is not None:
        args.expert_tensor_parallel_size = 1  # ... and unsplit, as the TP 1 dense layers
    args.num_layers_per_virtual_pipeline_stage = None
    args.virtual_pipeline_model_parallel_size = None
    if not keep_optimizer:
        args.use_distributed_optimizer = False
    sd = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
          "model": nest_model_state(flat)}
    if FLOPS in common:
        sd[FLOPS] = common[FLOPS]
    rng = _first_rng_state(iter_dir)
    if rng is not None:
        sd["rng_state"] = rng
    name = checkpoint_name(target_root, iteration, release)
    if keep_optimizer:
        distrib = _add_legacy_optimizer(sd, args, common, flat, global_tensors, rules,
                                        iter_dir)
        if distrib is not None:
            save_file(distrib, name.with_name(DISTRIB_OPTIM_FILENAME))
    save_file(sd, name)
    _publish(Path(target_root), iteration, release, checkpoint_dir(target_root, iteration,
                                                                     release))
    return Path(target_root)


def _first_rng_state(iter_dir: Path) -> list | None:
    """The RNG states of (PP 0, TP 0) (one per data-parallel rank), or None (--no-save-rng)."""
    metadata = storage.read_metadata(iter_dir)
    key = next((k for k in metadata.state_dict_metadata
                if k.startswith(RNG_STATE + "/shard_0.0_")), None)
    return None if key is None else storage.read_objects(iter_dir, metadata, [key])[key]


def _add_legacy_optimizer(sd: dict, args, common: dict, flat: dict[str, torch.Tensor],
                          global_tensors: dict[str, torch.Tensor], rules: tuple[KeyRule, ...],
                          where: Path) -> dict | None:
    """The torch_dist optimizer state into the TP1.PP1 shard ``sd`` (``optimizer``,
    ``opt_param_scheduler``); returns its ``distrib_optim.pt`` with the distributed optimizer.

    Raises:
        CheckpointError: the checkpoint holds no optimizer state, or not for every parameter.
    """
    if "optimizer" not in common:
        raise CheckpointError(f"--keep-optimizer-state: {where} holds no optimizer state (saved "
                              "with --no-save-optim?); convert without --keep-optimizer-state "
                              "and resume with --no-load-optim")
    # Its common entry is the distributed optimizer's state_dict() for either optimizer.
    as_distributed = copy.copy(args)
    as_distributed.use_distributed_optimizer = True
    desc = optimizer_state.describe({"optimizer": common["optimizer"],
                                     "opt_param_scheduler": common.get("opt_param_scheduler")},
                                    as_distributed, where, where / DISTRIB_OPTIM_FILENAME)
    desc.distributed = bool(getattr(args, "use_distributed_optimizer", False))
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in global_tensors.items():
        if key.startswith(OPTIMIZER_PREFIX):
            name, mcore = key[len(OPTIMIZER_PREFIX):].split(".", 1)
            name = optimizer_state.MAIN if name == DIST_MAIN else name
            by_name.setdefault(name, {})[mcore] = tensor
    needed = desc.tensor_keys if desc.num_steps else \
        (optimizer_state.MAIN,) if desc.mixed_precision else ()
    states = {}
    for name in needed:
        per_key = _legacy_names(by_name.get(name, {}), rules, where)
        lacking = [k for k in flat if k not in per_key]
        if lacking:
            raise CheckpointError(f"--keep-optimizer-state: {where} holds no optimizer "
                                  f"{name} of {', '.join(lacking[:3])}"
                                  f"{' ...' if len(lacking) > 3 else ''}")
        states[name] = per_key
    if desc.scheduler is not None:
        sd["opt_param_scheduler"] = desc.scheduler
    if desc.distributed:
        target = optimizer_state.target_of(desc, args, True)
        sd["optimizer"], distrib = optimizer_state.write_distributed(desc, target, [flat],
                                                                     [states])
        return distrib
    sd["optimizer"] = optimizer_state.write_plain(desc, [flat], [states])
    return None


def _legacy_names(global_tensors: dict[str, torch.Tensor], rules: tuple[KeyRule, ...],
                  where: Path) -> dict[str, torch.Tensor]:
    """Megatron-Core's global tensors -> our TP1 names (stacked layers split)."""
    by_mcore = {}
    for rule in rules:
        if rule.ours != HEAD_COPY_KEY:
            by_mcore.setdefault(rule.mcore, rule)
    flat: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in global_tensors.items():
        if key.startswith("optimizer."):
            continue
        rule = by_mcore.get(key)
        if rule is None:
            unknown.append(key)
            continue
        if rule.stacked == 2:  # MoE experts: [layers, experts, ...]
            for layer in range(tensor.shape[0]):
                for expert in range(tensor.shape[1]):
                    flat[rule.ours.format(layer=layer, expert=expert)] = \
                        tensor[layer, expert].clone()
        elif rule.stacked:
            for layer in range(tensor.shape[0]):
                flat[rule.ours.format(layer=layer)] = tensor[layer].clone()
        else:
            flat[rule.ours] = tensor
    if unknown:
        raise CheckpointError(f"{where} holds tensors the torch_dist converter cannot name: "
                              f"{', '.join(sorted(unknown))}")
    return _checkpoint_order(flat, rules)


def _checkpoint_order(flat: dict[str, torch.Tensor], rules: tuple[KeyRule, ...]
                      ) -> dict[str, torch.Tensor]:
    """The order Megatron-LM's modules hold (and its checkpoints list) the tensors: the
    embedding, then layer by layer in the table's order, then the head."""
    layers = 1 + max((int(k.split(".layers.")[1].split(".")[0]) for k in flat
                      if ".layers." in k), default=-1)
    unstacked = [r.ours for r in rules if not r.stacked]
    order = [k for k in unstacked if k.startswith(LANGUAGE_MODEL + "embedding.")]
    head = [k for k in unstacked if k not in order]
    experts = 1 + max((int(k.split(".local_experts.")[1].split(".")[0]) for k in flat
                       if ".local_experts." in k), default=-1)
    order += [name for i in range(layers) for r in rules if r.stacked
              for name in ([r.ours.format(layer=i)] if r.stacked == 1 else
                           [r.ours.format(layer=i, expert=e) for e in range(experts)])]
    order += head
    return {k: flat[k] for k in order if k in flat}
