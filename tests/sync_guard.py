"""A mode that refuses host-device synchronisations made by the project's code.

On a GPU, ``.item()``, ``bool(tensor)`` (an ``if`` on a tensor), ``torch.equal``, ``.tolist()``,
``.cpu()``, ``int()``/``float()`` of a tensor and ``.nonzero()`` wait for every kernel queued
before them: the host stops feeding the device. On the CPU machines the suite runs on nothing
waits, so nothing shows. Under :class:`HostSyncGuard` (a ``TorchFunctionMode``, like
``tests/device_guard.py``'s) such a call whose immediate caller is a file of ``megatron/``,
``pretrain_gpt.py`` or ``pretrain_bert.py`` raises :class:`HostSync` naming that file and line.
Calls from torch itself and from tests are left alone, and so are those of ``megatron/data/``,
whose samples are host tensors by design (the loader builds them before any copy to the
device). ``torch.cuda.set_sync_debug_mode`` is
the GPU's own form of the same check; this one runs wherever the tests run.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARDED = (os.path.join(REPO, "megatron") + os.sep, os.path.join(REPO, "pretrain_gpt.py"),
           os.path.join(REPO, "pretrain_bert.py"))
HOST_SIDE = (os.path.join(REPO, "megatron", "data") + os.sep,)
SYNCING = {torch.Tensor.item, torch.Tensor.__bool__, torch.equal, torch.Tensor.equal,
           torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__int__, torch.Tensor.__float__,
           torch.Tensor.nonzero, torch.nonzero, torch.Tensor.numpy}


class HostSync(RuntimeError):
    """The project's code waited for the device inside a guarded region."""


class HostSyncGuard(TorchFunctionMode):
    """Raise on host-device synchronising calls made directly by the project's code."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            caller = sys._getframe(1)
            path = os.path.abspath(caller.f_code.co_filename)
            if path.startswith(GUARDED) and not path.startswith(HOST_SIDE):
                name = getattr(func, "__name__", str(func))
                raise HostSync(f"{os.path.relpath(path, REPO)}:{caller.f_lineno}: {name} waits "
                               "for the device (a host-device synchronisation per step on a GPU)")
        return func(*args, **(kwargs or {}))
