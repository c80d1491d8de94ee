"""Fail fast: a rank that fails ends at once with its message and a nonzero exit code, and the
other ranks hear of it and end too, naming the first rank that failed.

Entry points run their work as ``fault.run_rank(main)``. Any exception out of ``main`` (a
``KeyboardInterrupt`` from SIGINT included) prints its traceback, is recorded in the
rendezvous store (torch.distributed's TCPStore at ``MASTER_ADDR:MASTER_PORT``) as
``"rank N failed: <error>"`` unless an earlier failure is recorded there already, and ends the
process with ``os._exit``: no exit hook, loader worker or process-group destructor can keep a
failed rank alive. Exit codes: 1; 130 for SIGINT; a ``SystemExit``'s own code.

Two daemon threads cover what the main thread cannot see while it is blocked in a collective
(Python runs no signal handler and raises nothing there until the collective returns):

* the peer watcher (:func:`watch_peers`, once the process groups exist, worlds above one) waits
  on the store; when a failure is recorded it logs ``"stopping: rank N failed: ..."`` and ends
  its rank with exit code 1 (NCCL never notices a dead peer before the timeout);
* the signal watcher ends the rank with exit code 130 when a SIGINT is still unhandled after
  :data:`SIGINT_GRACE_S` (unless the entry point stops on it itself:
  :func:`handle_stop_signals`).

Under torchrun the store lives in the launcher. Launched without it (srun-style ``RANK`` /
``WORLD_SIZE`` variables) rank 0 hosts it, so rank 0 waits, at most :data:`LINGER_S`, for the
other ranks to read it before exiting.

A rank that fails because a peer vanished (killed: it records nothing, and the broken
connection names no rank) names that peer as the first failure: through the watchdog's
heartbeats when it is on, else through the peer's process on this machine
(:mod:`megatron.training.peer_processes`), or, without torchrun, a store whose host (rank 0)
no longer answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from megatron.core.log import get_logger, log_all_ranks
from megatron.training import peer_processes
from megatron.training.watchdog import Watchdog

LINGER_S = 5.0
"""Longest a store-hosting rank 0 waits, before it exits, for the others to read the store."""
SIGINT_GRACE_S = 2.0
"""How long the main thread has to act on SIGINT before the signal watcher ends the rank."""

_STORE_TIMEOUT = datetime.timedelta(seconds=10)
_WATCH_WAIT = datetime.timedelta(days=1)  # the wait only ends early when the event is set
_SUMMARY_CHARS = 500


@dataclasses.dataclass
class _Peers:
    """This rank's connections to the rendezvous store, and the keys of this run."""

    rank: int
    world_size: int
    hosts_store: bool
    watch_store: dist.Store  # the peer watcher's alone: a blocked wait holds the client
    report_store: dist.Store  # the ending thread's
    prefix: str

    def key(self, name: str) -> str:
        return self.prefix + name

    def wake_key(self, rank: int) -> str:
        """Set to "failed" for every rank when one fails, to "done" by a rank that finished."""
        return self.key(f"wake/{rank}")

    def machine_key(self, machine: str) -> str:
        """Where the ranks on ``machine`` record their pids (see :mod:`peer_processes`)."""
        return self.key(f"processes/{machine}")

    def finished(self, rank: int) -> bool:
        """``rank`` ended normally (its watcher was woken with "done")."""
        key = self.wake_key(rank)
        return self.report_store.check([key]) and self.report_store.get(key) == b"done"


_guarded = False
_peers: _Peers | None = None
# Held by the one thread that ends the rank: the main thread on an error, or a watcher.
_ending = threading.Lock()
_stop_signals_handled = threading.Event()
_left_lock = threading.Lock()
_left = False
_watcher: threading.Thread | None = None
_watchdog: Watchdog | None = None


