"""The compiled fused kernels of a device, or ``None`` (the caller then runs PyTorch ops).

``setup.py`` builds ``megatron.fused_kernels._cpu`` (C++) wherever torch is importable at install
time and ``megatron.fused_kernels._cuda`` where a CUDA toolchain and a CUDA torch are; nothing is
compiled at launch. When an extension is missing or fails to import, the first use logs one line
on rank 0 naming the extension and the reason, and every later call returns ``None`` at once.

Inside a region that ``torch.compile`` traces (``--compile-layers``) every lookup answers
``None``: a pybind kernel is opaque to the compiler (a graph break), while the PyTorch path it
replaces is what inductor fuses.

The extensions are binary leaf modules (no Python imports), loaded by name so that the model
library (layer 0, ``megatron.core``) does not import the ``megatron.fused_kernels`` Python package.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from megatron.core.log import log_rank_0

EXTENSIONS = {"cpu": "megatron.fused_kernels._cpu", "cuda": "megatron.fused_kernels._cuda"}
# The storage dtypes every kernel takes, CPU, CUDA or compiled (each computes in fp32).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The rule that picks every default, per device type: a kernel runs only where it beats the
# PyTorch path it replaces (forward + backward, at the shapes the models use). On CUDA the
# softmaxes win; the layer norm and the RMS norm lose to ATen's fused F.layer_norm and
# F.rms_norm, which run instead. On CPU every kernel wins (ATen's F.rms_norm is an unfused op
# chain there). The figures: docs/benchmarks.md; ``bench/gpu_check.py`` re-measures the CUDA
# kernels, ``bench/bench_kernels.py`` the CPU ones.
FASTER_THAN_PYTORCH = {
    "cpu": frozenset({"layer_norm", "rms_norm", "softmax_plain", "softmax_masked",
                      "softmax_causal"}),
    "cuda": frozenset({"softmax_plain", "softmax_masked", "softmax_causal"}),
}

_loaded: dict[str, ModuleType | None] = {}


def extension(device_type: str) -> ModuleType | None:
    """The fused-kernel module for ``device_type`` (``"cpu"``, ``"cuda"``), or ``None``."""
    if device_type not in _loaded:
        _loaded[device_type] = _import(device_type)
    return _loaded[device_type]


def preferred(kernel: str, device_type: str) -> ModuleType | None:
    """The extension of ``device_type`` when its ``kernel`` beats the PyTorch path there
    (:data:`FASTER_THAN_PYTORCH`), else ``None`` (the caller runs PyTorch); ``None`` while
    ``torch.compile`` traces (module docstring)."""
    if torch.compiler.is_compiling():
        return None
    if kernel not in FASTER_THAN_PYTORCH.get(device_type, ()):
        return None
    return extension(device_type)


def cpu_kernel(name: str, *tensors: torch.Tensor) -> ModuleType | None:
    """The CPU extension when it exports ``name`` and every tensor is a CPU tensor of one dtype
    of :data:`KERNEL_DTYPES`, else ``None``. An extension built before a kernel existed
    still serves the others. ``None`` while ``torch.compile`` traces (module docstring)."""
    if torch.compiler.is_compiling():
        return None
    dtypes = {t.dtype for t in tensors}
    if (len(dtypes) != 1 or not dtypes <= set(KERNEL_DTYPES)
            or any(t.device.type != "cpu" for t in tensors)):
        return None
    ext = extension("cpu")
    return ext if ext is not None and hasattr(ext, name) else None


def _import(device_type: str) -> ModuleType | None:
    name = EXTENSIONS.get(device_type)
    if name is None:
        log_rank_0(f"> fused kernels: none for device type {device_type!r}; "
                   "using the PyTorch implementations")
        return None
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # not built (isolated build, no toolchain) or a broken binary
        log_rank_0(f"> fused kernels: {name} unavailable ({type(exc).__name__}: {exc}); using "
                   "the PyTorch implementations of the masked softmax, layer norm, RMS norm, cross "
                   "entropy, bias-GeLU and few-row linear. Build it with "
                   "`pip install --no-build-isolation -e .` (scripts/bootstrap.sh does).")
        return None
    log_rank_0(f"> fused kernels: using {name}")
    return module


def reset() -> None:
    """Forget what was loaded (tests that make an extension unimportable call this)."""
    _loaded.clear()
