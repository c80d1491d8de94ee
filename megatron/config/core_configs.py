"""The lower layers' configs, filled from the validated flags by copying fields by name.

Each layer below the CLI owns the typed config it consumes (``megatron.core.optimizer``,
``megatron.core.distributed``, ``megatron.core.transformer``, ``megatron.tokenizer``,
``megatron.data``). Their fields carry the flags' names, so one generic copy maps a validated
:class:`~megatron.config.cli.MegatronConfig` onto any of them; only values whose name or form
differs are passed explicitly. Nothing below this package imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

# MegatronConfig attributes that are sections (searched for fields) rather than derived values.
_SECTION_ATTRS = ("model", "parallel", "training", "optimizer", "precision", "data", "tokenizer",
                  "checkpoint", "logging")


def flag_values(cfg) -> dict[str, Any]:
    """Every flag value and derived value of ``cfg`` by field name.

    Raises:
        AssertionError: two sections declare the same field name (the copy would be ambiguous).
    """
    values: dict[str, Any] = {}
    for attr in _SECTION_ATTRS:
        for f in dataclasses.fields(getattr(cfg, attr)):
            assert f.name not in values, f"field {f.name!r} is declared by two flag sections"
            values[f.name] = getattr(getattr(cfg, attr), f.name)
    for f in dataclasses.fields(cfg):
        if f.name not in _SECTION_ATTRS and not f.init:
            values[f.name] = getattr(cfg, f.name)  # derived by validate()
    return values


def from_flags(cls: type[T], cfg, **explicit: Any) -> T:
    """``cls(...)`` with every init field copied by name from ``cfg``; ``explicit`` wins.

    Fields that no flag provides keep ``cls``'s default.
    """
    values = flag_values(cfg)
    kwargs = {f.name: values[f.name] for f in dataclasses.fields(cls)
              if f.init and f.name in values}
    kwargs.update(explicit)
    return cls(**kwargs)


def transformer_config(cfg):
    """The model library's config (shape, numerics, dropout, init, recomputation); flags the
    model does not implement were refused by validate() (megatron.config.refusals)."""
    from megatron.core.transformer.config import TransformerConfig

    return from_flags(TransformerConfig, cfg, onnx_safe=bool(cfg.model.onnx_safe),
                      num_moe_experts=cfg.model.num_experts,
                      use_cpu_initialization=_use_cpu_initialization(cfg),
                      perform_initialization=not _checkpoint_to_load(cfg))


def _use_cpu_initialization(cfg) -> bool:
    """``--use-cpu-initialization``; on a CPU device the whole-weight draw is the only one
    (Megatron's per-rank draw is its GPU path)."""
    from megatron.core import device

    return bool(cfg.parallel.use_cpu_initialization) or device.get_device().type == "cpu"


def _checkpoint_to_load(cfg) -> bool:
    """``--load`` names a directory with a checkpoint tracker: the load (strict) overwrites
    every weight the model draws, so the draw is skipped."""
    import os

    from megatron.checkpointing.names import TRACKER_FILENAME

    load = getattr(cfg.checkpoint, "load", None)
    return bool(load) and os.path.isfile(os.path.join(load, TRACKER_FILENAME))


def ddp_config(cfg):
    """The data-parallel wrapper's config. The local gradients are checked for NaN/inf before
    their reduction with --check-for-nan-in-loss-and-grad, except with --fp16, whose loss
    scaler owns overflowing gradients (the step is skipped)."""
    from megatron.core.distributed.config import DistributedDataParallelConfig

    return from_flags(DistributedDataParallelConfig, cfg, check_for_nan_in_grad=(
        cfg.training.check_for_nan_in_loss_and_grad and not cfg.precision.fp16))


def optimizer_config(cfg):
    """The optimizer layer's config (hyper-parameters, precision, loss scaling, sharding)."""
    from megatron.core.optimizer.config import OptimizerConfig

    return from_flags(OptimizerConfig, cfg)
