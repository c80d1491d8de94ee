"""Megatron's pretraining batch samplers and the data-loader factory.

Both samplers yield, per data-parallel rank, lists of ``micro_batch_size`` sample indices, and
resume exactly from ``consumed_samples`` (the global count of samples already trained on, saved
in checkpoints), so a restarted run continues the same order.
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
from typing import Iterator

import torch


def _check(total: int, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if total <= 0:
        raise ValueError(f"no samples to load (dataset length {total})")
    if consumed >= total:
        raise ValueError(f"consumed_samples {consumed} >= dataset length {total}: nothing left")
    if micro_batch_size <= 0 or dp_size <= 0:
        raise ValueError(f"--micro-batch-size {micro_batch_size} and data-parallel size {dp_size} "
                         "must be positive")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} outside [0, {dp_size})")


class MegatronPretrainingSampler:
    """Sequential over ``[consumed_samples, total_samples)``: every ``mbs * dp`` consecutive
    indices form one global micro-batch, of which DP rank r takes slice ``[r*mbs, (r+1)*mbs)``.

    Args:
        total_samples: length of the dataset.
        consumed_samples: samples already consumed by all ranks together.
        micro_batch_size: samples per rank per micro-batch.
        data_parallel_rank: this rank's DP index.
        data_parallel_size: DP world size.
        drop_last: drop a last incomplete global micro-batch.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
               data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _mine(self, batch: list[int]) -> list[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.global_micro_batch:
                yield self._mine(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._mine(batch)


class MegatronPretrainingRandomSampler:
    """Cyclic sampler (``--dataloader-type cyclic``): each epoch a fresh random order seeded by
    the epoch number; every iteration continues from ``consumed_samples``.

    With data sharding (Megatron's default) each DP rank owns a contiguous bucket of the
    dataset and shuffles it with ``torch.randperm(bucket, generator=manual_seed(epoch))``.
    The last ``total % (mbs * dp)`` samples are left out of every epoch.
    """

    def __init__(self, dataset: torch.utils.data.Dataset | None, total_samples: int,
                 consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, data_sharding: bool = True) -> None:
        _check(total_samples, 0, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.global_micro_batch
        if total_samples < self.global_micro_batch:
            raise ValueError(f"dataset of {total_samples} samples is smaller than one global "
                             f"micro-batch ({self.global_micro_batch})")

    def __len__(self) -> int:
        return self.total_samples

    def _order(self, epoch: int, epoch_consumed: int) -> list[int]:
        g = torch.Generator()
        g.manual_seed(epoch)
        if self.data_sharding:
            bucket = (self.total_samples // self.global_micro_batch) * self.micro_batch_size
            start = self.data_parallel_rank * bucket
            perm = torch.randperm(bucket, generator=g, device="cpu").tolist()
            return [start + x for x in perm[epoch_consumed // self.data_parallel_size :]]
        full = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        perm = torch.randperm(full, generator=g, device="cpu").tolist()[epoch_consumed:]
        return perm[self.data_parallel_rank :: self.data_parallel_size]

    def __iter__(self) -> Iterator[list[int]]:
        active = self.total_samples - self.last_batch_size
        epoch = self.consumed_samples // active
        epoch_consumed = self.consumed_samples % active
        if epoch_consumed % self.global_micro_batch:
            raise ValueError(f"consumed_samples {self.consumed_samples} is not a multiple of "
                             f"micro-batch x data-parallel size {self.global_micro_batch}")
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        batch: list[int] = []
        for idx in self._order(epoch, epoch_consumed):
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.global_micro_batch
                yield batch
                batch = []


def _accelerator_present() -> bool:
    from megatron.core import device

    return device.accelerator_available()


def build_pretraining_data_loader(dataset: torch.utils.data.Dataset | None, consumed_samples: int,
                                  dataloader_type: str | None, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int = 2) -> torch.utils.data.DataLoader | None:
    """A DataLoader over ``dataset`` with Megatron's sampler for ``--dataloader-type``.

    Args:
        dataset: the split's dataset (None -> None).
        consumed_samples: samples already trained on (resume point).
        dataloader_type: "single" (default when None) or "cyclic".
        micro_batch_size: samples per rank per micro-batch.
        data_parallel_rank: this rank's DP index.
        data_parallel_size: DP world size.
        num_workers: --num-workers loader processes.

    Raises:
        ValueError: unknown --dataloader-type.
    """
    if dataset is None:
        return None
    kind = dataloader_type or "single"
    if kind == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                             data_parallel_rank, data_parallel_size)
    elif kind == "cyclic":
        sampler = MegatronPretrainingRandomSampler(dataset, len(dataset), consumed_samples,
                                                   micro_batch_size, data_parallel_rank,
                                                   data_parallel_size)
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r}: expected 'single' or 'cyclic'")
    # Every iter(loader) draws a worker base seed from loader.generator; with None that is the
    # default torch generator, which on the CPU is also the dropout stream, so building the
    # iterators after a checkpoint restored the RNG state would shift every later dropout mask
    # (resume would not be exact). A private generator keeps the loader off the model's RNG.
    generator = torch.Generator().manual_seed(0)
    init = functools.partial(_init_worker, os.getpid()) if num_workers else None
    return _PretrainingDataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                  pin_memory=_accelerator_present(),
                                  persistent_workers=num_workers > 0, generator=generator,
                                  worker_init_fn=init)


# Loader worker processes of this process that stop_loader_workers() ends.
_WORKERS: set[multiprocessing.Process] = set()


class _PretrainingDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose worker processes :func:`stop_loader_workers` can end.

    torch starts the workers when the iterator is made; they are the children that appear
    across ``__iter__`` (with persistent workers, only the first call starts any).
    """

    def __iter__(self):
        before = set(multiprocessing.active_children())
        iterator = super().__iter__()
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

    torchrun and SLURM signal a rank's whole process group, workers included. A worker killed by
    it makes the rank fail ("DataLoader worker ... is killed by signal") before
    --exit-signal-handler can finish the iteration and save. The workers still stop when the
    loader shuts them down, when :func:`stop_loader_workers` kills them, and (on Linux, through
    ``prctl(PR_SET_PDEATHSIG)``) the moment their parent process dies, whatever kills it;
    elsewhere torch's watchdog notices a dead parent within seconds.
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
