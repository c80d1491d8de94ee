"""A rank dies or hangs: every other rank ends within a bounded time, with a nonzero
exit code and a message naming the rank that failed first.

Real processes (how they exit is the point), launched srun-style (``RANK``/``WORLD_SIZE``, no
torchrun, so nobody but the framework stops the job), tiny GPT on ``--mock-data``, every job of
the test started at once so their start-ups overlap. The fault is injected by :data:`_DRIVER`
(``pretrain_gpt.py`` with a wrapped forward step) on one rank at one iteration:

==========  ======================  =====================================================
layout      fault                    what ends the others
==========  ======================  =====================================================
TP=2        exception on rank 1      the failure record (fault.run_rank), naming rank 1
PP=2        ``os._exit`` on rank 1   the broken connection; the watchdog's heartbeats name
                                     rank 1 (it recorded nothing itself)
DP=2        ``os._exit`` on rank 0   the broken connection; no watchdog: the store rank 0
                                     hosted stops answering, which names it
DP=2        rank 1 sleeps forever    the watchdog on rank 1 (no collective for the bound),
            outside a collective     naming rank 1 and the call it is stuck in
TP2xPP2xDP2 rank 5 sleeps forever    the same, in a world of eight (opt-in:
                                     ``MEGATRON_FAULTS_LARGE=1``; eight start-ups cost
                                     about 50 s of CPU, over the suite's budget)
==========  ======================  =====================================================

Without the watchdog, rank 1 vanishing (its process gone from this machine names it) is
tests/training/test_fail_fast.py's case. The watchdog's own decisions (a frozen peer, a wait in
the wrong collective, the set-up not checked) are unit-tested in tests/training/test_watchdog.py
without processes. The DP=2 cases of tests/training/test_fail_fast.py (exception, exit, SIGINT,
workers) are not repeated. The watchdog's bound is 3 s here; the collective timeout stays at
Megatron's 10 minutes, so a pass cannot come from gloo's timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.launch import free_port
from tests.faults.harness import REPO, Job, child_env

WATCHDOG_S = 3
HANG_S = 240.0  # hang detection only: start-up of eight ranks on a loaded 2-core machine
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
         "--lr", "1e-3", "--mock-data", "--vocab-size", "512", "--use-cpu-initialization",
         "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
         "--distributed-backend", "gloo", "--train-iters", "50"]

# pretrain_gpt.py, with FAULT on global rank RANK at the first forward step of ITERATION.
_DRIVER = r"""
import os, sys, time
sys.path.insert(0, os.getcwd())
import pretrain_gpt
from megatron.training import fault
from megatron.training.pretrain import pretrain

kind, fault_rank, iteration = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
flags = sys.argv[sys.argv.index("--") + 1:]
value = lambda name, default=1: int(flags[flags.index(name) + 1]) if name in flags else default
dp = int(os.environ["WORLD_SIZE"]) // (value("--tensor-model-parallel-size")
                                       * value("--pipeline-model-parallel-size"))
micro_batches = value("--global-batch-size") // (value("--micro-batch-size") * dp)
calls = [0]

def forward_step(data_iterator, model):
    calls[0] += 1
    if int(os.environ["RANK"]) == fault_rank and calls[0] == (iteration - 1) * micro_batches + 1:
        sys.stdout.write(f"FAULT {kind} on rank {fault_rank}\n")
        sys.stdout.flush()
        if kind == "raise":
            raise RuntimeError(f"injected failure at iteration {iteration}")
        if kind == "exit":
            os._exit(3)
        if kind == "hang":
            time.sleep(3600)
    return pretrain_gpt.forward_step(data_iterator, model)

