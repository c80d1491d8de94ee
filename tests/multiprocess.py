"""Run a test function on N gloo ranks on this machine.

    from tests.multiprocess import run_distributed

    def _check_all_reduce(rank, world_size, value):   # module level: pickled by reference
        ...
        return something_picklable

    def test_all_reduce():
        results = run_distributed(4, _check_all_reduce, 3.0)   # one result per rank

Worlds are pooled: the first test asking for N ranks starts N processes, which initialize gloo
on 127.0.0.1 and then serve test functions until the session ends; a pooled call costs
0.05-0.3 s. The processes are forked by a ``forkserver`` that imported torch and megatron once
(never ``fork`` from this process: fork deadlocks in long gloo sessions; the server runs no
gloo and no threads), so a world starts in about a second where ``spawn``, importing torch in
every rank, took 7-10 s. Each rank takes this process's environment as it was at the start.
After every call each rank destroys its model-parallel groups, resets the python, numpy and torch
RNGs (to :data:`RESET_SEED`) and the model-parallel RNG tracker, and meets the others at a barrier,
so the next test starts clean whatever the previous one seeded. If any rank raises, or a call
exceeds its timeout (a hang), the whole world is killed and the error shows every failing rank's
traceback and which ranks never returned; the next test gets a fresh world with a fresh rendezvous
port. Each rank runs with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench.launch import free_port, start_one_thread_each

DEFAULT_TIMEOUT_S = 180.0
_STARTUP_TIMEOUT_S = 120.0
RESET_SEED = 0
"""Seed of every rank's python, numpy and torch RNGs at the start of each pooled call."""


def _reset_rng_state() -> None:
    """Python, numpy and torch (every device) RNGs to RESET_SEED; no model-parallel streams."""
    import random

    import numpy as np
    import torch

    from megatron.core.tensor_parallel.random import get_rng_tracker

    random.seed(RESET_SEED)
    np.random.seed(RESET_SEED)
    torch.manual_seed(RESET_SEED)
    get_rng_tracker().reset()


def _worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue,
            environ: dict[str, str]) -> None:
    os.environ.clear()  # the forkserver's environment is that of its own start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from megatron.core import comm, device, parallel_state

    try:
        device.init_distributed(backend="gloo", timeout_minutes=5)
        _reset_rng_state()
        results.put((rank, "ready", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = fn(rank, world_size, *args, **kwargs)
            status = "ok"
        except BaseException:  # noqa: BLE001 - reported to the parent
            out, status = traceback.format_exc(), "error"
        finally:
            parallel_state.destroy_model_parallel()
            _reset_rng_state()
        if status == "ok":
            # Tell the parent this rank is out of fn: a hang then names the ranks still inside.
            results.put((rank, "returned", None))
            try:
                comm.barrier(comm.world_group())
            except BaseException:  # noqa: BLE001
                out, status = traceback.format_exc(), "error"
        results.put((rank, status, out))
    torch.distributed.destroy_process_group()


# What the forkserver imports before it forks ranks: what every rank imports anyway.
_PRELOAD = ["torch", "torch.distributed", "numpy", "megatron.core.parallel_state",
            "megatron.core.comm", "megatron.training.pretrain", "pretrain_gpt",
            "tests.multiprocess", "tests.training.e2e"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class DistributedWorld:
    """N gloo ranks (forked by the forkserver) that run test functions on request."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = _context()
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world_size, port, self.tasks[r], self.results,
                                        dict(os.environ)))
                      for r in range(world_size)]
        start_one_thread_each(self.procs)
        self._collect("ready", _STARTUP_TIMEOUT_S, what="start-up")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        return self._collect("ok", timeout, what=f"{fn.__module__}.{fn.__qualname__}")

    def _collect(self, expected: str, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        returned: set[int] = set()
        while len(outputs) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.alive() and self.results.empty():
                break
            try:
                rank, status, out = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if status == "returned":
                returned.add(rank)
            elif status == "error":
                if not errors:
                    # Ranks that did not fail are probably stuck in a collective with the failed
                    # one: give them 5 s from the first error, not the whole timeout.
                    deadline = min(deadline, time.monotonic() + 5.0)
                errors[rank] = out
            else:
                outputs[rank] = out
        if errors or len(outputs) < self.world_size:
            dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
            self.close(force=True)
            missing = sorted(set(range(self.world_size)) - set(outputs) - set(errors))
            report = [f"{what} failed on a world of {self.world_size} gloo ranks"]
            report += [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())]
            crashed = [r for r in missing if r in dead]
            hung = [r for r in missing if r not in returned and r not in dead]
            waiting = [r for r in missing if r in returned and r not in dead]
            if crashed:
                report.append(f"--- ranks {crashed} died (exit codes "
                              f"{[dead[r] for r in crashed]})")
            if hung:
                report.append(f"--- ranks {hung} did not finish within {timeout:g} s: hung "
                              f"(in a collective, a sleep or a loop)")
            if waiting:
                report.append(f"--- ranks {waiting} returned and waited for the others in the "
                              "closing barrier")
            raise RuntimeError("\n".join(report))
        return [outputs[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


_WORLDS: dict[int, DistributedWorld] = {}


def run_distributed(world_size: int, fn: Callable, *args: Any,
                    timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank of a gloo world.

    ``fn`` must be defined at module level. Returns each rank's return value, by rank.

    Raises:
        RuntimeError: a rank raised or did not finish within ``timeout`` seconds; the message
            holds every failing rank's traceback.
    """
    world = _WORLDS.get(world_size)
    if world is None or not world.alive():
        world = _WORLDS[world_size] = DistributedWorld(world_size)
    try:
        return world.run(fn, args, kwargs, timeout)
    except RuntimeError:
        _WORLDS.pop(world_size, None)
        raise


def close_worlds(keep: int | None = None) -> None:
    """Stop the pooled worlds, but the one of ``keep`` ranks (idle worlds hold their memory)."""
    for size in [s for s in _WORLDS if s != keep]:
        _WORLDS.pop(size).close()


@atexit.register
def _close_worlds() -> None:
    close_worlds()
