"""The one DataLoader factory of the project, and the care of its worker processes.

Every loader (pretraining, finetuning, evaluation, zero-shot, SQuAD) is built by
:func:`build_data_loader`, so that all of them treat their workers the same way:

* workers ignore SIGTERM: torchrun and SLURM signal a rank's whole process group, workers
  included, and a worker killed by it makes the rank fail ("DataLoader worker ... is killed by
  signal") before ``--exit-signal-handler`` can finish the iteration and save;
* workers die with the rank (``prctl(PR_SET_PDEATHSIG)`` on Linux) and are killed at exit or
  when a rank fails (:func:`stop_loader_workers`), so a SIGTERM-proof worker never outlives it;
* a worker that dies while handing over a batch is named as such (:class:`_NamedWorkerDeath`);
* each loader has a private generator, so building one never draws from the model's RNG.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import multiprocessing
import multiprocessing.util  # noqa: F401 - its exit hook must be registered before ours
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable

import torch


def _accelerator_present() -> bool:
    from megatron.core import device

    return device.accelerator_available()


def build_data_loader(dataset: torch.utils.data.Dataset, batch_sampler: Iterable[list[int]], *,
                      num_workers: int, collate_fn: Callable | None = None,
                      persistent_workers: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader over ``batch_sampler``'s index lists whose workers survive a SIGTERM.

    Args:
        dataset: the samples.
        batch_sampler: yields this rank's micro-batches as lists of indices.
        num_workers: --num-workers loader processes (0: load in the calling process).
        collate_fn: how samples become a batch (None: torch's default collation).
        persistent_workers: keep the workers across ``iter()`` calls (pretraining's one
            endless pass); finetuning makes one iterator per epoch and lets them go.

    Returns:
        The loader; its iterators name a worker that died mid-hand-over.
    """
    # Every iter(loader) draws a worker base seed from loader.generator; with None that is the
    # default torch generator, which on the CPU is also the dropout stream, so building the
    # iterators after a checkpoint restored the RNG state would shift every later dropout mask
    # (resume would not be exact). A private generator keeps the loader off the model's RNG.
    generator = torch.Generator().manual_seed(0)
    init = functools.partial(_init_worker, os.getpid()) if num_workers else None
    return _ProtectedDataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                                collate_fn=collate_fn, pin_memory=_accelerator_present(),
                                persistent_workers=persistent_workers and num_workers > 0,
                                generator=generator, worker_init_fn=init)


# Loader worker processes of this process that stop_loader_workers() ends.
_WORKERS: set[multiprocessing.Process] = set()


class _ProtectedDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose worker processes :func:`stop_loader_workers` can end.

    torch starts the workers when the iterator is made; they are the children that appear
    across ``__iter__`` (with persistent workers, only the first call starts any).
    """

    def __iter__(self):
        before = set(multiprocessing.active_children())
        iterator = super().__iter__()
        # Finetuning starts workers every epoch: forget those torch has already shut down.
        _WORKERS.difference_update([w for w in _WORKERS if not w.is_alive()])
        _WORKERS.update(set(multiprocessing.active_children()) - before)
        return _NamedWorkerDeath(iterator) if self.num_workers > 0 else iterator


class _NamedWorkerDeath:
    """A loader iterator whose broken hand-over from a dead worker says so.

    A worker killed (by the OOM killer, say) after it queued a batch but before the training
    process took the batch's shared memory from it surfaces as a bare ``ConnectionResetError``
    or ``EOFError`` from the socket the memory is passed over, instead of torch's "DataLoader
    worker ... is killed by signal". Both mean the same, and the user should read the same.
    """

    def __init__(self, iterator) -> None:
        self._iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._iterator)
        except (ConnectionError, EOFError) as err:
            dead = sorted(w.pid for w in _WORKERS if not w.is_alive())
            raise RuntimeError(
                f"DataLoader worker (pid(s) {dead or 'unknown'}) died while handing over a "
                f"batch ({type(err).__name__}: {err}); was it killed, by the OOM killer "
                "perhaps?") from err

    def __len__(self) -> int:
        return len(self._iterator)

    def __getattr__(self, name: str):
        return getattr(self._iterator, name)


def stop_loader_workers() -> None:
    """Kill (SIGKILL) and reap every loader worker of this process that is still running.

    The workers ignore SIGTERM (see :func:`_init_worker`), and that is all the standard exit
    path sends them: Python's multiprocessing exit hook SIGTERMs daemonic children and then
    joins them, which waits forever, so a rank that raises after its loaders started would
    never exit. This runs at interpreter exit (before that hook; torch's own hook for loaders
    with pinned memory, registered later, has shut those down gracefully before it) and when
    ``megatron.training.fault`` ends a failed rank.
    """
    workers = [w for w in _WORKERS if w.is_alive()]
    _WORKERS.clear()
    if not workers:
        return
    # torch's SIGCHLD handler raises "DataLoader worker ... is killed by signal" in the main
    # thread for a worker that died while its iterator lives: hold it off until the workers
    # are reaped (then it finds nothing). Only the main thread may change handlers.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL) if in_main else None
    try:
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.join(timeout=10)
    finally:
        if previous is not None:
            signal.signal(signal.SIGCHLD, previous)


# atexit runs hooks last-registered first: this one runs before multiprocessing's (imported
# above), whose SIGTERM-then-join would wait forever on workers still running.
atexit.register(stop_loader_workers)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _init_worker(parent_pid: int, worker_id: int) -> None:
    """Loader workers leave SIGTERM to the training process, and die with it.

    The workers still stop when the loader shuts them down, when :func:`stop_loader_workers`
    kills them, and (on Linux, through ``prctl(PR_SET_PDEATHSIG)``) the moment their parent
    process dies, whatever kills it; elsewhere torch's watchdog notices a dead parent within
    seconds.
    """
    del worker_id
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The death signal follows the worker's parent: only a forked worker's parent is the rank
    # (under forkserver or spawn it is a helper process; torch's watchdog covers those).
    if not sys.platform.startswith("linux") or os.getppid() != parent_pid:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return  # no prctl: torch's watchdog remains
    if os.getppid() != parent_pid:
        os._exit(1)  # the rank died between the check and arming the death signal