def run_rank(main: Callable[[], object]) -> None:
    """Run an entry point's ``main`` so that any failure ends this rank at once.

    On success the rank tells its peers it is done (their watchers stop) and returns. A
    ``SystemExit`` with code 0, or one before the process groups exist (argparse's exit 2 on a
    bad flag), propagates as usual.
    """
    global _guarded
    _guarded = True
    _watch_sigint()
    try:
        main()
    except SystemExit as exc:
        if exc.code not in (0, None) and _peers is not None:
            _fail(None, f"SystemExit: {exc.code}", exc.code if isinstance(exc.code, int) else 1)
        _finish()
        raise
    except KeyboardInterrupt as exc:
        _fail(exc, "interrupted (SIGINT)", 130)
    except BaseException as exc:  # noqa: BLE001 - every failure ends the rank the same way
        _fail(exc, _summary(exc), 1)
    _finish()


def watch_peers(watchdog_timeout_s: float | None = None) -> None:
    """Under :func:`run_rank`, connect to the rendezvous store and start the peer watcher (and
    with ``watchdog_timeout_s``, ``--watchdog-timeout-seconds``, the watchdog of
    :mod:`megatron.training.watchdog`).

    Called by ``initialize_distributed`` once the process groups exist; a no-op otherwise
    (a world of one, in-process callers of ``pretrain`` such as the tests, a second call).
    """
    global _peers
    if not _guarded or _peers is not None or not dist.is_initialized():
        return
    world_size = dist.get_world_size()
    if world_size == 1:
        return
    rank = dist.get_rank()
    # torchrun's agent hosts the store (and outlives the ranks) when it says so; otherwise the
    # env:// rendezvous made rank 0 the host.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    # Keys of an earlier attempt stay in torchrun's store across elastic restarts.
    prefix = f"megatron/fault/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    try:
        stores = _connect(), _connect()
    except (RuntimeError, OSError) as err:  # the run works without it, less promptly
        log_all_ranks(f"WARNING: no peer failure watch (rendezvous store unreachable: {err})",
                      logging.WARNING)
        return
    global _watcher
    _peers = _Peers(rank, world_size, hosts_store=rank == 0 and not agent_store,
                    watch_store=stores[0], report_store=stores[1], prefix=prefix)
    _watcher = threading.Thread(target=_watch_peers, args=(_peers,), name="megatron-peer-watch",
                                daemon=True)
    _watcher.start()
    with contextlib.suppress(dist.DistError):  # without it a vanished peer goes unnamed
        peer_processes.announce(_peers.report_store, _peers.machine_key, rank)
    if watchdog_timeout_s is not None:
        _start_watchdog(_peers, watchdog_timeout_s)


def _start_watchdog(peers: _Peers, bound_s: float) -> None:
    global _watchdog
    try:
        store = _connect()
    except (RuntimeError, OSError) as err:
        log_all_ranks(f"WARNING: no watchdog (rendezvous store unreachable: {err})",
                      logging.WARNING)
        return
    _watchdog = Watchdog(store, peers.rank, peers.world_size, peers.key, bound_s,
                         _stop_from_watchdog)
    _watchdog.start()


def _stop_from_watchdog(failed_rank: int, message: str) -> None:
    """Watchdog thread: end this rank for a hang (``failed_rank`` is this rank) or a dead or
    frozen peer; returns at once if the rank is ending already."""
    if not _ending.acquire(blocking=False):
        return
    mine = failed_rank == _peers.rank
    log_all_ranks(f"failed: {message}" if mine else
                  f"stopping: rank {failed_rank} failed: {message}", logging.ERROR)
    first = _record(message, failed_rank)
    expected = f"rank {failed_rank} failed: {message}"
    if first is not None and first != expected:
        log_all_ranks(f"(first recorded failure: {first})", logging.ERROR)
    _end(1)


@contextlib.contextmanager
def hang_watch(armed: bool = True):
    """Within the block, the watchdog (if on) checks for a main thread stuck outside
    collectives (``armed``), or does not (``armed=False``: a checkpoint save or an evaluation
    inside the training loop). Set-up, before the loop, is never checked: index building and
    checkpoint loading run long without collectives by design."""
    if _watchdog is None:
        yield
        return
    previous = _watchdog.arm_outside_check(armed)
    try:
        yield
    finally:
        _watchdog.arm_outside_check(previous)


