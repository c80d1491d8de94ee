"""Every tensor factory in the project's code names its device.

On a GPU a tensor made without a device lands on the CPU, and the first op that mixes it with a
CUDA tensor fails (``get_grad_norm_fp32``'s ``torch.zeros(1)`` stopped every GPU run at its
first optimizer step). On the CPU machines CI runs on, both are the CPU and nothing fails, so
this test reads the source instead: every ``torch.zeros/ones/empty/full/tensor/arange/...`` call
in ``megatron/``, ``tasks/``, ``tools/`` and the entry points must pass ``device=``, either the
compute device (``device.get_device()``, or a tensor's ``.device``) or ``"cpu"`` where the path
is CPU by design (data loading, checkpoint conversion, generation's host-side bookkeeping).
``*_like`` factories inherit their input's device and are not flagged. The legacy typed
constructors (``torch.LongTensor(...)``) cannot take a device and are refused outright.

``tests/training/test_device_guard.py`` runs training and generation steps under a mode that also
catches factories reached indirectly (``init = torch.zeros if ... else torch.ones``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["megatron", "tasks", "tools", "pretrain_gpt.py", "pretrain_bert.py"]
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
             "randperm", "as_tensor", "eye", "linspace", "logspace", "empty_strided"}
LEGACY_CONSTRUCTORS = {"Tensor", "LongTensor", "FloatTensor", "DoubleTensor", "HalfTensor",
                       "BFloat16Tensor", "IntTensor", "ShortTensor", "ByteTensor", "BoolTensor",
                       "CharTensor"}


def _python_files() -> list[Path]:
    files: list[Path] = []
    for entry in SCANNED:
        path = ROOT / entry
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def device_less_factories(source: str, filename: str) -> list[str]:
    """``file:line: torch.name(...)`` for each factory call in ``source`` without ``device=``
    (and each legacy typed constructor)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        name = node.func.attr
        named_device = any(k.arg == "device" for k in node.keywords)
        if (name in FACTORIES and not named_device) or name in LEGACY_CONSTRUCTORS:
            found.append(f"{filename}:{node.lineno}: torch.{name}(...)")
    return found


def test_every_tensor_factory_names_its_device():
    offenders = []
    for path in _python_files():
        offenders += device_less_factories(path.read_text(), str(path.relative_to(ROOT)))
    assert not offenders, (
        "tensor factories without a device (on a GPU they make CPU tensors that the next op "
        "mixes with CUDA ones): pass device=device.get_device() on the compute path, or "
        "device=\"cpu\" where the path is CPU by design:\n  " + "\n  ".join(offenders))


@pytest.mark.parametrize("line, flagged", [
    ("total = torch.zeros(1, dtype=torch.float32)", True),
    ("total = torch.zeros(1, dtype=torch.float32, device=dev)", False),
    ("x = torch.tensor([1.0], device='cpu')", False),
    ("y = torch.zeros_like(x)", False),
    ("z = torch.LongTensor([1, 2])", True),
    ("w = torch.arange(5)", True),
])
def test_the_scan_flags_device_less_calls(line, flagged):
    assert bool(device_less_factories(line, "f.py")) == flagged


def test_the_grad_norm_mutation_is_named_by_file_and_line():
    """The bug that stopped every GPU run, put back: the scan names its file and line."""
    path = ROOT / "megatron/core/optimizer/clip_grads.py"
    source = path.read_text()
    fixed = "total = torch.zeros(1, dtype=torch.float32, device=device.get_device())"
    assert fixed in source
    mutated = source.replace(fixed, "total = torch.zeros(1, dtype=torch.float32)", 1)
    line = mutated[:mutated.index("total = torch.zeros(1, dtype=torch.float32)\n")].count("\n")
    assert device_less_factories(mutated, "megatron/core/optimizer/clip_grads.py") == [
        f"megatron/core/optimizer/clip_grads.py:{line + 1}: torch.zeros(...)"]


def test_every_torch_load_maps_to_the_cpu():
    """A checkpoint saved on a GPU must load on a CPU-only machine (and the reverse): every
    ``torch.load`` in the project passes ``map_location``."""
    offenders = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "load" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"
                    and not any(k.arg == "map_location" for k in node.keywords)):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "torch.load without map_location: " + ", ".join(offenders)
