"""Fail fast: an error on any rank ends that rank at once, with its message and a
nonzero exit code, loader workers and all, and the other ranks stop too, naming the rank that
failed first.

Real processes (the point is how they exit): ``pretrain_gpt.py``, or
``fail_fast_driver.py`` (the same script with one injected fault), on a tiny GPT over
``--mock-data`` with two loader workers, alone or as two ranks launched srun-style (the
``RANK``/``WORLD_SIZE`` variables, no torchrun: nobody else stops the job). Runs that belong to
one test start together, so their start-ups overlap. Before the fix every case here hung: the
workers ignore SIGTERM, which is all that Python's exit sends them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bench.launch import free_port

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("fail_fast_driver.py")
# Hang detection only: a healthy run of this size takes seconds, plus start-up on a busy machine.
WALL_S = 240
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "1000",
         "--use-cpu-initialization", "--eval-iters", "0", "--log-interval", "1",
         "--distributed-backend", "gloo", "--num-workers", "2"]
_MARK = "MEGATRON_FAIL_FAST_TEST"


def _env(tag: str, rank: int | None = None, world_size: int = 1, port: int = 0) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    env[_MARK] = tag  # inherited by loader workers: finds any left behind
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    return env


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        # A session of its own, as torchrun and srun give each rank.
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _driver(fault: str, rank: int, iteration: int, iters: int = 20) -> list[str]:
    return [sys.executable, str(DRIVER), fault, str(rank), str(iteration), "--",
            *FLAGS, "--train-iters", str(iters)]


def _wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, Path]) -> dict[str, int]:
    """Exit codes; processes still running after WALL_S are killed and reported as hangs."""
    deadline = time.monotonic() + WALL_S
    hung = []
    try:
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                hung.append(name)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert not hung, f"still running after {WALL_S} s (hung): {hung}\n" + "\n".join(
        f"--- {name}:\n{_text(logs[name])[-1500:]}" for name in hung)
    return {name: proc.returncode for name, proc in procs.items()}


def _left_behind(tag: str) -> list[int]:
    """Pids of processes (loader workers) still alive with the test's mark in their env."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"{_MARK}={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _assert_no_workers_left(tag: str) -> None:
    deadline = time.monotonic() + 10  # torch's watchdog where no death signal exists
    while _left_behind(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _left_behind(tag), "loader workers outlived their rank"


def _text(log: Path) -> str:
    return log.read_text(errors="replace")


def _signal_after(proc: subprocess.Popen, log: Path, text: str, delay: float = 0.0) -> None:
    """SIGINT to ``proc`` alone (not its loader workers) once ``text`` is in ``log``."""
    deadline = time.monotonic() + WALL_S
    while text not in _text(log):
        assert proc.poll() is None, f"exited before {text!r}:\n{_text(log)[-3000:]}"
        assert time.monotonic() < deadline, f"{text!r} never came:\n{_text(log)[-3000:]}"
        time.sleep(0.2)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_error_after_the_loaders_start_ends_the_rank(tmp_path):
    """One process, two loader workers: an error in the training process, a corrupt sample
    (raised in a worker) and a worker killed as by the OOM killer each end the run with exit
    code 1 and the error; SIGINT to pretrain_gpt.py ends it with 130. None leaves a worker
    behind."""
    tag = uuid.uuid4().hex
    cases = {"raise": "InjectedFailure: injected failure at iteration 3",
             "corrupt": "InjectedFailure: corrupt sample 8 (Caught InjectedFailure in "
                        "DataLoader worker process",
             "kill-worker": "RuntimeError: DataLoader worker (pid"}
    logs = {name: tmp_path / f"{name}.log" for name in [*cases, "sigint"]}
    procs = {name: _start(_driver(name, 0, 3), _env(tag), logs[name]) for name in cases}
    procs["sigint"] = _start([sys.executable, str(REPO / "pretrain_gpt.py"), *FLAGS,
                              "--train-iters", "100000"], _env(tag), logs["sigint"])
    try:
        _signal_after(procs["sigint"], logs["sigint"], " iteration        3/")
    finally:
        codes = _wait_all(procs, logs)
    for name, message in cases.items():
        text = _text(logs[name])
        assert codes[name] == 1, f"{name}: exit code {codes[name]}\n{text[-3000:]}"
        assert " iteration        2/" in text, text[-3000:]  # the loaders were running
        assert f"[rank 0] failed: {message}" in text, text[-3000:]
    assert codes["sigint"] == 130, _text(logs["sigint"])[-3000:]
    assert "[rank 0] failed: interrupted (SIGINT)" in _text(logs["sigint"])
    _assert_no_workers_left(tag)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_failed_rank_stops_the_others_and_is_named(tmp_path):
    """Two ranks (DP=2) launched without torchrun, four jobs at once:

    * a corrupt sample on rank 0 (which hosts the rendezvous store): rank 1, waiting in a
      collective, stops at once, naming rank 0 and its error;
    * an error on rank 1: rank 0 stops, naming rank 1;
    * rank 1 vanishes without a word (a crash): rank 0's collective fails, and it exits 1,
      naming rank 1 (its process is gone);
    * rank 1 hangs and rank 0, blocked in a collective with it, gets SIGINT: rank 0 exits 130
      (Python cannot raise KeyboardInterrupt there) and rank 1 stops, naming it.
    """
    tag = uuid.uuid4().hex
    jobs = {"corrupt-on-0": ("corrupt", 0), "raise-on-1": ("raise", 1), "exit-on-1": ("exit", 1),
            "hang-on-1": ("hang", 1)}
    procs, logs = {}, {}
    for job, (fault, faulty) in jobs.items():
        port = free_port()
        for rank in range(2):
            name = f"{job}/rank{rank}"
            logs[name] = tmp_path / f"{job}-rank{rank}.log"
            procs[name] = _start(_driver(fault, faulty, 3),
                                 _env(tag, rank, world_size=2, port=port), logs[name])
    try:
        # Rank 0 is then blocked in the iteration's first collective, waiting for rank 1.
        _signal_after(procs["hang-on-1/rank0"], logs["hang-on-1/rank1"], "hanging at", 2.0)
    finally:
        codes = _wait_all(procs, logs)

    def check(name, code, *texts):
        text = _text(logs[name])
        assert codes[name] == code, f"{name}: exit code {codes[name]}\n{text[-3000:]}"
        for t in texts:
            assert t in text, f"{name}: {t!r} missing\n{text[-3000:]}"

    corrupt = "InjectedFailure: corrupt sample 8 (Caught InjectedFailure in DataLoader worker"
    check("corrupt-on-0/rank0", 1, f"[rank 0] failed: {corrupt}")
    # Rank 0 keeps its connections open until rank 1 has read the record: the watcher tells.
    check("corrupt-on-0/rank1", 1, f"[rank 1] stopping: rank 0 failed: {corrupt}")
    raised = "rank 1 failed: InjectedFailure: injected failure at iteration 3"
    check("raise-on-1/rank1", 1, f"[rank 1] failed: {raised.split(': ', 1)[1]}")
    # Rank 0 hears it from its watcher or, if rank 1's exit breaks its collective first, from
    # that error; either way it names rank 1.
    check("raise-on-1/rank0", 1)
    assert re.search(rf"^\[rank 0\] (stopping: |failed \(.*\) after another rank: ){raised}",
                     _text(logs["raise-on-1/rank0"]), re.M), _text(logs["raise-on-1/rank0"])
    check("exit-on-1/rank1", 3)
    # it used to say only gloo's "Connection reset by peer"; now it names rank 1,
    # whose process is gone from this machine (no watchdog needed).
    check("exit-on-1/rank0", 1)
    assert re.search(r"^\[rank 0\] failed \(.*\) after another rank: rank 1 failed: gone \(its "
                     r"process \d+ on .* ended without a report: killed or crashed\); rank 0 then "
                     r"failed: RuntimeError: ", _text(logs["exit-on-1/rank0"]), re.M), \
        _text(logs["exit-on-1/rank0"])[-3000:]
    check("hang-on-1/rank0", 130, "[rank 0] failed: interrupted (SIGINT)")
    check("hang-on-1/rank1", 1, "[rank 1] stopping: rank 0 failed: interrupted (SIGINT)")
    _assert_no_workers_left(tag)


_LATE_FAILURE = r"""
import os, time
from megatron.core import comm, device
from megatron.training import fault

def main():
    device.init_distributed("gloo", timeout_minutes=2)
    fault.watch_peers()
    rank = comm.rank(comm.world_group())
    if rank == 2:
        return  # finishes first (and stays up below): must not end the others' failure watch
    if rank == 1:
        # Fails after rank 2 finished, and (as a dead NCCL peer) leaves the others' collective
        # hanging: only the failure record can stop rank 0.
        time.sleep(3)
        fault._ending.acquire()
        fault._record("RuntimeError: late failure on rank one")
        time.sleep(15)
        os._exit(1)
    comm.barrier(comm.world_group())  # rank 0: waits for ranks that never come

fault.run_rank(main)
time.sleep(15)
"""


def test_a_failure_after_another_rank_finished_still_stops_the_rest(tmp_path):
    port = free_port()
    procs = [_start([sys.executable, "-c", _LATE_FAILURE], _env("late", r, 3, port),
                    tmp_path / f"rank{r}.log") for r in range(3)]
    start = time.monotonic()
    code_0 = procs[0].wait(timeout=WALL_S)
    elapsed = time.monotonic() - start
    for proc in procs[1:]:
        proc.wait(timeout=WALL_S)
    log_0 = (tmp_path / "rank0.log").read_text()
    assert code_0 == 1, log_0
    # Stopped by the record, before rank 1 and 2 exit (15 s later) close their connections.
    assert "stopping: rank 1 failed: RuntimeError: late failure on rank one" in log_0, log_0
    assert elapsed < 15, (elapsed, log_0)