def _silent_peer_summary(summary: str) -> tuple[int | None, str]:
    """With the watchdog on: a peer whose heartbeat stopped (a killed rank breaks this rank's
    connections, and the error would name only this rank) is the first failure, with this
    rank's error attached. Otherwise ``(None, summary)``."""
    if _watchdog is None or _peers is None:
        return None, summary
    try:
        peer = _watchdog.stopped_peer(_peers.report_store)
    except dist.DistError:
        return None, summary
    if peer is None:
        return None, summary
    return peer, (f"stopped (no heartbeat: killed or crashed); rank {_peers.rank} then "
                  f"failed: {summary}")


def _vanished_peer_summary(summary: str) -> tuple[int | None, str]:
    """Without the watchdog: a peer whose process on this machine is gone (a killed rank breaks
    this rank's connections, and gloo's error names only an address), or, launched without
    torchrun, a store that stopped answering (its host, rank 0, is gone), is the first
    failure, with this rank's error attached. Otherwise ``(None, summary)``."""
    peers = _peers
    if peers is None:
        return None, summary
    try:
        found = peer_processes.vanished_peer(peers.report_store, peers.machine_key,
                                             peers.finished, peers.rank)
    except dist.DistError:
        found = _store_host_gone(peers)
    if found is None:
        return None, summary
    peer, fate = found
    return peer, f"{fate}; rank {peers.rank} then failed: {summary}"


def _store_host_gone(peers: _Peers) -> tuple[int, str] | None:
    """The store does not answer: launched without torchrun, its host is rank 0 (under
    torchrun the agent hosts it, and names a rank that died itself)."""
    if peers.hosts_store or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return None
    return 0, ("gone (the rendezvous store it hosts no longer answers: killed, crashed or "
               "ended)")


def _connect() -> dist.Store:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False)


def _summary(exc: BaseException) -> str:
    """``Type: first line of the message``; for an error re-raised from a loader worker, the
    worker's own error line first (torch puts it last, after the worker's traceback)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) > 1 and lines[1].startswith("Original Traceback"):
        return f"{lines[-1]} ({lines[0].rstrip('.')})"[:_SUMMARY_CHARS]
    return f"{type(exc).__name__}: {lines[0]}"[:_SUMMARY_CHARS]


# Ending the rank --------------------------------------------------------------------------
def _fail(exc: BaseException | None, summary: str, code: int) -> NoReturn:
    """Main thread: traceback, failure record, loader workers killed, exit ``code``."""
    from megatron.data.loader import stop_loader_workers

    _ending.acquire()  # blocks for good if a watcher is ending the rank already
    if exc is not None:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    culprit, record = _silent_peer_summary(summary)
    if culprit is None:
        culprit, record = _vanished_peer_summary(summary)
    first = _record(record, culprit)
    if first is None and culprit is not None:  # the store is gone: say it here at least
        first = f"rank {culprit} failed: {record}"
    if first is not None and not first.startswith(f"rank {_peers.rank} failed: "):
        log_all_ranks(f"failed ({summary}) after another rank: {first}", logging.ERROR)
    else:
        log_all_ranks(f"failed: {summary}", logging.ERROR)
    stop_loader_workers()
    _end(code)


def _record(summary: str, failed_rank: int | None = None) -> str | None:
    """Record the failure of ``failed_rank`` (by default this rank) unless one is recorded
    already; returns the first record (None without peers, or when the store is
    unreachable)."""
    peers = _peers
    if peers is None:
        return None
    store = peers.report_store
    failed_rank = peers.rank if failed_rank is None else failed_rank
    try:
        first = store.compare_set(peers.key("first"), "",
                                  f"rank {failed_rank} failed: {summary}").decode()
        for rank in range(peers.world_size):  # wake every watcher, finished ranks' included
            store.set(peers.wake_key(rank), "failed")
    except dist.DistError:
        return None  # the store's host is gone: the peers learn from their collectives
    _leave(store)
    return first


def _end(code: int) -> NoReturn:
    """Exit now (after the store's host lingers): no exit hooks, destructors or thread joins
    that could wait on a peer. Loader workers die with the process (PR_SET_PDEATHSIG)."""
    if _peers is not None:
        _linger(_peers, _peers.report_store)
    for handler in get_logger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _finish() -> None:
    """Normal end: wake this rank's watcher with "done" (the store's host waits until every
    rank is done with the store before it exits)."""
    # Claim the ending: a late SIGINT watcher must not cut a finished rank's clean exit short
    # (if a watcher holds it already, that watcher is ending the rank).
    if not _ending.acquire(blocking=False):
        return
    peers = _peers
    if peers is None:
        return
    try:
        if _watchdog is not None:
            _watchdog.stop(peers.report_store)
        # Only this rank's watcher: the others keep watching until their own rank is done.
        peers.report_store.compare_set(peers.wake_key(peers.rank), "", "done")
    except dist.DistError:
        return  # the host is gone already
    _linger(peers, peers.report_store)
    # Let the watcher leave its store call before the interpreter tears the stores down under
    # it (a C++ store destroyed while another thread waits on it aborts the process).
    if _watcher is not None:
        _watcher.join(timeout=LINGER_S)


def _leave(store: dist.Store) -> None:
    """Count this rank (once) among those done with the store."""
    global _left
    with _left_lock:
        if _left:
            return
        _left = True
        try:
            store.add(_peers.key("left"), 1)
        except dist.DistError:
            pass  # the host is gone: nobody is counting


def _linger(peers: _Peers, store: dist.Store) -> None:
    """The store's host waits (at most LINGER_S) until every rank is done with the store."""
    if not peers.hosts_store:
        return
    deadline = time.monotonic() + LINGER_S
    try:
        while store.add(peers.key("left"), 0) < peers.world_size and \
                time.monotonic() < deadline:
            time.sleep(0.05)
    except dist.DistError:
        pass


