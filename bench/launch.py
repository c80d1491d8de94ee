"""Spawned process worlds for the benchmarks (bench/ imports nothing from tests/).

``run_ranks(world_size, fn, *args)`` starts ``world_size`` fresh interpreters (``spawn``, never
``fork``), gives each torchrun's rendezvous variables for a world on 127.0.0.1 and one compute
thread, calls ``fn(rank, world_size, *args)`` in each (``fn`` at module level: it is pickled by
reference) and returns the values by rank. ``fn`` starts torch.distributed itself where it needs
it (``megatron.core.device.init_distributed(backend="gloo")`` reads those variables), so a
one-process baseline can run without it; the model-parallel groups and the process group are torn
down after it returns. Unlike the tests' pooled worlds, every call gets fresh processes: a
measurement starts from a clean interpreter, and its process-wide settings end with it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_one_thread_each(procs: list) -> None:
    """Start ``procs`` with OMP_NUM_THREADS=1 in their environment (read when they import
    torch), leaving this process's own setting as it was."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for proc in procs:
            proc.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple,
               results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - the parent raises it, with this rank's traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _collect(procs: list, results: mp.Queue, timeout: float) -> tuple[dict, dict]:
    """Values and tracebacks by rank, until every rank answered, the time is up or every
    process is gone; after a failure the others get 5 s (they may wait in a collective)."""
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(values) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
            continue
        (values if ok else errors)[rank] = value
        if errors:
            deadline = min(deadline, time.monotonic() + 5.0)
    return values, errors


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 900.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    Returns:
        Each rank's return value, by rank.

    Raises:
        RuntimeError: a rank raised, died or did not return within ``timeout`` seconds (the
            message holds the tracebacks); every process is stopped first.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results))
             for r in range(world_size)]
    start_one_thread_each(procs)
    try:
        values, errors = _collect(procs, results, timeout)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors or len(values) < world_size:
        silent = sorted(set(range(world_size)) - set(values) - set(errors))
        report = [f"{fn.__qualname__} failed on a world of {world_size} processes"]
        report += [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())]
        if silent:
            report.append(f"--- ranks {silent} died or did not return within {timeout:g} s")
        raise RuntimeError("\n".join(report))
    return [values[r] for r in range(world_size)]


_ITER_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def entry_point_command(args: list[str], tp: int) -> list[str]:
    """One of our entry points (``args[0]`` a script) as one process at TP=1, else under
    torchrun with one process per tensor-parallel rank."""
    if tp == 1:
        return [sys.executable, *args]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--nproc-per-node", str(tp), *args]


def median_iteration_seconds(cmd: list[str], root: str, tp: int, warmup: int,
                             steps: int) -> float:
    """Run ``cmd`` in ``root`` (2 threads over its ``tp`` processes) and return the median of
    its logged "elapsed time per iteration" after ``warmup`` iterations.

    Raises:
        RuntimeError: a failed run, or fewer than ``warmup + steps`` logged iterations.
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(2 // tp), PYTHONPATH=root)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    times = [float(m) / 1000.0 for m in _ITER_MS.findall(out)]
    if proc.returncode != 0 or len(times) < warmup + steps:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{out[-3000:]}")
    return statistics.median(times[warmup:])
