"""Which peer went away: the processes of the ranks, as the rendezvous store records them.

A rank killed by ``kill -9`` or the OOM killer records nothing, and the peers only see a broken
connection ("Connection reset by peer", naming an address at best). Under torchrun the agent
sees its child exit and names the rank; launched without it (srun-style ``RANK`` /
``WORLD_SIZE``) nobody does. So each rank records its process (machine and pid) in the store
when the process groups exist, and a rank whose main thread fails asks, at no cost during
training, whether a peer's process on its own machine is gone. (Peers on other machines are
named by ``--watchdog-timeout-seconds``' heartbeats; a dead store host, rank 0 without
torchrun, by the store being gone.)
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import torch.distributed as dist

EXIT_SETTLE_S = 1.0
"""How long a failing rank looks for a vanished peer: a killed process closes its sockets (the
peers' errors) a moment before the kernel marks it dead."""


def machine() -> str:
    """This machine as the processes on it share it: host name and pid namespace (two
    containers on one host see different pids)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


def announce(store: dist.Store, machine_key: Callable[[str], str], rank: int) -> None:
    """Record this rank's process for the peers on its machine. One key per machine, so that a
    failing rank reads its own machine's few entries, not the whole world's (every rank of a
    large job may fail at once)."""
    store.append(machine_key(machine()), f"{rank}:{os.getpid()} ")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine is still running (a zombie, dead but not yet
    reaped by its launcher, is not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass  # no /proc: ask the kernel (a zombie then still counts as running)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def vanished_peer(store: dist.Store, machine_key: Callable[[str], str],
                  finished: Callable[[int], bool], rank: int) -> tuple[int, str] | None:
    """``(peer, what became of it)`` for the first peer on this machine whose process is gone
    without finishing, waiting up to :data:`EXIT_SETTLE_S` for one; else None.

    Raises:
        torch.distributed.DistError: the store is unreachable.
    """
    key = machine_key(machine())
    if not store.check([key]):
        return None
    entries = (entry.split(":") for entry in store.get(key).decode().split())
    local = {int(peer): int(pid) for peer, pid in entries if int(peer) != rank}
    deadline = time.monotonic() + EXIT_SETTLE_S
    while local:
        for peer, pid in local.items():
            if not process_alive(pid) and not finished(peer):
                return peer, (f"gone (its process {pid} on {socket.gethostname()} ended without "
                              "a report: killed or crashed)")
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return None
