"""The weight files of a local HuggingFace model directory, read lazily, tensor by tensor.

The files looked for, in the order transformers' ``from_pretrained`` prefers them:

* ``model.safetensors``, or ``model.safetensors.index.json`` and the shards its ``weight_map``
  names (what ``save_pretrained`` and ``--saver hf`` write);
* ``pytorch_model.bin``, or ``pytorch_model.bin.index.json`` and its shards (what transformers'
  ``convert_megatron_gpt2_checkpoint.py`` and ``checkpoint_reshaping_and_interoperability.py``
  write). They are read with ``torch.load(weights_only=True)``, so a file that would run code
  is refused, and mapped (``mmap``) when in torch's zip format: only the tensors asked for are
  read from disk.
"""

from __future__ import annotations

import importlib
import json
import pickle
import re
import zipfile
from pathlib import Path
from types import ModuleType

import torch

from megatron.checkpointing import CheckpointError
from megatron.core.log import warn_rank_0

WEIGHT_FILES = (("model.safetensors", "model.safetensors.index.json"),
                ("pytorch_model.bin", "pytorch_model.bin.index.json"))
"""(single file, index of shards) per format, the preferred format first."""


def optional_module(name: str, purpose: str) -> ModuleType:
    """Import ``name`` or raise a one-line error naming the pip command (convert.py prints
    ValueErrors as ``convert.py: error: ...``).

    Raises:
        CheckpointError: ``name`` is not installed.
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        package = name.split(".")[0]
        raise CheckpointError(f"{purpose} needs the {package} package: pip install "
                              f"{package}") from None


def read_config(file: Path) -> dict:
    """A model directory's ``config.json`` as a dict.

    Raises:
        CheckpointError: not valid JSON, or not a JSON object, naming the file and the place.
    """
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err.msg} at line {err.lineno}, "
                              f"column {err.colno}): a truncated or hand-edited config.json? "
                              "restore it from the model's source") from None
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{file} is not UTF-8 text ({err.reason} at byte {err.start}): "
                              "not a config.json") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} holds a JSON {type(config).__name__}, not the object "
                              "of a HuggingFace config.json")
    return config


def layers_beyond(keys, pattern: str, num_layers: int) -> list[int]:
    """Layer numbers ``N`` of ``keys`` matching ``pattern`` (a regex whose group 1 is N) that are
    not below ``num_layers``: tensors the config's layer count leaves out."""
    found = {int(m.group(1)) for key in keys if (m := re.search(pattern, key))}
    return sorted(n for n in found if n >= num_layers)


def weight_files(directory: Path) -> list[str]:
    """The weight files of ``directory`` to read, relative to it.

    Raises:
        CheckpointError: none of :data:`WEIGHT_FILES`, or an index naming missing shards.
    """
    for single, index in WEIGHT_FILES:
        if (directory / single).is_file():
            return [single]
        if (directory / index).is_file():
            return _indexed_files(directory / index)
    names = ", ".join(name for pair in WEIGHT_FILES for name in pair)
    raise CheckpointError(f"--load-dir {directory} holds no model weights (looked for {names})")


def _indexed_files(index: Path) -> list[str]:
    """The shard files an ``*.index.json`` maps the tensors to, each once, sorted."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{index} is not a HuggingFace shard index (a JSON object with "
                              f"a 'weight_map' of tensor name -> file): {err}") from None
    missing = [name for name in files if not (index.parent / name).is_file()]
    if missing:
        raise CheckpointError(f"{index} names shard files that are not in {index.parent}: "
                              f"{', '.join(missing)} (an incomplete download or copy)")
    return files


class _TorchFile:
    """A ``pytorch_model*.bin`` file's tensors, loaded without running code."""

    def __init__(self, path: Path) -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True,
                               mmap=zipfile.is_zipfile(path))
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
            raise CheckpointError(f"cannot read {path} with torch.load(weights_only=True): "
                                  f"{err}") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
        # Some writers keep non-tensor entries (e.g. a version number) beside the weights.
        self.tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def _open(path: Path):
    """A handle with ``keys()`` and ``get_tensor(key)`` over one weight file."""
    if path.suffix == ".safetensors":
        safetensors = optional_module("safetensors", f"reading {path.name}")
        try:
            return safetensors.safe_open(str(path), framework="pt")
        except Exception as err:  # noqa: BLE001 - SafetensorError and OSError: one message
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise CheckpointError(f"cannot read {path}: {first} (a truncated or overwritten "
                                  "safetensors file? copy or download it again)") from None
    return _TorchFile(path)


def _warn_if_not_finite(tensor: torch.Tensor, key: str, path: Path) -> None:
    """NaN / inf weights are imported as they are, but said (the model's outputs would be)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        warn_rank_0(f"{path}: tensor {key} holds {bad} NaN/inf value(s) of {tensor.numel()}; "
                    "imported as they are (the model's outputs will not be finite): check "
                    "the file")


class HuggingFaceWeights:
    """Lazy access by name to the tensors of a HF model directory's weight files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.handles = {}
        self.where: dict[str, str] = {}
        for name in weight_files(directory):
            handle = _open(directory / name)
            self.handles[name] = handle
            for key in handle.keys():
                self.where[key] = name

    def get(self, key: str) -> torch.Tensor:
        # Some exports prefix the base model's keys ("transformer.") and some do not.
        for candidate in (key, key.removeprefix("transformer.")):
            if candidate in self.where:
                tensor = self.handles[self.where[candidate]].get_tensor(candidate)
                _warn_if_not_finite(tensor, candidate, self.directory / self.where[candidate])
                return tensor
        raise CheckpointError(f"the HuggingFace model holds no tensor {key}")

    def shape(self, key: str) -> tuple[int, ...] | None:
        """The shape of tensor ``key`` without reading it (None: no such tensor)."""
        for candidate in (key, key.removeprefix("transformer.")):
            if candidate in self.where:
                handle = self.handles[self.where[candidate]]
                if isinstance(handle, _TorchFile):
                    return tuple(handle.get_tensor(candidate).shape)
                return tuple(handle.get_slice(candidate).get_shape())
        return None

    def keys(self):
        return self.where.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.where
