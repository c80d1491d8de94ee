"""The watchdog's decisions (megatron/training/watchdog.py), without processes: a local
rendezvous store, the main thread's collective state set by hand. The real thing (ranks that
hang or vanish in real jobs) is tests/faults/test_dying_ranks.py."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from megatron.config import parse_args
from megatron.core import comm
from megatron.training.watchdog import Watchdog

BOUND_S = 1.0


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


@pytest.fixture
def dog(store, monkeypatch):
    monkeypatch.setattr(comm, "_blocked", None)
    monkeypatch.setattr(comm, "_last_activity", time.monotonic())
    return Watchdog(store, rank=0, world_size=2, key=lambda name: f"run/{name}",
                    bound_s=BOUND_S, report=lambda rank, message: None)


def _blocked_for(monkeypatch, seconds: float, op: str = "all_reduce") -> None:
    monkeypatch.setattr(comm, "_blocked", comm.Blocked(op, None, time.monotonic() - seconds))


def test_outside_collectives_only_checked_when_armed(dog, monkeypatch):
    monkeypatch.setattr(comm, "_last_activity", time.monotonic() - 5 * BOUND_S)
    dog.started -= 5 * BOUND_S
    assert dog._check() is None  # set-up: not armed
    dog.arm_outside_check(True)
    assert dog._check() is None  # arming restarts the clock
    dog.started -= 2 * BOUND_S
    rank, message = dog._check()
    assert rank == 0
    assert message.startswith("hung: no collective for 2.")
    assert "(--watchdog-timeout-seconds 1); main thread in " in message
    # Called from the main thread itself here: its stack ends in the check.
    assert "> test_outside_collectives_only_checked_when_armed > _check" in message


def test_a_silent_peer_is_named_while_this_rank_waits_for_it(dog, store, monkeypatch):
    store.add("run/beat/1", 7)
    _blocked_for(monkeypatch, 0.4 * BOUND_S)
    assert dog._check() is None  # a short wait: nobody looked yet
    _blocked_for(monkeypatch, 0.6 * BOUND_S, "pipeline send/recv")
    assert dog._check() is None  # the peer's counter is read for the first time
    dog.seen[1] = (7, time.monotonic() - 1.5 * BOUND_S)  # ...and has not moved since
    rank, message = dog._check()
    assert rank == 1
    assert message.startswith("no heartbeat for 1.")
    assert message.endswith("rank 0 waits for it in pipeline send/recv over ranks [0]")


def test_a_long_wait_with_every_peer_alive_names_this_rank(dog, store, monkeypatch):
    store.add("run/beat/1", 1)
    _blocked_for(monkeypatch, 2.5 * BOUND_S, "barrier")
    dog.seen[1] = (0, time.monotonic() - 5 * BOUND_S)  # it moved (0 -> 1): alive
    rank, message = dog._check()
    assert rank == 0
    assert message.startswith("hung: waited 2.")
    assert "in barrier over ranks [0] (twice --watchdog-timeout-seconds 1)" in message


def test_stopped_peer_is_one_whose_counter_stands_still_unless_it_finished(dog, store):
    store.add("run/beat/1", 3)
    assert dog.stopped_peer(store) == 1
    store.set("run/finished/1", "1")
    assert dog.stopped_peer(store) is None


def test_the_thread_beats_and_reports_once(store, monkeypatch):
    monkeypatch.setattr(comm, "_blocked", None)
    reports = []
    dog = Watchdog(store, rank=1, world_size=2, key=lambda name: f"run/{name}", bound_s=0.4,
                   report=lambda rank, message: reports.append((rank, message)))
    dog.start()
    dog.arm_outside_check(True)
    monkeypatch.setattr(comm, "_last_activity", time.monotonic() - 10)
    dog.thread.join(timeout=30)
    assert not dog.thread.is_alive()
    assert [r for r, _ in reports] == [1] and reports[0][1].startswith("hung: no collective")
    assert store.add("run/beat/1", 0) >= 2


def test_comm_marks_the_wait_and_the_progress(monkeypatch):
    seen = []

    class Handle:
        def wait(self):
            seen.append(comm.blocked_in())

    before = comm.last_activity()
    comm.wait([Handle(), None], "gradient reduction", comm.world_group())
    assert [b.op for b in seen] == ["gradient reduction"]
    assert comm.blocked_in() is None and comm.last_activity() >= before


def test_the_flag_is_validated():
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                      "--seq-length", "8", "--max-position-embeddings", "8",
                      "--micro-batch-size", "1", "--watchdog-timeout-seconds", "2.5"])
    assert cfg.parallel.watchdog_timeout_seconds == 2.5
    with pytest.raises(SystemExit):
        parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                     "--seq-length", "8", "--max-position-embeddings", "8",
                     "--micro-batch-size", "1", "--watchdog-timeout-seconds", "0"])
