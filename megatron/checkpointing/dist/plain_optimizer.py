"""The state of the non-distributed optimizers (``FP32Optimizer``, the fp16/bf16
``Float16OptimizerWithFloat16Params``) in Megatron's reshardable ``torch_dist`` form, as
Megatron-Core's ``optimizer.sharded_state_dict`` writes it for them: per model parameter,
``optimizer.state.<name>.<Megatron-Core key>`` for ``name`` in ``exp_avg``, ``exp_avg_sq``
(SGD: ``momentum_buffer``) and, with half-precision parameters, ``fp32_param`` (the main
copy), with the parameter's own global shape and chunks. The param groups (with the step
count) and the grad scaler go to the common state under ``optimizer``.

Every data-parallel rank holds the whole (TP-local) state, so the chunks are views of it,
replicated over DP as the weights are, and a load reads into fresh tensors that become the
torch optimizer's state. A checkpoint so saved resumes at any TP / PP / DP layout, and with
the distributed optimizer too (the keys are the same).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.checkpointing.dist.keys import HEAD_COPY_KEY, Chunk, match, tensor_chunks
from megatron.checkpointing.dist.model import Layout, _unwrap, key_rules
from megatron.checkpointing.dist.optimizer import MAIN, PREFIX, _first_per_offset
from megatron.checkpointing.errors import CheckpointError


def _mains(optimizer) -> dict[int, torch.Tensor]:
    """``{id(model param): the main param the torch optimizer steps}``."""
    pairs = getattr(optimizer, "_pairs", None)
    if pairs is not None:  # fp16 / bf16: fp32 copies of the half params, fp32 params as they are
        out = {id(param): main for main, param in pairs}
        out.update({id(p): p for p in optimizer._fp32_params})
        return out
    return {id(p): p for p in optimizer.main_params()}


def _state_names(optimizer) -> tuple[str, ...]:
    inner = optimizer.optimizer
    moments = ("momentum_buffer",) if isinstance(inner, torch.optim.SGD) else \
        ("exp_avg", "exp_avg_sq")
    if isinstance(inner, torch.optim.SGD) and not any(g.get("momentum") for g in
                                                       inner.param_groups):
        moments = ()
    half = bool(getattr(optimizer, "_pairs", None))
    return ((MAIN,) if half else ()) + moments


def num_steps(optimizer) -> int:
    """The optimizer's step count (torch keeps one per parameter state; they are equal)."""
    for state in optimizer.optimizer.state.values():
        step = state.get("step")
        if step is not None:
            return int(float(step))
    return 0


def common_state(optimizer) -> dict:
    """The param groups (options and step count, no tensors) and the grad scaler."""
    steps = num_steps(optimizer)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": steps}
              for g in optimizer.optimizer.param_groups]
    out: dict = {"optimizer": {"param_groups": groups}}
    if optimizer.grad_scaler is not None:
        out["grad_scaler"] = optimizer.grad_scaler.state_dict()
    return out


def state_tensors(model: Sequence[torch.nn.Module], optimizer, layout: Layout, swiglu: bool,
                  for_save: bool) -> tuple[dict[str, list[Chunk]], list]:
    """``({optimizer key: chunks}, [(main param, state name, tensor)])``: for a save views of
    the optimizer's state (zeros where a parameter has none yet), for a load fresh zeros to
    read into and hand to :func:`restore`."""
    rules = key_rules(model, swiglu)
    mains = _mains(optimizer)
    names = _state_names(optimizer)
    out: dict[str, list[Chunk]] = {}
    tensors = []
    for index, chunk in enumerate(model):
        placement, _ = layout.placement(index)
        for name, param in _unwrap(chunk).named_parameters():
            main = mains.get(id(param))
            if main is None or (for_save and name == HEAD_COPY_KEY):
                continue
            found = match(rules, name)
            if found is None:
                raise CheckpointError(
                    f"the torch_dist key table has no Megatron-Core name for {name}")
            rule, m = found
            state = optimizer.optimizer.state.get(main, {})
            for key in names:
                if not for_save:
                    value = torch.zeros(main.shape, dtype=main.dtype, device=main.device)
                elif key == MAIN:
                    value = main.detach()
                else:
                    value = state.get(key)
                    value = torch.zeros_like(main) if value is None else value
                tensors.append((main, key, value))
                for piece in tensor_chunks(rule, m, value, placement):
                    out.setdefault(PREFIX + key + "." + rule.mcore, []).append(piece)
    return _first_per_offset(out), tensors


@torch.no_grad()
def restore(optimizer, common: dict, tensors: list) -> None:
    """After a load: the read tensors become the torch optimizer's state, the main params get
    their saved fp32 values, and the param groups and grad scaler are restored.

    Raises:
        CheckpointError: the saved param groups do not fit this optimizer.
    """
    inner = optimizer.optimizer
    saved = common["optimizer"]["param_groups"]
    if len(saved) != len(inner.param_groups):
        raise CheckpointError(f"the checkpoint has {len(saved)} optimizer param groups, this "
                              f"run {len(inner.param_groups)}: pass --no-load-optim")
    steps = int(saved[0].get("step", 0)) if saved else 0
    for group, kept in zip(inner.param_groups, saved):
        group.update({k: v for k, v in kept.items() if k not in ("params", "step")})
    from megatron.core.optimizer.distrib_optimizer import _step_device
    for main, key, value in tensors:
        if key == MAIN:
            main.copy_(value)
            continue
        state = inner.state.setdefault(main, {})
        state[key] = value
        if "step" not in state and not isinstance(inner, torch.optim.SGD):
            state["step"] = torch.tensor(float(steps), dtype=torch.float32,
                                         device=_step_device(inner, main))
    if optimizer.grad_scaler is not None and "grad_scaler" in common:
        optimizer.grad_scaler.load_state_dict(common["grad_scaler"])
