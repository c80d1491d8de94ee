"""Per-layer auxiliary-loss values for the log line (Megatron's ``MoEMetricsTracker``): each
router records its load-balancing loss (over its coefficient) and z-loss in training forwards;
the loop reduces them over the ranks, logs them and clears them once per iteration.

The one process-wide store of the MoE layers: the values are detached copies for logging,
never read by the model.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core import comm


@dataclasses.dataclass
class _Entry:
    values: torch.Tensor  # [num_layers] summed over the iteration's micro-batches
    reduce_group: object = None  # summed over it (the ranks' shares of one loss)
    avg_group: object = None  # averaged over it (each rank's own estimate)


_TRACKER: dict[str, _Entry] = {}


def record(name: str, value: torch.Tensor, layer_number: int, num_layers: int,
           reduce_group=None, avg_group=None) -> None:
    """Add ``value`` (a scalar, detached here) to layer ``layer_number`` (1-based) of ``name``."""
    entry = _TRACKER.get(name)
    if entry is None:
        entry = _TRACKER[name] = _Entry(torch.zeros(num_layers, device=value.device),
                                        reduce_group, avg_group)
    entry.values[layer_number - 1] += value.detach().float()


def clear() -> None:
    _TRACKER.clear()


def names() -> list[str]:
    return list(_TRACKER)


def reduce_per_layer(num_microbatches: int, pp_group=None, dp_group=None
                     ) -> dict[str, torch.Tensor]:
    """Every recorded loss per layer ``[num_layers]``, averaged over the micro-batches, summed
    over the pipeline stages (each holds its own layers) and over its ``reduce_group``, and
    averaged over its ``avg_group`` and the data-parallel ranks. A collective: every rank of
    the groups calls it with the same names recorded (the loop calls it on all ranks)."""
    out = {}
    for name, entry in _TRACKER.items():
        values = entry.values.clone() / num_microbatches
        for group in (pp_group, entry.reduce_group):
            if comm.world_size(group) > 1:
                comm.all_reduce(values, group)
        for group in (entry.avg_group, dp_group if entry.avg_group is None else None):
            if comm.world_size(group) > 1:
                comm.all_reduce(values, group)
                values /= comm.world_size(group)
        out[name] = values
    return out
