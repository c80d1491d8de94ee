"""Keys of ``model_optim_rng.pt``: the top-level entries, and the model dict's nesting.

Megatron-LM's legacy models save ``state_dict_for_save_checkpoint()``: nested dicts down to the
modules that save a plain ``state_dict()``, which are flat dicts with dotted keys::

    sd["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]
    sd["model"]["language_model"]["encoder"]["layers.0.input_layernorm.weight"]
    sd["model"]["word_embeddings_for_head"]["weight"]

The layout rules (``layout.py``) speak of the dotted form (``language_model.encoder.layers.0.
input_layernorm.weight``): :func:`flatten_model_state` and :func:`nest_model_state` convert
between the two, given which sections are nested (:data:`LANGUAGE_MODEL_NESTED_SECTIONS`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

LANGUAGE_MODEL_NESTED_SECTIONS = ("language_model", "language_model.embedding")
"""Sections of Megatron's legacy language models whose values are dicts of sections (every
other section is one module's flat ``state_dict()``)."""

_MODEL_KEY = re.compile(r"model\d*")


def model_keys(state_dict: Mapping) -> list[str]:
    """The model entries of a loaded shard: ``["model"]``, or ``["model0", "model1", ...]`` with
    virtual pipeline stages (in chunk order)."""
    keys = [k for k in state_dict if isinstance(k, str) and _MODEL_KEY.fullmatch(k)]
    return sorted(keys, key=lambda k: int(k[5:] or -1))


def flatten_model_state(model_state: Mapping) -> dict[str, torch.Tensor]:
    """A nested model dict -> ``{dotted key: tensor}``, in the dict's order; the keys are kept
    as saved (old names such as ``transformer`` / ``.attention.`` included)."""
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: Mapping) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(f"{prefix}{key}.", value)
            else:
                flat[f"{prefix}{key}"] = value

    walk("", model_state)
    return flat


def nest_model_state(flat: Mapping[str, torch.Tensor],
                     nested_sections: tuple[str, ...] = LANGUAGE_MODEL_NESTED_SECTIONS
                     ) -> dict:
    """``{dotted key: tensor}`` -> the nested model dict Megatron-LM saves and loads: the dict
    descends through ``nested_sections``; the section below holds a flat dict of the rest of the
    key (``language_model.encoder.layers.0.x`` -> ``["language_model"]["encoder"]["layers.0.x"]``).
    """
    out: dict = {}
    for key, value in flat.items():
        parts = key.split(".")
        node, depth = out, 0
        while depth < len(parts) - 1 and ".".join(parts[:depth + 1]) in nested_sections:
            node = node.setdefault(parts[depth], {})
            depth += 1
        if depth == len(parts) - 1:
            node[parts[depth]] = value
        else:
            node.setdefault(parts[depth], {})[".".join(parts[depth + 1:])] = value
    return out
