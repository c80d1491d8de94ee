"""Reading a checkpoint file without running code from it.

``torch.load(weights_only=True)`` with an allowlist of the few types a Megatron-LM checkpoint
holds: ``argparse.Namespace`` (or ``types.SimpleNamespace``) for ``args``, numpy's RNG state
arrays, and Megatron's enums such as ``args.model_type`` or the ``rerun_state_machine`` entry's
``RerunMode``, read as inert stand-ins. A file that
cannot be read is "corrupt or truncated checkpoint file FILE: why"; one holding any other type
is refused by name.
"""

from __future__ import annotations

import argparse
import enum
import os
import pickle
import re
import types
from pathlib import Path

import numpy as np
import torch

from megatron.checkpointing.errors import CheckpointError, corrupt_file_error
from megatron.checkpointing.names import DISTRIB_OPTIM_FILENAME


class MegatronEnum(enum.Enum):
    """Inert stand-in for an enum Megatron-LM pickles into ``args`` (``args.model_type =
    ModelType.encoder_or_decoder``, ``args.attention_backend = AttnBackend.auto``...).

    Unpickling calls ``EnumClass(value)``; these classes only hold the value (unknown values of
    newer Megatron versions become pseudo-members), so nothing from Megatron-LM is imported or
    run, and the checks on load never read them.
    """

    @classmethod
    def _missing_(cls, value):
        member = object.__new__(cls)
        member._name_, member._value_ = f"unknown_{value}", value
        return member


def _stub_enum(name: str, members: str) -> type[MegatronEnum]:
    return MegatronEnum(name, [(m, i) for i, m in enumerate(members.split(), start=1)],
                        module=__name__)


# Megatron-LM's enums (23.06 and core_v0.13 values) under every module path they have lived at.
_MODEL_TYPE = _stub_enum("ModelType", "encoder_or_decoder encoder_and_decoder retro_encoder "
                                      "retro_decoder")
_LAYER_TYPE = _stub_enum("LayerType", "encoder decoder retro_encoder retro_decoder "
                                      "retro_decoder_with_retriever")
_ATTN_TYPE = _stub_enum("AttnType", "self_attn cross_attn")
_ATTN_MASK_TYPE = _stub_enum("AttnMaskType", "padding causal no_mask padding_causal arbitrary")
_ATTN_BACKEND = _stub_enum("AttnBackend", "flash fused unfused local auto")
_POSITION_EMBEDDING_TYPE = _stub_enum("PositionEmbeddingType", "rotary absolute")
_FP8_RECIPE = _stub_enum("Fp8Recipe", "delayed tensorwise mxfp8")
# The rerun state machine's enums (megatron.core.rerun_state_machine), with Megatron's values:
# every checkpoint core_v0.13+ saves has a top-level ``rerun_state_machine`` entry holding them.
_RERUN_MODE = MegatronEnum("RerunMode", [(m.upper(), m) for m in
                                         ("disabled", "validate_results",
                                          "report_determinism_stats")], module=__name__)
_RERUN_STATE = MegatronEnum("RerunState", [
    (m, i) for i, m in enumerate(("NOT_RUNNING_YET", "INITIAL_RUN", "RERUNNING_IN_PLACE",
                                  "WILL_RERUN_FROM_CHECKPOINT", "RERUNNING_FROM_CHECKPOINT",
                                  "RERUNNING_AGAIN_FROM_CHECKPOINT"))], module=__name__)
_RERUN_DIAGNOSTIC = MegatronEnum("RerunDiagnostic", [
    (m.upper(), m) for m in ("correct_result", "transient_error", "persistent_error")],
    module=__name__)
_MEGATRON_ENUMS = {
    "megatron.core.enums": {"ModelType": _MODEL_TYPE, "Fp8Recipe": _FP8_RECIPE},
    "megatron.core.transformer.enums": {
        "ModelType": _MODEL_TYPE, "LayerType": _LAYER_TYPE, "AttnType": _ATTN_TYPE,
        "AttnMaskType": _ATTN_MASK_TYPE, "AttnBackend": _ATTN_BACKEND},
    "megatron.core.rerun_state_machine": {
        "RerunMode": _RERUN_MODE, "RerunState": _RERUN_STATE,
        "RerunDiagnostic": _RERUN_DIAGNOSTIC},
    "megatron.model.enums": {
        "ModelType": _MODEL_TYPE, "LayerType": _LAYER_TYPE, "AttnType": _ATTN_TYPE,
        "AttnMaskType": _ATTN_MASK_TYPE, "PositionEmbeddingType": _POSITION_EMBEDDING_TYPE},
    "megatron.legacy.model.enums": {
        "LayerType": _LAYER_TYPE, "AttnType": _ATTN_TYPE, "AttnMaskType": _ATTN_MASK_TYPE},
}