fault.run_rank(lambda: pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                forward_step, argv=flags))
"""


def _start_world(tmp_path: Path, name: str, world: int, fault: str, rank: int,
                 layout: list[str], watchdog: bool) -> list[Job]:
    port = free_port()
    flags = [*FLAGS, *layout, "--global-batch-size", str(2 * world)]
    if watchdog:
        flags += ["--watchdog-timeout-seconds", str(WATCHDOG_S)]
    jobs = []
    for r in range(world):
        env = child_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port))
        log = tmp_path / f"{name}-rank{r}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", _DRIVER, fault, str(rank), "3", "--",
                                     *flags], cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        jobs.append(Job(proc, log, f"{name}/rank{r}"))
    return jobs


def _wait(jobs: list[Job], deadline: float) -> list[int]:
    try:
        return [job.wait(timeout=max(deadline - time.monotonic(), 1.0)) for job in jobs]
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.kill_all()
                job.proc.wait()


def _check_hung(jobs: list[Job], codes: list[int], bad: int) -> None:
    """The hung rank's watchdog names it and the call it is stuck in; every other rank stops
    naming it."""
    hung = rf"rank {bad} failed: hung: no collective for [\d.]+ s " \
           rf"\(--watchdog-timeout-seconds {WATCHDOG_S}\); main thread in .*forward_step"
    for rank, (job, code) in enumerate(zip(jobs, codes)):
        pattern = rf"^\[rank {bad}\] failed: {hung.split(': ', 1)[1]}" if rank == bad else \
            rf"^\[rank {rank}\] stopping: {hung}"
        assert code == 1, f"exit code {code}\n{job.tail()}"
        assert re.search(pattern, job.text(), re.M), f"{pattern!r} missing\n{job.tail()}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_dead_or_hung_rank_ends_every_rank_naming_it(tmp_path):
    worlds = {
        "tp2-raise": (2, "raise", 1, ["--tensor-model-parallel-size", "2"], False),
        "pp2-exit": (2, "exit", 1, ["--pipeline-model-parallel-size", "2"], True),
        "dp2-hang": (2, "hang", 1, [], True),
        # Without the watchdog (its default) a vanished rank 0 was named by no one
        # (rank 1 vanishing: tests/training/test_fail_fast.py).
        "dp2-exit-store-host": (2, "exit", 0, [], False),
    }
    jobs = {name: _start_world(tmp_path, name, *spec) for name, spec in worlds.items()}
    deadline = time.monotonic() + HANG_S
    codes = {name: _wait(ranks, deadline) for name, ranks in jobs.items()}

    def check(name: str, rank: int, code: int, pattern: str) -> None:
        job = jobs[name][rank]
        assert codes[name][rank] == code, f"exit code {codes[name][rank]}\n{job.tail()}"
        assert re.search(pattern, job.text(), re.M), f"{pattern!r} missing\n{job.tail()}"

    for name, (world, fault, bad, _, _) in worlds.items():
        assert f"FAULT {fault} on rank {bad}" in jobs[name][bad].text(), jobs[name][bad].tail()
    # An exception: the failing rank says so, the other names it.
    check("tp2-raise", 1, 1, r"^\[rank 1\] failed: RuntimeError: injected failure at iter")
    check("tp2-raise", 0, 1, r"^\[rank 0\] (stopping: |failed \(.*\) after another rank: )"
                             r"rank 1 failed: RuntimeError: injected failure")
    # A rank that vanishes records nothing: its silent heartbeat names it.
    check("pp2-exit", 1, 3, r"FAULT exit")
    check("pp2-exit", 0, 1, r"^\[rank 0\] .*rank 1 failed: (stopped \(no heartbeat|no heartbeat)")
    # Without the watchdog, rank 0 vanishes: the store it hosted (no torchrun) stops answering.
    check("dp2-exit-store-host", 1, 1, r"^\[rank 1\] failed \(.*\) after another rank: rank 0 "
                                       r"failed: gone \(the rendezvous store it hosts no longer "
                                       r"answers")
    # A rank asleep outside any collective: its watchdog names it and where it is stuck.
    _check_hung(jobs["dp2-hang"], codes["dp2-hang"], 1)


@pytest.mark.skipif(os.environ.get("MEGATRON_FAULTS_LARGE") != "1",
                    reason="eight ranks: over the CI budget; MEGATRON_FAULTS_LARGE=1 runs it")
def test_a_hung_rank_in_a_world_of_eight_tp2_pp2_dp2(tmp_path):
    jobs = _start_world(tmp_path, "tp2pp2dp2-hang", 8, "hang", 5,
                        ["--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2"], True)
    codes = _wait(jobs, time.monotonic() + HANG_S)
    assert "FAULT hang on rank 5" in jobs[5].text(), jobs[5].tail()
    _check_hung(jobs, codes, 5)
