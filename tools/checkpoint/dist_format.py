"""``convert.py --source-ckpt-format / --target-ckpt-format torch_dist``: Megatron-Core's
``torch_dist`` directory <-> a TP1.PP1 ``--ckpt-format torch`` checkpoint, which the megatron
loader and saver then re-split as usual.

The model weights, ``args`` and ``iteration`` are carried (the key table of
``megatron.checkpointing.dist.keys``; the stacked ``decoder.layers.*`` tensors split into one
per layer, MoE experts into one per layer and expert, and back); the optimizer state is not (``--keep-optimizer-state`` is refused with
``torch_dist`` on either side). Writing runs DCP in a world of one process (a gloo group on an
in-memory store: nothing listens on a port).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.checkpointing import (CheckpointError, checkpoint_dir, checkpoint_name,
                                    load_checkpoint_file, nest_model_state, parse_tracker,
                                    publish_tracker, save_file, tracker_path)
from megatron.checkpointing.dist import storage
from megatron.checkpointing.dist.keys import (HEAD_COPY_KEY, Placement, extra_state_keys,
                                              gpt_rules, model_chunks)
from megatron.checkpointing.versions import CHECKPOINT_VERSION
from megatron.core.checkpoint_keys import flatten_checkpoint_state_dict


def _iteration_dir(root: Path) -> tuple[Path, int, bool]:
    """(iteration directory, iteration, release) of a --save root or an iteration directory."""
    tracked = parse_tracker(tracker_path(root))
    if tracked is None:
        return root, 0, root.name == "release"
    return checkpoint_dir(root, *tracked), tracked[0], tracked[1]


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


def legacy_to_torch_dist(source_root: Path, target_root: Path) -> Path:
    """A TP1.PP1 torch-format checkpoint -> a torch_dist one under ``target_root`` (with its
    tracker); returns the iteration directory.

    Raises:
        CheckpointError: the source is not TP1.PP1 or has tensors without a Megatron-Core name.
    """
    iter_dir, iteration, release = _iteration_dir(Path(source_root))
    sd = load_checkpoint_file(checkpoint_name(source_root, iteration, release))
    args = sd.get("args")
    flat = flatten_checkpoint_state_dict(sd["model"])
    flat.pop(HEAD_COPY_KEY, None)  # one stage: the embedding itself is the head's weight
    placement = Placement(num_layers=args.num_layers,
                          num_experts=getattr(args, "num_experts", None) or 0)
    tensors = model_chunks(flat, gpt_rules(bool(getattr(args, "swiglu", False))), placement)
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": sd.get("iteration", iteration)}
    objects: dict = {storage.COMMON_STATE_KEY: common}
    objects.update(dict.fromkeys(extra_state_keys(placement, args.num_layers, flat)))
    out = checkpoint_dir(target_root, iteration, release)
    with _one_process_world():
        storage.finish(out, storage.save(out, tensors, objects))
    _publish(Path(target_root), iteration, release, out)
    return out


def _publish(root: Path, iteration: int, release: bool, iteration_dir: Path) -> None:
    if release:
        tracker_path(root).write_text("release")
    else:
        publish_tracker(root, iteration, iteration_dir)


def torch_dist_to_legacy(source: Path, target_root: Path) -> Path:
    """A torch_dist checkpoint (a --save root or an iteration directory) -> a TP1.PP1
    torch-format checkpoint under ``target_root``; returns ``target_root``.

    Raises:
        CheckpointError: no args in its common state, or tensors the key table does not know.
    """
    iter_dir, iteration, release = _iteration_dir(Path(source))
    common = storage.read_common_state(iter_dir)
    args = common.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{iter_dir} holds no args (the model's flags): it cannot be "
                              "converted without them")
    iteration = int(common.get("iteration", iteration))
    global_tensors = storage.read_plain_tensors(iter_dir)
    flat = _legacy_names(global_tensors, bool(getattr(args, "swiglu", False)), iter_dir)
    args = copy.copy(args)
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.expert_model_parallel_size = 1  # the global expert tensors: every expert whole
    args.num_layers_per_virtual_pipeline_stage = None
    args.use_distributed_optimizer = False
    sd = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
          "model": nest_model_state(flat)}
    save_file(sd, checkpoint_name(target_root, iteration, release))
    _publish(Path(target_root), iteration, release, checkpoint_dir(target_root, iteration,
                                                                     release))
    return Path(target_root)


def _legacy_names(global_tensors: dict[str, torch.Tensor], swiglu: bool,
                  where: Path) -> dict[str, torch.Tensor]:
    """Megatron-Core's global tensors -> our TP1 names (stacked layers split)."""
    by_mcore = {}
    for rule in gpt_rules(swiglu):
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
    return _checkpoint_order(flat, swiglu)


def _checkpoint_order(flat: dict[str, torch.Tensor], swiglu: bool) -> dict[str, torch.Tensor]:
    """The order Megatron-LM's modules hold (and its checkpoints list) the tensors: the
    embedding, then layer by layer in the table's order, then the head."""
    rules = gpt_rules(swiglu)
    layers = 1 + max((int(k.split(".layers.")[1].split(".")[0]) for k in flat
                      if ".layers." in k), default=-1)
    order = [r.ours for r in rules if not r.stacked]
    head = order[len([r for r in rules if r.mcore.startswith("embedding.")]):]
    order = order[:len(order) - len(head)]
    experts = 1 + max((int(k.split(".local_experts.")[1].split(".")[0]) for k in flat
                       if ".local_experts." in k), default=-1)
    order += [name for i in range(layers) for r in rules if r.stacked
              for name in ([r.ours.format(layer=i)] if r.stacked == 1 else
                           [r.ours.format(layer=i, expert=e) for e in range(experts)])]
    order += head
    return {k: flat[k] for k in order if k in flat}
