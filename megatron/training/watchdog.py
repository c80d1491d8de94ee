"""--watchdog-timeout-seconds: a hung or silently dead rank becomes an error that names it.

The collective timeout (``--distributed-timeout-minutes``) bounds how long a rank waits for a
stuck peer, but the error it raises is the *waiting* rank's ("timed out"), and on NCCL a peer
killed by the OOM killer or ``kill -9`` records nothing anywhere. The watchdog is one daemon
thread per rank (started by :func:`megatron.training.fault.watch_peers`, worlds above one).
Every ``interval`` it adds one to its rank's heartbeat counter in the rendezvous store and looks
at its own main thread through :func:`megatron.core.comm.blocked_in`:

* outside any collective for longer than the bound since the last one started or finished,
  during the training iterations (:func:`megatron.training.fault.hang_watch`; not during
  set-up, evaluation or checkpoint saves, which legitimately spend long stretches without
  collectives): *this* rank is hung; it reports ``rank R hung: no collective for S s; main
  thread in <the innermost calls>``;
* inside one for longer than the bound: it reads the peers' heartbeats; a peer whose counter
  has not moved for the bound is dead or frozen: ``rank P failed: no heartbeat for S s (dead or
  frozen); rank R waits for it in <op> over ranks [...]``;
* inside one for twice the bound with every peer beating: ``rank R hung: waited S s in <op>
  over ranks [...]`` (a peer stuck in a different collective). Twice, so that a peer stuck
  outside collectives, whose own watchdog reports after the bound, is the one named first.

The report goes through the fault module's ending (first failure recorded in the store, every
other rank stops naming it). The thread only reads plain attributes of the main thread's state
and the store: it never touches a process group.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch.distributed as dist

from megatron.core import comm

_FRAMES_SHOWN = 4


class Watchdog:
    """One rank's watchdog (see the module docstring).

    Args:
        store: a rendezvous-store client of the watchdog's own.
        rank: this rank.
        world_size: number of ranks.
        key: the run's store key for a name (``fault._Peers.key``).
        bound_s: ``--watchdog-timeout-seconds``.
        report: called once with ``(failed_rank, message)`` to end the job; returns only if
            the rank is ending already for another reason.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, key: Callable[[str], str],
                 bound_s: float, report: Callable[[int, str], None]) -> None:
        self.store, self.rank, self.world_size, self.key = store, rank, world_size, key
        self.bound_s, self.report = bound_s, report
        self.interval_s = min(1.0, bound_s / 4)
        self.main = threading.main_thread()
        self.stopped = threading.Event()
        # Peer -> (last counter seen, monotonic time it last changed).
        self.seen: dict[int, tuple[int, float]] = {}
        self.started = time.monotonic()
        self.thread: threading.Thread | None = None
        # The check for a main thread stuck outside collectives: only armed where collectives
        # come steadily (the training iterations; see fault.hang_watch).
        self.outside_armed = False

    def beat_key(self, rank: int) -> str:
        return self.key(f"beat/{rank}")

    def start(self) -> None:
        self.store.add(self.beat_key(self.rank), 1)
        self.thread = threading.Thread(target=self._run, name="megatron-watchdog", daemon=True)
        self.thread.start()

    def arm_outside_check(self, armed: bool) -> bool:
        """Arm (or disarm) the outside-collectives check; returns the previous setting. The
        idle time counts from now: a disarmed stretch is not a stall."""
        previous, self.outside_armed = self.outside_armed, armed
        self.started = time.monotonic()
        return previous

    def stop(self, store: dist.Store) -> None:
        """This rank finished: no more beats, and peers must not take it for dead.
        ``store``: the caller's own client."""
        self.stopped.set()
        store.set(self.key(f"finished/{self.rank}"), "1")
        # Out of its store calls before the interpreter destroys the store under it.
        if self.thread is not None:
            self.thread.join(timeout=5.0)

    # The thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.stopped.wait(self.interval_s):
                self.store.add(self.beat_key(self.rank), 1)
                finding = self._check()
                if finding is not None:
                    self.report(*finding)
                    return
        except dist.DistError:
            return  # the store is gone: its host has exited, the job is ending

    def _check(self) -> tuple[int, str] | None:
        now = time.monotonic()
        blocked = comm.blocked_in()
        if blocked is None:
            if not self.outside_armed:
                return None
            idle = now - max(comm.last_activity(), self.started)
            if idle > self.bound_s:
                return self.rank, (f"hung: no collective for {idle:.1f} s "
                                   f"(--watchdog-timeout-seconds {self.bound_s:g}); main thread "
                                   f"in {self.main_thread_calls()}")
            return None
        waited = now - blocked.since
        if waited <= self.bound_s / 2:
            return None
        where = f"{blocked.op} over ranks {_ranks_of(blocked)}"
        for peer, silent in self.silent_peers(now):
            if silent > self.bound_s:
                return peer, (f"no heartbeat for {silent:.1f} s (dead or frozen; "
                              f"--watchdog-timeout-seconds {self.bound_s:g}); rank {self.rank} "
                              f"waits for it in {where}")
        if waited > 2 * self.bound_s:
            return self.rank, (f"hung: waited {waited:.1f} s in {where} (twice "
                               f"--watchdog-timeout-seconds {self.bound_s:g}); every peer's "
                               "heartbeat is alive: a peer waits in another collective?")
        return None

    # Peers' heartbeats --------------------------------------------------------------------
    def silent_peers(self, now: float) -> list[tuple[int, float]]:
        """``(peer, seconds since its counter last moved)`` for every peer, most silent first
        (a peer's first reading counts as a move)."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        counts = self._read_counters(peers)
        out = []
        for peer, count in zip(peers, counts):
            last = self.seen.get(peer)
            if last is None or last[0] != count:
                self.seen[peer] = (count, now)
            out.append((peer, now - self.seen[peer][1]))
        return sorted(out, key=lambda item: -item[1])

    def stopped_peer(self, store: dist.Store) -> int | None:
        """Called by a failing main thread: the first peer whose heartbeat does not move over
        a few intervals (a killed rank), or None. ``store``: the caller's own client."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        before = self._read_counters(peers, store)
        time.sleep(2.5 * self.interval_s)
        after = self._read_counters(peers, store)
        for peer, old, new in zip(peers, before, after):
            if old == new and not store.check([self.key(f"finished/{peer}")]):
                return peer
        return None

    def _read_counters(self, peers: list[int], store: dist.Store | None = None) -> list[int]:
        store = store or self.store
        keys = [self.beat_key(r) for r in peers]
        if store.check(keys):  # one round trip for all of them
            return [int(v) for v in store.multi_get(keys)]
        return [store.add(k, 0) for k in keys]  # a peer not beating yet: 0

    def main_thread_calls(self) -> str:
        """The main thread's innermost calls, outermost first: ``f > g > h (file:line)``."""
        frame = sys._current_frames().get(self.main.ident)
        if frame is None:
            return "(main thread gone)"
        stack = traceback.extract_stack(frame)[-_FRAMES_SHOWN:]
        names = " > ".join(entry.name for entry in stack)
        last = stack[-1]
        return f"{names} ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"


def _ranks_of(blocked: comm.Blocked) -> list[int]:
    """The ranks of the group a blocked collective runs over."""
    group = blocked.group
    if group is None:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return []
