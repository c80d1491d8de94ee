"""megatron.training.peer_processes without processes of its own: a store in memory, pids of
a finished child (gone) and of this test's parent (running)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch.distributed as dist

from megatron.training import peer_processes


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now
    return child.pid


def test_a_peer_whose_process_is_gone_is_named_unless_it_finished():
    store = dist.HashStore()
    key = lambda machine: f"processes/{machine}"  # noqa: E731 - the fault module's key
    here = peer_processes.machine()
    peer_processes.announce(store, key, 0)
    gone = _gone_pid()
    store.append(key(here), f"1:{os.getppid()} 2:{gone} ")
    store.append(key("another-host/pid:[1]"), f"3:{gone} ")  # not this machine's: not judged
    found = peer_processes.vanished_peer(store, key, lambda peer: False, 0)
    assert found is not None and found[0] == 2, found
    assert f"its process {gone} on " in found[1] and "killed or crashed" in found[1]
    # A peer that ended normally is gone without having failed.
    assert peer_processes.vanished_peer(store, key, lambda peer: peer == 2, 0) is None
    assert peer_processes.process_alive(os.getpid())
    assert not peer_processes.process_alive(gone)
