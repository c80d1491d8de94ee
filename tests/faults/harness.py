"""Launching real training jobs and injecting faults into them (the fault suite's harness).

A :class:`Job` is ``torchrun ... <script> <flags>`` (or the same script run through
``tests/faults/driver.py``, which adds test hooks: a pause inside a checkpoint save), started in
a session of its own with every line of every rank in one log file. The tests wait for a line
(:meth:`Job.wait_for`), inject a fault (``kill -9`` of one rank or of the whole job, a signal
to torchrun or to a rank's process group) and collect the exit code with a hang bound
(:meth:`Job.wait`): a job still running then is SIGKILLed with its whole process tree and the
test fails naming the hang.

Shared by both halves of the fault suite (part B imports :func:`launch`, :func:`tiny_gpt_flags`
and :class:`Job`). Nothing here sleeps a fixed time to let something happen: every wait polls
for the event it needs, and every bound is a hang bound (generous: the CI machine is busy).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.launch import free_port
from tasks import finetune_sample_data as synthetic

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
HANG_S = 240.0
"""Hang bound of one job: a healthy tiny run takes seconds plus start-up on a loaded machine."""

# 2 layers x hidden 32 on --mock-data: no tokenizer or corpus to load, start-up is the cost.
# 64 positions, not fewer: the mock dataset (Megatron-Core's 100000 documents of up to 4096
# tokens) is cut into a shuffled index of ~200M / seq-length samples at every start.
TINY_GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "2", "--clip-grad", "1.0", "--seed", "1234",
            "--mock-data", "--vocab-size", "512", "--use-cpu-initialization",
            "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
            "--distributed-backend", "gloo", "--hidden-dropout", "0.1",
            "--attention-dropout", "0.1"]

_ITERATION_LINE = re.compile(r"^ iteration +(\d+)/ *(\d+) \|(.*)$", re.M)
_LM_LOSS = re.compile(r"\| lm loss: ([-+.\dEe]+|nan|inf) \|")


def tiny_gpt_flags(*, train_iters: int, global_batch_size: int = 4,
                   extra: Sequence[object] = ()) -> list[str]:
    """pretrain_gpt.py flags of a 2-layer, hidden-32 GPT on ``--mock-data``, logging every
    iteration (with dropout: an exact resume needs the RNG state back)."""
    return [*TINY_GPT, "--train-iters", str(train_iters),
            "--global-batch-size", str(global_batch_size), *map(str, extra)]


PP2_ITERS = 40
"""Long enough that a fault after iteration 3 always lands before the end."""


def pp2_flags(save: Path, *extra: object) -> list[str]:
    """The suite's common job: the tiny GPT at PP=2 (two ranks) with the distributed optimizer
    and --exit-signal-handler, saving every 2 iterations (``conftest.pp2_reference`` is its
    uninterrupted run)."""
    return tiny_gpt_flags(train_iters=PP2_ITERS, extra=[
        "--pipeline-model-parallel-size", 2, "--use-distributed-optimizer",
        "--exit-signal-handler", "--save", save, "--save-interval", 2, *extra])


def tiny_bert_flags(vocab_file: Path, *, train_iters: int, global_batch_size: int = 4,
                    extra: Sequence[object] = ()) -> list[str]:
    """pretrain_bert.py flags of the same tiny shape on ``--mock-data`` with a real WordPiece
    vocabulary (masking needs one; BERT's default binary head on)."""
    # TINY_GPT's 64 positions: at 16 a micro-batch can hold no masked token, and its loss is
    # 0/0 = NaN (as in Megatron-LM, whose loss_func divides by the mask's sum the same way).
    flags = [f for f in TINY_GPT if f not in ("--vocab-size", "512")]
    return [*flags, "--vocab-file", str(vocab_file), "--train-iters", str(train_iters),
            "--global-batch-size", str(global_batch_size), *map(str, extra)]


def finetune_flags(data: Path, save: Path, *extra: object) -> list[str]:
    """tasks/main.py flags: MNLI on synthetic files written under ``data``, a 2-layer hidden-32
    BERT, one rank, 2 micro-batches a step, dropout on, 2 epochs of 8 iterations, a save every
    4 iterations (and at each epoch's end)."""
    (data / "MNLI").mkdir(parents=True, exist_ok=True)
    synthetic.write_vocab(data / "vocab.txt")
    train = synthetic.write_mnli(data / "MNLI" / "train.tsv", 64, seed=1)
    dev = synthetic.write_mnli(data / "MNLI" / "dev_matched.tsv", 16, seed=2)
    return ["--task", "MNLI", "--train-data", train, "--valid-data", dev, "--epochs", 2,
            "--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4,
            "--seq-length", 32, "--max-position-embeddings", 32,
            "--make-vocab-size-divisible-by", 128, "--micro-batch-size", 4,
            "--global-batch-size", 8, "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "linear", "--lr-warmup-fraction", 0.1, "--weight-decay", 0.01,
            "--clip-grad", 1.0, "--seed", 1234, "--hidden-dropout", 0.1,
            "--attention-dropout", 0.1, "--tokenizer-type", "BertWordPieceLowerCase",
            "--vocab-file", data / "vocab.txt", "--num-workers", 0, "--log-interval", 1,
            "--eval-iters", 1, "--distributed-backend", "gloo", "--save", save,
            "--save-interval", 4, *extra]


def child_env(**extra: str) -> dict[str, str]:
    """This environment less any rendezvous variables, one compute thread, the repo on the
    path, unbuffered output."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


class Job:
    """One launched job (torchrun and its ranks), its log, and the means to hurt it."""

    def __init__(self, proc: subprocess.Popen, log: Path, name: str) -> None:
        self.proc, self.log, self.name = proc, log, name

    # Reading -----------------------------------------------------------------------------
    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} ({self.log}):\n{self.text()[-chars:]}"

    def wait_for(self, pattern: str, timeout: float = HANG_S, regex: bool = False) -> str:
        """Poll the log until ``pattern`` (text, or a regex) appears; returns the match. Fails
        if the job exits first or nothing comes within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            found = re.search(pattern, text, re.M) if regex else (pattern in text)
            if found:
                return found.group(0) if regex else pattern
            assert self.proc.poll() is None, \
                f"{self.name} exited ({self.proc.returncode}) before {pattern!r}\n{self.tail()}"
            assert time.monotonic() < deadline, \
                f"{pattern!r} did not come within {timeout} s\n{self.tail()}"
            time.sleep(0.05)

    def losses(self) -> dict[int, float]:
        """{iteration: lm loss} of the iteration lines logged (the last logging of each)."""
        return iteration_losses(self.text())

    # Hurting -----------------------------------------------------------------------------
    def rank_pids(self) -> list[int]:
        """Pids of the ranks (torchrun's children running Python), in start order."""
        return sorted(_children(self.proc.pid))

    def kill_rank(self, index: int = 0, sig: int = signal.SIGKILL) -> int:
        """``sig`` to one rank's process alone; returns its pid."""
        pids = self.rank_pids()
        assert pids, f"{self.name}: no rank processes\n{self.tail()}"
        pid = pids[index]
        os.kill(pid, sig)
        return pid

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """``sig`` to torchrun and every process under it at once (a node that dies)."""
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def signal_launcher(self, sig: int) -> None:
        """``sig`` to torchrun alone (it forwards it to the ranks)."""
        self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        """``sig`` to every rank's process group (as a scheduler signals a job's processes)."""
        for pid in self.rank_pids():
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass

    def signal_rank_group(self, index: int, sig: int) -> None:
        """``sig`` to one rank's process group (the rank and its loader workers) alone."""
        pids = self.rank_pids()
        assert pids, f"{self.name}: no rank processes\n{self.tail()}"
        os.killpg(pids[index], sig)

    # Ending ------------------------------------------------------------------------------
    def wait(self, timeout: float = HANG_S) -> int:
        """The exit code; a job still running after ``timeout`` is killed (tree and all) and
        the test fails naming the hang."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            self.proc.wait()
            raise AssertionError(f"{self.name} still running after {timeout} s (hung)\n"
                                 f"{self.tail()}") from None
        finally:
            self.reap()

    def reap(self) -> None:
        """Kill whatever of the job is left (ranks orphaned by a killed torchrun included)."""
        for pid in _descendants_by_env(self.name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.kill_all()
            self.proc.wait()


def act_when_logged(actions: Sequence[tuple[Job, str, Callable[[Job], object]]],
                    timeout: float = HANG_S) -> None:
    """For each ``(job, text, act)``: ``act(job)`` as soon as ``text`` is in the job's log,
    watching every job at once (waiting for them one by one would let the later ones run on
    past the moment meant for them)."""
    pending = list(actions)
    deadline = time.monotonic() + timeout
    while pending:
        for item in list(pending):
            job, text, act = item
            if text in job.text():
                act(job)
                pending.remove(item)
            else:
                assert job.proc.poll() is None, \
                    f"{job.name} exited ({job.proc.returncode}) before {text!r}\n{job.tail()}"
        assert time.monotonic() < deadline, \
            f"not logged within {timeout} s: {[(j.name, t) for j, t, _ in pending]}"
        time.sleep(0.05)


def launch(script: str, flags: Sequence[object], log: Path, *, nproc: int = 1,
           name: str | None = None, hooks: dict[str, str] | None = None,
           torchrun_args: Sequence[str] = (), env: dict[str, str] | None = None,
           prefix: Sequence[str] = ()) -> Job:
    """Start ``torchrun --nproc-per-node nproc <script> <flags>`` on 127.0.0.1.

    Args:
        script: a path relative to the repo (``pretrain_gpt.py``, ``pretrain_bert.py``).
        flags: the script's flags.
        log: where every line of the launcher and the ranks goes.
        hooks: test hooks (``tests/faults/driver.py``'s variables, e.g.
            ``{"FAULT_PAUSE_IN_SAVE": "6"}``): the script then runs through the driver.
        torchrun_args: replace the single-node rendezvous (``--standalone``-like) with these
            (``--nnodes 2 --node-rank 0 --rdzv-endpoint ...``).
        env: extra environment variables.
        prefix: a command torchrun runs under (``ip netns exec NODE``: it execs, so the job's
            pid is torchrun's).
    """
    name = name or f"{log.stem}-{os.getpid()}-{random.randrange(1 << 30)}"
    target = [str(DRIVER), str(REPO / script)] if hooks else [str(REPO / script)]
    rendezvous = list(torchrun_args) or [
        "--nnodes", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", *rendezvous,
           "--nproc-per-node", str(nproc), "--max-restarts", "0", "--monitor-interval", "0.1",
           *target, *map(str, flags)]
    environment = child_env(**(hooks or {}), **(env or {}))
    environment[_MARK] = name  # finds the ranks a SIGKILLed torchrun leaves behind
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=environment, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Job(proc, log, name)


def iteration_losses(text: str) -> dict[int, float]:
    """{iteration: lm loss} of the training log lines in ``text``."""
    out = {}
    for match in _ITERATION_LINE.finditer(text):
        loss = _LM_LOSS.search(match.group(0))
        if loss:
            out[int(match.group(1))] = float(loss.group(1))
    return out


def compare_losses(reference: dict[int, float], resumed: dict[int, float],
                   tol: float = 1e-5) -> None:
    """Every iteration ``resumed`` logged equals the reference run's (relative ``tol``)."""
    assert resumed, "the resumed run logged no iteration"
    missing = sorted(set(resumed) - set(reference))
    assert not missing, f"iterations {missing} not in the reference run"
    bad = {i: (reference[i], resumed[i]) for i in resumed
           if abs(reference[i] - resumed[i]) > tol * max(1.0, abs(reference[i]))}
    assert not bad, f"resumed losses differ from the uninterrupted run's: {bad}"


# Processes -------------------------------------------------------------------------------------
_MARK = "MEGATRON_FAULT_JOB"


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _descendants(pid: int) -> list[int]:
    out, stack = [], _children(pid)
    while stack:
        child = stack.pop()
        out.append(child)
        stack += _children(child)
    return out


def _descendants_by_env(name: str) -> list[int]:
    """Pids still alive whose environment carries this job's mark (orphans included)."""
    found = []
    needle = f"{_MARK}={name}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def temp_files(root: Path) -> list[Path]:
    """Temporary files of a save (``.<name>.tmp-<pid>``) under ``root``."""
    return sorted(p for p in root.rglob("*") if ".tmp-" in p.name)


def tracker(root: Path) -> int | None:
    path = root / "latest_checkpointed_iteration.txt"
    return int(path.read_text().strip()) if path.exists() else None


def seeded_delay(seed: int, low: float, high: float) -> float:
    """A reproducible 'random moment': the same seed gives the same delay."""
    return random.Random(seed).uniform(low, high)
