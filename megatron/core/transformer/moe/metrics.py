"""Per-layer auxiliary-loss values for the log line (Megatron's MoE metrics tracker): each
router records its load-balancing loss (over its coefficient) and z-loss in training forwards;
the training loop reduces them over the ranks, logs them and clears them once per iteration.

The one process-wide store of the MoE layers: detached copies for logging, never read by the
model.
"""

from __future__ import annotations

import torch

from megatron.core import comm, device

_TRACKER: dict[str, torch.Tensor] = {}  # name -> [num_layers], summed over micro-batches
_SUMMED_OVER_TP = {"load_balancing_loss", "seq_load_balancing_loss",
                   "global_load_balancing_loss"}
"""Each TP (and CP) rank holds its share of these (its own rows' probabilities); the others are
each rank's own estimate of the same value and are averaged."""
_SUMMED_OVER_DP = {"global_load_balancing_loss"}
"""Each DP rank holds its share of this one too (its token counts span TP x DP x CP): summed
over DP, as Megatron reduces it over its TP x DP x CP group without a DP average."""


def record(name: str, value: torch.Tensor, layer_index: torch.Tensor, num_layers: int) -> None:
    """Add ``value`` (a scalar) to the layer at ``layer_index`` (a 0-based index in a 1-element
    int64 tensor: a compiled layer then reads it as an input, and the layers of a model share
    one graph instead of one recompilation per layer number) of ``name``."""
    values = _TRACKER.get(name)
    if values is None or values.shape[0] != num_layers:
        values = _TRACKER[name] = torch.zeros(num_layers, device=value.device)
    values.index_add_(0, layer_index, value.detach().float().reshape(1))


def clear() -> None:
    """Forget every recorded name (a new model)."""
    _TRACKER.clear()


def zero() -> None:
    """Start a new iteration: the names stay (so a compiled layer's guards on them hold), their
    values restart from zero."""
    for values in _TRACKER.values():
        values.zero_()


def reduce_per_layer(num_microbatches: int, names: list[str] | None = None,
                     num_layers: int | None = None, tp_group=None, pp_group=None,
                     dp_group=None, cp_group=None) -> dict[str, torch.Tensor]:
    """The recorded losses per layer ``[num_layers]``, averaged over the micro-batches and the
    data-parallel ranks (``dp_group`` without CP; summed for the global balancing loss), summed over the pipeline stages (each holds
    its own layers) and over TP x CP for the balancing losses (averaged over TP x CP for the
    others), as Megatron reduces them over its TP x CP group.

    A collective over the groups given: every rank passes the same ``names`` (the losses its
    configuration records; a stage without MoE layers contributes zeros), or None to take the
    names recorded here (single process).
    """
    names = list(_TRACKER) if names is None else names
    out = {}
    for name in names:
        values = _TRACKER.get(name)
        if values is None:
            values = torch.zeros(num_layers, device=device.get_device())
        values = values.clone() / num_microbatches
        for group in (pp_group, tp_group, cp_group, dp_group):
            if comm.world_size(group) > 1:
                comm.all_reduce(values, group)
        if name not in _SUMMED_OVER_TP:
            values /= comm.world_size(tp_group) * comm.world_size(cp_group)
        out[name] = values if name in _SUMMED_OVER_DP else values / comm.world_size(dp_group)
    return out
