"""Optimizer state through a conversion (``convert.py --keep-optimizer-state``).

The three layouts a Megatron checkpoint stores the optimizer in (``megatron.core.optimizer``):

* plain fp32 (``FP32Optimizer``): ``sd["optimizer"]`` is the torch optimizer's state dict, the
  per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``; SGD: ``momentum_buffer``) keyed
  by the parameter's index in the param groups;
* plain fp16 / bf16 (``Float16OptimizerWithFloat16Params``): ``{"optimizer": torch state dict,
  "grad_scaler", "fp32_from_fp16_params": [[fp32 main param, ...] per group]}``;
* distributed (``--use-distributed-optimizer``): ``sd["optimizer"]`` keeps the param groups
  (with the step count) and the grad scaler; ``distrib_optim.pt`` beside it holds the whole DP
  world's flat buffers ``{chunk: {grad dtype: {"param", "exp_avg", "exp_avg_sq"}}}`` with the
  parameters' ranges. With expert parallelism it is Megatron-LM's ``[dense, expert]`` list:
  the dense buffers' state in EP rank 0's file (None in the others), each EP rank's experts'
  buffers in its own.

Between loader and saver the state is described per parameter, like the weights: for each
state key (``exp_avg``..., and :data:`MAIN` for the fp32 main params of mixed precision) a dict
of *whole* tensors under the model keys, which the checkpoint layout splits over TP ranks as it
splits the parameter (Adam's moments are elementwise, so they follow the parameter's split).
The global parts (step count, group options, grad scaler, LR scheduler) are carried as they are.

A parameter's index in the torch optimizer comes from the model's parameter order
(:func:`parameter_order`) and Megatron's two param groups (weight decay first; biases and 1-D
tensors without), as ``megatron.core.optimizer.get_param_groups`` builds them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.experts import expert_of
from megatron.core.checkpoint_keys import HEAD_COPY_WEIGHT
from megatron.core.distributed.grad_buffer import compute_layout

MAIN = "param"
"""The fp32 main params' state key (``distrib_optim.pt``'s name)."""
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
SGD_KEYS = ("momentum_buffer",)
DECAY, NO_DECAY = "decay", "no_decay"


# The model's parameter order -------------------------------------------------------------------
def parameter_order(keys: Sequence[str]) -> list[str]:
    """A model chunk's parameters in ``named_parameters()`` order, from its checkpoint keys in
    checkpoint order (``state_dict_for_save_checkpoint``): the same, except that the last
    stage's tied-embedding copy is registered right after the language model, before BERT's
    heads (which the checkpoint writes before it). The model holds no buffers."""
    def section(key: str) -> int:
        if key.startswith("language_model."):
            return 0
        return 1 if key == HEAD_COPY_WEIGHT else 2
    return sorted(keys, key=section)  # stable: the checkpoint order within a section


def group_kind(key: str, tensor: torch.Tensor) -> str:
    """Megatron's weight-decay split: no decay for biases and 1-D parameters (norms)."""
    return NO_DECAY if key.endswith(".bias") or tensor.dim() == 1 else DECAY


def param_groups(chunks: Sequence[Mapping[str, torch.Tensor]]
                 ) -> list[tuple[str, list[tuple[int, str]]]]:
    """The torch optimizer's param groups over a rank's model chunks: ``[(kind, [(chunk index,
    key), ...])]``, decay group first, empty groups dropped (``get_param_groups``)."""
    members: dict[str, list[tuple[int, str]]] = {DECAY: [], NO_DECAY: []}
    for index, flat in enumerate(chunks):
        for key in parameter_order(list(flat)):
            members[group_kind(key, flat[key])].append((index, key))
    return [(kind, members[kind]) for kind in (DECAY, NO_DECAY) if members[kind]]