_HOME = {stub: (module, name) for module, stubs in reversed(_MEGATRON_ENUMS.items())
         for name, stub in stubs.items()}
"""Stand-in -> the (module, name) it is written back under: the first place listed (where
Megatron-LM core_v0.13 defines it)."""


class _MegatronNamesPickler(pickle._Pickler):  # noqa: SLF001 - the pure-Python pickler
    """Writes a stand-in enum under Megatron-LM's own name (``megatron.core.enums.ModelType``),
    so a checkpoint read here and written back (a conversion) holds the same globals Megatron-LM
    wrote and reads; every other object is pickled as usual."""

    def save_global(self, obj, name=None):
        home = _HOME.get(obj)
        if home is None:
            super().save_global(obj, name)
            return
        self.write(pickle.GLOBAL + f"{home[0]}\n{home[1]}\n".encode("utf-8"))
        self.memoize(obj)


PICKLE_MODULE = types.ModuleType("megatron_names_pickle")
"""``torch.save(..., pickle_module=PICKLE_MODULE)``: :class:`_MegatronNamesPickler` as the
Pickler."""
PICKLE_MODULE.Pickler = _MegatronNamesPickler


def _safe_globals() -> list:
    """Types a Megatron-LM checkpoint legitimately pickles (none of them can run code)."""
    # SimpleNamespace: some tools store args that way; like Namespace it only holds values.
    allowed: list = [argparse.Namespace, types.SimpleNamespace]
    multiarray = getattr(np, "_core", None) or np.core
    allowed += [multiarray.multiarray._reconstruct, np.ndarray, np.dtype]
    allowed += [getattr(np.dtypes, name) for name in dir(np.dtypes) if name.endswith("DType")]
    # (stand-in, "module.Name"): torch resolves the pickled global by that name.
    allowed += [(stub, f"{module}.{name}") for module, stubs in _MEGATRON_ENUMS.items()
                for name, stub in stubs.items()]
    return allowed


def safe_globals() -> list:
    """The types a checkpoint object may hold (for ``torch.serialization.safe_globals``)."""
    return _safe_globals()


def load_checkpoint_file(path: str | os.PathLike, mmap: bool = False) -> dict | list:
    """``torch.load`` with ``weights_only=True`` plus the allowlist; clear errors otherwise.

    ``mmap``: map the tensors' storage from the file instead of reading it (tools that stream
    a checkpoint keep only the pages they touch).

    Raises:
        CheckpointError: missing, truncated/corrupt, not a dict (``distrib_optim.pt``: or a
            list), or holding types outside the
            allowlist.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - torch raises several types; all mean "refused"
        text = str(err)
        if "Weights only load failed" in text or "Unsupported global" in text:
            # torch names the offending callable/class as "GLOBAL module.name"; the rest of its
            # message is boilerplate about the weights_only default.
            found = re.search(r"GLOBAL ([\w.]+)", text)
            what = found.group(1).rstrip(".") if found else "an unsupported type"
            raise CheckpointError(
                f"refusing to load {path}: it holds {what}, outside the allowlist of checkpoint "
                "types; loading it could run code. Only load checkpoints you trust through other "
                "means") from None
        raise corrupt_file_error(path, _first_line(err)) from None
    # An expert-parallel distrib_optim.pt is Megatron-LM's [dense, expert] list.
    expert_parallel_distrib = isinstance(state, list) and path.name == DISTRIB_OPTIM_FILENAME
    if not isinstance(state, dict) and not expert_parallel_distrib:
        raise corrupt_file_error(path, f"it holds a {type(state).__name__}, not a checkpoint's "
                                       "dict")
    return state


def _first_line(err: BaseException) -> str:
    # torch's message may be empty (EOFError for a 0-byte file) or pages long.
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__
