"""SIGTERM handling for --exit-signal-handler: note the signal, let the loop save and exit."""

from __future__ import annotations

import signal

import torch

from megatron.core import comm, device


class DistributedSignalHandler:
    """Records a received signal; ``signals_received()`` tells every rank if any rank got one.

    Used as a context manager around training; the previous handler is restored on exit.
    """

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self._received = False
        self._previous = None

    def __enter__(self) -> "DistributedSignalHandler":
        self._previous = signal.getsignal(self.sig)
        signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(self.sig, self._previous)

    def _handle(self, signum, frame) -> None:
        self._received = True

    def signals_received(self) -> bool:
        """Collective: True on every rank if any rank received the signal."""
        flag = torch.tensor([int(self._received)], device=device.get_device())
        comm.all_reduce(flag, comm.world_group(), op="max")
        return bool(flag.item())