# What a conversion carries ---------------------------------------------------------------------
@dataclass
class OptimizerDescription:
    """The source's optimizer, apart from its per-parameter tensors."""

    distributed: bool
    """Saved by the distributed optimizer."""
    mixed_precision: bool
    """fp16 / bf16 weights with fp32 main params (:data:`MAIN` is carried)."""
    state_keys: tuple[str, ...]
    """Per-parameter tensors besides the main param (none before the first step)."""
    num_steps: int
    group_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Options of the decay / no-decay group (lr, betas, eps, weight_decay, wd_mult...)."""
    grad_scaler: dict | None = None
    scheduler: dict | None = None
    """``opt_param_scheduler`` (Megatron's LR / weight-decay scheduler)."""

    @property
    def tensor_keys(self) -> tuple[str, ...]:
        return ((MAIN,) if self.mixed_precision else ()) + self.state_keys


def _kind_of_groups(groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """Which saved group is which: by ``wd_mult`` where saved, else Megatron's order."""
    if all("wd_mult" in g for g in groups):
        return [NO_DECAY if float(g["wd_mult"]) == 0.0 else DECAY for g in groups]
    return [DECAY, NO_DECAY][:len(groups)] if len(groups) == 2 else [DECAY]


def _torch_state(sd: dict, distributed: bool, mixed: bool) -> dict:
    """The torch-optimizer part of ``sd["optimizer"]`` (param groups, state)."""
    optimizer = sd["optimizer"]
    return optimizer["optimizer"] if (distributed or mixed) else optimizer


def describe(sd: dict, args, path: Path, distrib_file: Path) -> OptimizerDescription:
    """The global part of a shard's optimizer state.

    Raises:
        CheckpointError: the shard holds no optimizer state.
    """
    optimizer = sd.get("optimizer")
    distributed = bool(getattr(args, "use_distributed_optimizer", False)) or distrib_file.is_file()
    if not optimizer or (not distributed and not optimizer.get("param_groups")
                         and "optimizer" not in optimizer):
        raise CheckpointError(f"--keep-optimizer-state: {path} holds no optimizer state (saved "
                              "with --no-save-optim?); convert without --keep-optimizer-state "
                              "and resume with --no-load-optim")
    mixed = bool(getattr(args, "fp16", False) or getattr(args, "bf16", False))
    if not distributed and mixed != ("fp32_from_fp16_params" in optimizer):
        raise CheckpointError(f"{path}: the optimizer state does not match the precision in its "
                              f"args (fp16/bf16: {mixed})")
    torch_sd = _torch_state(sd, distributed, mixed)
    groups = torch_sd["param_groups"]
    sgd = getattr(args, "optimizer", "adam") == "sgd"
    return OptimizerDescription(
        distributed=distributed, mixed_precision=mixed,
        state_keys=SGD_KEYS if sgd else ADAM_KEYS,
        num_steps=_num_steps(torch_sd, distributed),
        group_options={kind: {k: v for k, v in g.items() if k not in ("params", "step")}
                       for kind, g in zip(_kind_of_groups(groups), groups)},
        grad_scaler=optimizer.get("grad_scaler") if (distributed or mixed) else None,
        scheduler=sd.get("opt_param_scheduler", sd.get("lr_scheduler")))


def _num_steps(torch_sd: dict, distributed: bool) -> int:
    groups = torch_sd.get("param_groups", [])
    if distributed or any("step" in g for g in groups):  # ours / apex FusedAdam: per group
        return int(groups[0].get("step", 0)) if groups else 0
    steps = [state["step"] for state in torch_sd.get("state", {}).values() if "step" in state]
    return int(max(float(s) for s in steps)) if steps else 0


# Reading one shard -----------------------------------------------------------------------------
def read_shard(sd: dict, chunks: Sequence[Mapping[str, torch.Tensor]], desc: OptimizerDescription,
               distrib: dict | None, path: Path) -> list[dict[str, dict[str, torch.Tensor]]]:
    """One TP rank's per-parameter state of a pipeline stage: per model chunk,
    ``{state key: {model key: tensor}}`` (this rank's slices, shaped as the parameters).

    Args:
        sd: the shard's ``model_optim_rng.pt``.
        chunks: the stage's model chunks' flat weights (checkpoint order).
        desc: what :func:`describe` found.
        distrib: the shard's ``distrib_optim.pt`` (distributed optimizer), else None.
        path: the shard (named in errors).

    Raises:
        CheckpointError: the state does not describe these parameters.
    """
    if desc.distributed:
        if distrib is None:
            raise CheckpointError(f"{path.with_name('distrib_optim.pt')} is missing: the "
                                  "distributed optimizer keeps its moments there")
        if isinstance(distrib, ExpertParallelDistrib):
            return [_merged_states(
                _read_distributed(distrib.dense, index, flat, desc, path, _is_dense),
                _read_distributed(distrib.expert, index, flat, desc, path, _is_expert))
                for index, flat in enumerate(chunks)]
        return [_read_distributed(distrib, index, flat, desc, path)
                for index, flat in enumerate(chunks)]
    return _read_plain(sd, chunks, desc, path)


def _is_dense(key: str) -> bool:
    return expert_of(key) is None


def _is_expert(key: str) -> bool:
    return expert_of(key) is not None


def _merged_states(*parts: dict[str, dict[str, torch.Tensor]]
                   ) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for part in parts:
        for name, tensors in part.items():
            out.setdefault(name, {}).update(tensors)
    return out


@dataclass(frozen=True)
class ExpertParallelDistrib:
    """One EP rank's distributed optimizer state: the dense part (EP rank 0's file) and its
    experts' part (its own file)."""

    dense: dict
    expert: dict


def expert_parallel_distrib(dense_file: Any, own_file: Any, path: Path) -> ExpertParallelDistrib:
    """The ``[dense, expert]`` lists of EP rank 0's and this EP rank's ``distrib_optim.pt``.

    Raises:
        CheckpointError: not such lists.
    """
    for value in (dense_file, own_file):
        if not isinstance(value, list) or len(value) != 2:
            raise CheckpointError(f"{path.with_name('distrib_optim.pt')}: an expert-parallel "
                                  "checkpoint's distributed optimizer state is a [dense, "
                                  f"expert] list, found {type(value).__name__}")
    if dense_file[0] is None or own_file[1] is None:
        raise CheckpointError(f"{path.with_name('distrib_optim.pt')}: the dense part (EP rank "
                              "0's file) or this rank's expert part is missing")
    return ExpertParallelDistrib(dense_file[0], own_file[1])


def _read_plain(sd: dict, chunks, desc: OptimizerDescription, path: Path):
    torch_sd = _torch_state(sd, False, desc.mixed_precision)
    saved = torch_sd["param_groups"]
    groups = param_groups(chunks)
    if [len(g["params"]) for g in saved] != [len(m) for _, m in groups]:
        raise CheckpointError(
            f"{path}: the optimizer's param groups hold {[len(g['params']) for g in saved]} "
            f"parameters, the model {[len(m) for _, m in groups]}: the state does not belong "
            "to these weights")
    mains = sd["optimizer"].get("fp32_from_fp16_params") if desc.mixed_precision else None
    out: list[dict[str, dict[str, torch.Tensor]]] = [
        {k: {} for k in desc.tensor_keys} for _ in chunks]
    for g, (_, members) in enumerate(groups):
        for j, (chunk, key) in enumerate(members):
            shape = chunks[chunk][key].shape
            state = torch_sd.get("state", {}).get(saved[g]["params"][j], {})
            for name in desc.state_keys if desc.num_steps else ():
                out[chunk][name][key] = _shaped(state.get(name), shape, key, name, path)
            if mains is not None:
                out[chunk][MAIN][key] = _shaped(mains[g][j], shape, key, MAIN, path)
    return out


def _shaped(value, shape: torch.Size, key: str, name: str, path: Path) -> torch.Tensor:
    if value is None:
        return torch.zeros(shape, dtype=torch.float32, device="cpu")  # no gradient yet: Adam's zeros
    if value.numel() != shape.numel():
        raise CheckpointError(f"{path}: the optimizer's {name} of {key} has {value.numel()} "
                              f"elements, the parameter {tuple(shape)}")
    return value.reshape(shape)


def _read_distributed(distrib: dict, index: int, flat: Mapping[str, torch.Tensor],
                      desc: OptimizerDescription, path: Path,
                      select=None) -> dict[str, dict[str, torch.Tensor]]:
    """One chunk's state from one buffer per chunk, holding the parameters ``select`` picks
    (all: None) in module order."""
    per_dtype = distrib.get(index)
    if not per_dtype or len(per_dtype) != 1:
        raise CheckpointError(f"{path.with_name('distrib_optim.pt')}: model chunk {index} has "
                              f"{len(per_dtype or {})} grad buffers (one expected)")
    (dtype, buffers), = per_dtype.items()
    order = [k for k in parameter_order(list(flat)) if select is None or select(k)]
    layout = distrib.get("layout", {}).get(index, {}).get(dtype)
    numels = [flat[k].numel() for k in order]
    ranges = [tuple(r) for r in layout["param_ranges"]] if layout else \
        [(r.start, r.end) for r in compute_layout(numels, None, 1)[0]]
    if [end - start for start, end in ranges] != numels:
        raise CheckpointError(f"{path.with_name('distrib_optim.pt')}: model chunk {index} holds "
                              f"{len(ranges)} parameters, the weights {len(numels)}: it does "
                              "not belong to these weights")
    out: dict[str, dict[str, torch.Tensor]] = {}
    names = (MAIN,) + (desc.state_keys if desc.num_steps else ())
    for name in names:
        if name not in buffers:
            raise CheckpointError(f"{path.with_name('distrib_optim.pt')} holds no {name}")
        out[name] = {key: buffers[name][start:end].view(flat[key].shape)
                     for key, (start, end) in zip(order, ranges)}
    if not desc.mixed_precision:
        del out[MAIN]  # fp32: the main params are the weights themselves
    return out


# Writing one shard -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """What the saver writes."""

    distributed: bool
    grad_dtype: torch.dtype
    """The distributed optimizer's grad-buffer dtype (``distrib_optim.pt``'s key)."""


def target_of(desc: OptimizerDescription, args, distributed: bool | None) -> Target:
    """The target layout: distributed or not as asked (default: as the source)."""
    fp32_grads = bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False))
    dtype = getattr(args, "params_dtype", torch.float32)
    if not isinstance(dtype, torch.dtype) or fp32_grads:
        dtype = torch.float32
    return Target(desc.distributed if distributed is None else distributed, dtype)