# Watchers ---------------------------------------------------------------------------------
def _watch_peers(peers: _Peers) -> None:
    """Peer watcher thread: wait for the event; on a recorded failure, end this rank."""
    store = peers.watch_store
    try:
        while True:
            try:
                store.wait([peers.wake_key(peers.rank)], _WATCH_WAIT)
                break
            except dist.DistStoreError:
                continue  # the wait timed out: keep waiting
        failed = store.get(peers.wake_key(peers.rank)) == b"failed"
        record = store.get(peers.key("first")).decode() if failed else ""
    except dist.DistError:
        return  # the store is gone: its host has exited
    if not failed or not _ending.acquire(blocking=False):
        _leave(store)  # a rank finished, or this rank is ending already
        return
    log_all_ranks(f"stopping: {record}", logging.ERROR)
    _leave(store)
    _end(1)


def _watch_sigint() -> None:
    """Start the signal watcher. Python's C-level handler writes every caught signal's number
    to the wakeup fd at once, from whatever thread the signal lands on, even while the main
    thread is blocked."""
    if threading.current_thread() is not threading.main_thread():
        return  # set_wakeup_fd is the main thread's
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_sigint_watcher, args=(read_fd,), name="megatron-sigint-watch",
                     daemon=True).start()


def handle_stop_signals() -> None:
    """The entry point stops on SIGINT / SIGTERM itself, on every rank (a server: its leader
    ends the others through a collective): the signal watcher leaves SIGINT to it."""
    _stop_signals_handled.set()


def _sigint_watcher(read_fd: int) -> None:
    while signal.SIGINT not in os.read(read_fd, 64) or _stop_signals_handled.is_set():
        pass
    time.sleep(SIGINT_GRACE_S)
    if not _ending.acquire(blocking=False):
        return  # the main thread is ending the rank
    summary = "interrupted (SIGINT)"
    log_all_ranks(f"failed: {summary}, while the main thread was blocked (in a collective?)",
                  logging.ERROR)
    _record(summary)
    _end(130)
