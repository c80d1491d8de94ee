"""The names Megatron-LM's legacy language models save their weights under: the one place that
knows them (the models, ``megatron.checkpointing`` and the converters in ``tools/checkpoint``
import them from here).

A model's ``state_dict_for_save_checkpoint()`` is nested down to the modules that save a plain
``state_dict()``, which are flat dicts with dotted keys::

    sd["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]
    sd["model"]["language_model"]["encoder"]["layers.0.input_layernorm.weight"]
    sd["model"]["word_embeddings_for_head"]["weight"]

Code that reads or splits checkpoints speaks of the dotted form
(``language_model.encoder.layers.0.input_layernorm.weight``): :func:`flatten_model_state` and
:func:`nest_model_state` convert between the two. Three conventions come on top:

* legacy names: checkpoints older than Megatron-LM's 2021 renames say
  ``language_model.transformer.`` for ``language_model.encoder.`` and ``.attention.`` for
  ``.self_attention.`` (:data:`LEGACY_RENAMES`, :func:`current_key`); newer ones (core_v0.13)
  say ``input_norm`` / ``post_attention_norm`` / ``final_norm`` for the ``*_layernorm`` names
  and add empty ``_extra_state`` entries (:data:`NORM_RENAMES`,
  :func:`without_empty_extra_states`);
* the head copy: with tied embeddings and several pipeline stages the last stage saves its copy
  of the word embedding as ``word_embeddings_for_head`` (:data:`HEAD_COPY_SECTION`), which the
  model holds as its ``word_embeddings`` module (:func:`module_key`);
* layer numbers: ``.layers.N.`` counts from the model chunk's first layer
  (:func:`layer_of`, :func:`with_layer`).

This module imports nothing of the project: it sits below the models and the checkpoint format.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

LEGACY_RENAMES = (("language_model.transformer.", "language_model.encoder."),
                  (".attention.", ".self_attention."))
"""Older checkpoints' names -> current ones (Megatron-LM renamed both in 2021)."""

NORM_RENAMES = ((".input_norm.", ".input_layernorm."),
                (".post_attention_norm.", ".post_attention_layernorm."),
                (".post_inter_attention_norm.", ".post_inter_attention_layernorm."),
                (".final_norm.", ".final_layernorm."))
"""Newer Megatron-LM legacy models' norm names (core_v0.13 saves ``input_norm``...) -> the
``*_layernorm`` names of 23.06 this project saves: both name the same tensors."""

EXTRA_STATE_SUFFIX = "._extra_state"
"""Megatron core's linear layers save an ``_extra_state`` entry (None outside FP8 training)."""

HEAD_COPY_SECTION = "word_embeddings_for_head"
"""Checkpoint section of the last stage's copy of the tied word embedding."""

HEAD_COPY_WEIGHT = f"{HEAD_COPY_SECTION}.weight"
"""The head copy's dotted key."""

HEAD_COPY_MODULE = "word_embeddings"
"""The model's name for the module saved as :data:`HEAD_COPY_SECTION`."""

LANGUAGE_MODEL_NESTED_SECTIONS = ("language_model", "language_model.embedding")
"""Sections of Megatron's legacy language models whose values are dicts of sections (every
other section is one module's flat ``state_dict()``)."""

_LAYER_NUMBER = re.compile(r"\.layers\.(\d+)\.")


def current_key(key: str) -> str:
    """``key`` under today's names (an older checkpoint's ``transformer`` / ``.attention.``,
    a newer one's ``*_norm`` renamed; a current key unchanged)."""
    for old, new in LEGACY_RENAMES + NORM_RENAMES:
        key = key.replace(old, new)
    return key


def norm_key(key: str) -> str:
    """``key`` with a newer Megatron-LM's ``*_norm`` renamed to ``*_layernorm``."""
    for old, new in NORM_RENAMES:
        key = key.replace(old, new)
    return key


def without_empty_extra_states(flat: Mapping) -> dict:
    """``flat`` less the ``_extra_state`` entries that hold nothing (None); one that holds a
    value (FP8 scaling state) is kept, and the model or layout then names it."""
    return {key: value for key, value in flat.items()
            if not (key.endswith(EXTRA_STATE_SUFFIX) and value is None)}


def module_key(key: str) -> str:
    """A checkpoint's dotted key -> the model's parameter name: today's names, and the head
    copy's section named as the module that holds it."""
    key = current_key(key)
    if key.startswith(HEAD_COPY_SECTION + "."):
        key = HEAD_COPY_MODULE + key[len(HEAD_COPY_SECTION):]
    return key


def layer_of(key: str) -> int | None:
    """The layer number in ``key`` (``...layers.N...``), or None outside the layers."""
    found = _LAYER_NUMBER.search(key)
    return int(found.group(1)) if found else None


def with_layer(key: str, layer: int) -> str:
    """``key`` with its (first) layer number replaced by ``layer``."""
    return _LAYER_NUMBER.sub(f".layers.{layer}.", key, count=1)


def flatten_model_state(model_state: Mapping) -> dict[str, torch.Tensor]:
    """A nested model dict -> ``{dotted key: tensor}``, in the dict's order; the keys are kept
    as saved (old names such as ``transformer`` / ``.attention.`` included). A flat dict passes
    through."""
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


def flatten_checkpoint_state_dict(state_dict: Mapping) -> dict[str, torch.Tensor]:
    """Megatron-LM's nested model dict (or a module's flat ``state_dict()``) -> the model's
    parameter names (:func:`module_key` of each dotted key)."""
    flat = without_empty_extra_states(flatten_model_state(state_dict))
    return {module_key(key): value for key, value in flat.items()}