def _state_tensor(states: Mapping[str, Mapping[str, torch.Tensor]], name: str, key: str,
                  weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    if name == MAIN and MAIN not in states:
        return weights[key].float()  # fp32 weights are their own main params
    return states[name][key]


def write_plain(desc: OptimizerDescription, chunks: Sequence[Mapping[str, torch.Tensor]],
                states: Sequence[Mapping[str, Mapping[str, torch.Tensor]]]) -> dict:
    """``sd["optimizer"]`` of a plain (fp32 or fp16/bf16) optimizer for one target shard.

    Args:
        chunks: the shard's model chunks' flat weights (checkpoint order).
        states: per chunk, ``{state key: {model key: tensor}}`` (this rank's slices).
    """
    groups, state, mains = [], {}, []
    index = 0
    for kind, members in param_groups(chunks):
        ids = []
        for chunk, key in members:
            if desc.num_steps:
                # torch's Adam counts steps per parameter; SGD keeps no count.
                entry = {} if desc.state_keys == SGD_KEYS else \
                    {"step": torch.tensor(float(desc.num_steps), device="cpu")}
                for name in desc.state_keys:
                    entry[name] = states[chunk][name][key].contiguous()
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**_options(desc, kind), "params": ids})
        if desc.mixed_precision:
            mains.append([_state_tensor(states[c], MAIN, k, chunks[c]).contiguous()
                          for c, k in members])
    torch_sd = {"state": state, "param_groups": groups}
    if not desc.mixed_precision:
        return torch_sd
    out = {"optimizer": torch_sd}
    if desc.grad_scaler is not None:
        out["grad_scaler"] = desc.grad_scaler
    out["fp32_from_fp16_params"] = mains
    return out


