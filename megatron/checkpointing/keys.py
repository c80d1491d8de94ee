"""Top-level keys of ``model_optim_rng.pt``: which entries hold a model chunk.

The model dict's own keys (its nesting, older checkpoints' names, the last stage's head copy,
layer numbers) are the models' naming, kept below both the models and this package in
:mod:`megatron.core.checkpoint_keys`; this package presents its converters
(``flatten_model_state``, ``nest_model_state``) as part of its API.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_MODEL_KEY = re.compile(r"model\d*")


def model_keys(state_dict: Mapping) -> list[str]:
    """The model entries of a loaded shard: ``["model"]``, or ``["model0", "model1", ...]`` with
    virtual pipeline stages (in chunk order)."""
    keys = [k for k in state_dict if isinstance(k, str) and _MODEL_KEY.fullmatch(k)]
    return sorted(keys, key=lambda k: int(k[5:] or -1))
