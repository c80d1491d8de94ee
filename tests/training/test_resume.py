"""Exact resume, and the SIGTERM exit of --exit-signal-handler (issue 5).

Resume: 20 iterations straight vs 10 (``--exit-interval 10`` saves and stops) + ``--load`` + 10,
with dropout 0.1, so the data order, the optimizer state, the LR schedule and every RNG stream
(torch's and the tensor-parallel tracker's) must come back from the checkpoint for the losses to
agree. SIGTERM: ``pretrain_gpt.py`` on two ranks launched as torchrun launches them, the signal
sent to one rank only, must finish the iteration, save, and exit 0 on both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.training.checkpointing import TRACKER_FILENAME
from tests.training import e2e

REPO = Path(__file__).resolve().parents[2]
RESUME_TOL = 1e-6
# Micro-batch 1, global batch 2: with TP=2 two accumulated micro-batches, with DP=2 one each.
SHAPE = {"seq": 32, "mbs": 1, "gbs": 2, "dropout": 0.1, "iters": 20}
LAYOUTS = {"tp2": {"tp": 2}, "dp2_distributed_optimizer":
           {"extra": ["--use-distributed-optimizer"]}}


@pytest.fixture(scope="module")
def resumed(gpt2_corpus, tmp_path_factory):
    """Per layout: (straight run, first half, resumed second half), each a list of ranks."""
    runs = []
    for name, layout in LAYOUTS.items():
        save = tmp_path_factory.mktemp(f"resume_{name}")
        extra = layout.get("extra", [])
        argv = dict(SHAPE, tp=layout.get("tp", 1))
        runs += [{"argv": e2e.gpt_argv(gpt2_corpus, **argv, extra=extra)},
                 {"argv": e2e.gpt_argv(gpt2_corpus, **argv, extra=[
                     *extra, "--save", save, "--save-interval", "1000", "--exit-interval", "10"])},
                 {"argv": e2e.gpt_argv(gpt2_corpus, **argv, extra=[*extra, "--load", save])}]
    results = e2e.pooled(2, runs)
    return {name: results[3 * i: 3 * i + 3] for i, name in enumerate(LAYOUTS)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_exact(resumed, layout):
    straight, first, second = resumed[layout]
    for rank in range(2):
        full = e2e.losses(straight[rank])
        assert len(full) == 20 and first[rank]["iteration"] == 10
        assert second[rank]["iteration"] == 20 and len(second[rank]["history"]) == 10
        halves = e2e.losses(first[rank]) + e2e.losses(second[rank])
        diff = e2e.max_abs_diff(full, halves)
        assert diff <= RESUME_TOL, (f"{layout}, rank {rank}: resumed losses differ by {diff:.3g}"
                                    f"\n  straight {full}\n  10 + 10  {halves}")
        grad_norms = [h["grad norm"] for h in straight[rank]["history"]]
        resumed_norms = [h["grad norm"] for h in first[rank]["history"] + second[rank]["history"]]
        assert max(abs(a - b) for a, b in zip(grad_norms, resumed_norms)) <= 1e-5


def test_resume_needs_the_rng_state(gpt2_corpus, tmp_path, resumed):
    """With --no-load-rng the dropout masks after the resume differ: the exact-resume test above
    really depends on the RNG state in the checkpoint (and dropout is really on)."""
    save = tmp_path / "ckpt"
    argv = dict(SHAPE, tp=2)
    results = e2e.pooled(2, [
        {"argv": e2e.gpt_argv(gpt2_corpus, **argv, extra=[
            "--save", save, "--save-interval", "1000", "--exit-interval", "10"])},
        {"argv": e2e.gpt_argv(gpt2_corpus, **argv, extra=["--load", save, "--no-load-rng",
                                                          "--exit-interval", "12"])}])
    straight = e2e.losses(resumed["tp2"][0][0])
    without_rng = e2e.losses(results[1][0])
    assert len(without_rng) == 2
    assert e2e.max_abs_diff(straight[10:12], without_rng) > 1e-4


# --------------------------------------------------------------------------------------------
# SIGTERM
# --------------------------------------------------------------------------------------------

def _launch_rank(rank: int, port: int, argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        # A session of its own, as torchrun gives each rank: signals can target its group.
        return subprocess.Popen([sys.executable, str(REPO / "pretrain_gpt.py"), *argv], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_for(log: Path, text: str, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    raise AssertionError(f"{text!r} did not appear in {log} within {timeout} s:\n"
                         + log.read_text(errors="replace")[-3000:])


SIGTERM_SHAPE = {"tp": 2, "iters": 1000, "seq": 32, "mbs": 1, "gbs": 2}


def test_sigterm_saves_a_loadable_checkpoint_and_exits_0(gpt2_corpus, tmp_path):
    from bench.launch import free_port

    save = tmp_path / "ckpt"
    # Loader workers on: torchrun and SLURM signal the rank's whole process group, workers
    # included, and a killed worker must not take the rank down before it saves.
    argv = e2e.gpt_argv(gpt2_corpus, **SIGTERM_SHAPE, extra=[
        "--exit-signal-handler", "--save", save, "--save-interval", "1000",
        "--log-interval", "1", "--num-workers", "2"])
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    port = free_port()
    procs = [_launch_rank(r, port, argv, logs[r]) for r in range(2)]
    try:
        # The last rank prints the iteration lines.
        _wait_for(logs[1], " iteration        3/", procs, timeout=120)
        # One rank's process group only: the other rank learns it collectively.
        os.killpg(procs[1].pid, signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = logs[1].read_text(errors="replace")
    assert codes == [0, 0], f"exit codes {codes}\n{text[-3000:]}"
    assert "exiting program after receiving SIGTERM" in logs[0].read_text(errors="replace")
    logged = [int(line.split("/")[0].split()[-1]) for line in text.splitlines()
              if line.startswith(" iteration ")]
    reached = logged[-1]
    assert 3 <= reached < 1000
    assert (save / TRACKER_FILENAME).read_text().strip() == str(reached)
    for tp_rank in range(2):
        assert (save / f"iter_{reached:07d}" / f"mp_rank_{tp_rank:02d}" /
                "model_optim_rng.pt").is_file()
    # The checkpoint loads and training goes on from the iteration reached (same schedule
    # length, so the saved LR schedule matches; stop two iterations later).
    resumed = e2e.pooled(2, [{"argv": e2e.gpt_argv(gpt2_corpus, **SIGTERM_SHAPE, extra=[
        "--load", save, "--exit-interval", reached + 2])}])[0]
    for rank_result in resumed:
        assert rank_result["iteration"] == reached + 2
        assert len(rank_result["history"]) == 2