def _options(desc: OptimizerDescription, kind: str) -> dict[str, Any]:
    if kind in desc.group_options:
        return dict(desc.group_options[kind])
    # The source's stage had no such group (e.g. no biases anywhere): the other's options
    # with Megatron's decay multiplier for this kind.
    other = dict(next(iter(desc.group_options.values())))
    other["wd_mult"] = 0.0 if kind == NO_DECAY else 1.0
    return other


def write_distributed(desc: OptimizerDescription, target: Target,
                      chunks: Sequence[Mapping[str, torch.Tensor]],
                      states: Sequence[Mapping[str, Mapping[str, torch.Tensor]]],
                      expert_parallel: bool = False, with_dense: bool = True
                      ) -> tuple[dict, Any]:
    """(``sd["optimizer"]``, ``distrib_optim.pt``) of the distributed optimizer for one
    target shard: the parameters back to back in module order (unpadded, Megatron-LM 23.06's
    world buffers), with their ranges, so that a run at any DP size re-shards them. With
    ``expert_parallel`` the ``[dense, expert]`` list (the dense part only ``with_dense``: EP
    rank 0)."""
    head = common_head(desc, chunks)
    if not expert_parallel:
        return head, _distrib_buffers(desc, target, chunks, states)
    dense = _distrib_buffers(desc, target, chunks, states, _is_dense) if with_dense else None
    return head, [dense, _distrib_buffers(desc, target, chunks, states, _is_expert)]


