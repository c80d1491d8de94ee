"""A mode that refuses tensor factories called from the project's code without a device.

On a GPU such a factory makes a CPU tensor, and the first op mixing it with CUDA tensors fails;
on the CPU machines the suite runs on nothing fails. Under :class:`DeviceGuard` (a
``TorchFunctionMode``) a ``torch.zeros/ones/empty/full/tensor/arange/...`` call whose immediate
caller is a file of ``megatron/``, ``tasks/`` or ``tools/`` and that passes no ``device=`` raises
:class:`DeviceLessFactory` naming that file and line. Calls from torch itself (an optimizer
creating its ``step``, ``nn.init``) and from tests are left alone. This also sees what the source
scan of ``tests/test_device_placement.py`` cannot: factories reached through a variable
(``init = torch.zeros if ... else torch.ones``).
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARDED_DIRS = tuple(os.path.join(REPO, d) + os.sep for d in ("megatron", "tasks", "tools"))
FACTORIES = {getattr(torch, name) for name in (
    "zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint", "randperm",
    "as_tensor", "eye", "linspace", "logspace", "empty_strided")}


class DeviceLessFactory(RuntimeError):
    """A factory in the project's code made a tensor without naming its device."""


class DeviceGuard(TorchFunctionMode):
    """Raise on device-less factory calls made directly by the project's code."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            caller = sys._getframe(1)
            path = os.path.abspath(caller.f_code.co_filename)
            if path.startswith(GUARDED_DIRS):
                raise DeviceLessFactory(
                    f"{os.path.relpath(path, REPO)}:{caller.f_lineno}: torch.{func.__name__} "
                    "without a device (a CPU tensor on a GPU run): pass "
                    "device=device.get_device(), or device=\"cpu\" on a CPU-by-design path")
        return func(*args, **kwargs)