def common_head(desc: OptimizerDescription, chunks: Sequence[Mapping[str, torch.Tensor]]
                ) -> dict:
    """The optimizer's state apart from its per-parameter tensors, as the distributed optimizer's
    ``state_dict()`` holds it (and a ``torch_dist`` checkpoint's common state, for either
    optimizer): ``{"optimizer": {"param_groups": [options + "step"]}, "grad_scaler"}``."""
    groups = [{**_options(desc, kind), "step": desc.num_steps}
              for kind, _ in param_groups(chunks)]
    head: dict = {"optimizer": {"param_groups": groups}}
    if desc.grad_scaler is not None:
        head["grad_scaler"] = desc.grad_scaler
    return head


def _distrib_buffers(desc: OptimizerDescription, target: Target,
                     chunks: Sequence[Mapping[str, torch.Tensor]],
                     states: Sequence[Mapping[str, Mapping[str, torch.Tensor]]],
                     select=None) -> dict[Any, Any]:
    """One buffer per chunk over the parameters ``select`` picks (all: None)."""
    distrib: dict[Any, Any] = {"layout": {}}
    names = (MAIN,) + desc.state_keys
    for index, flat in enumerate(chunks):
        order = [k for k in parameter_order(list(flat)) if select is None or select(k)]
        ranges, _, numel = compute_layout([flat[k].numel() for k in order], None, 1)
        buffers = {name: torch.zeros(numel, dtype=torch.float32, device="cpu") for name in names}
        for key, prange in zip(order, ranges):
            for name in names:
                if name != MAIN and not desc.num_steps:
                    continue  # before the first step the moments are zeros
                value = _state_tensor(states[index], name, key, flat)
                buffers[name][prange.start:prange.end] = value.reshape(-1)
        distrib[index] = {target.grad_dtype: buffers}
        distrib["layout"][index] = {target.grad_dtype: {
            "param_ranges": [(r.start, r.end) for r in ranges], "numel": numel,
            "data_parallel_size": 1}}
    return distrib
