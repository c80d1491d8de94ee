"""Soak test of kill -9: many seeded kills at random moments, then resume; a table.

    .venv/bin/python scripts/soak_faults.py --trials 50 [--seed 0] [--parallel 2] [--keep DIR]

Not run by CI (minutes to hours); ``tests/faults/`` runs a few fixed cases of the same checks.
Each trial starts the fault suite's common job (``tests/faults/harness.pp2_flags``: the tiny
GPT at PP=2 with the distributed optimizer, 40 iterations, a save every 2) with ``--save`` in a
fresh directory, and injects one fault (the kinds in turn; the moment drawn from the trial's seed):

* ``kill-all``: SIGKILL to torchrun and every rank (a node dies) a random delay after a random
  iteration line;
* ``kill-one``: SIGKILL to one random rank alone (torchrun then stops the other);
* ``kill-in-save``: SIGKILL to the whole job while it is paused inside a random save, at a
  random point (``before`` the first byte, mid-``shard``, or with the new ``tracker`` written
  but not yet renamed: the driver hook of ``tests/faults/driver.py``).

Then it checks what a user relies on: the tracker is absent (killed before the first save) or
names a checkpoint at or before the last iteration logged; ``--load`` on the same directory
resumes (exit 0, every shard read and checksum-verified, leftover temporary files removed, none
left after its own saves); and the resumed run's losses equal the uninterrupted run's from the
loaded iteration on. A summary table per fault kind is printed (Markdown), and the exit code is
1 if any trial failed. It imports the test suite's harness: run it from a checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults import harness as h  # noqa: E402

KINDS = ("kill-all", "kill-one", "kill-in-save")


@dataclasses.dataclass
class Trial:
    index: int
    kind: str
    detail: str = ""
    killed_at: int | None = None  # last iteration logged before the kill
    loaded: int | None = None  # the tracker after the kill (None: no checkpoint yet)
    temp_left: int = 0  # temporary files the kill left
    resumed_ok: bool = False
    losses_equal: bool = False
    error: str = ""
    seconds: float = 0.0


def _inject(trial: Trial, rng: random.Random, save: Path, log_dir: Path) -> h.Job:
    if trial.kind == "kill-in-save":
        iteration = rng.randrange(2, 21, 2)
        where = rng.choice(["before", "shard", "tracker"])
        trial.detail = f"save of {iteration}, {where}"
        job = h.launch("pretrain_gpt.py", h.pp2_flags(save), log_dir / "killed.log", nproc=2,
                       hooks={"FAULT_PAUSE_IN_SAVE": f"{iteration}:{where}"})
        job.wait_for("FAULT-HOOK paused in save")
        job.kill_all()
        return job
    job = h.launch("pretrain_gpt.py", h.pp2_flags(save), log_dir / "killed.log", nproc=2)
    after = rng.randint(1, 20)
    delay = rng.uniform(0.0, 0.4)
    job.wait_for(f" iteration {after:8d}/")
    time.sleep(delay)
    if trial.kind == "kill-all":
        trial.detail = f"{delay:.2f} s after iteration {after}"
        job.kill_all()
    else:
        rank = rng.randrange(2)
        trial.detail = f"rank {rank}, {delay:.2f} s after iteration {after}"
        job.kill_rank(rank)
    return job


def run_trial(trial: Trial, seed: int, work: Path, reference: dict[int, float]) -> Trial:
    start = time.monotonic()
    rng = random.Random(seed * 100_003 + trial.index)
    trial_dir = work / f"trial{trial.index:03d}"
    save = trial_dir / "save"
    jobs = []
    try:
        killed = _inject(trial, rng, save, trial_dir)
        jobs.append(killed)
        killed.wait()
        logged = killed.losses()
        trial.killed_at = max(logged) if logged else 0
        trial.loaded = h.tracker(save)
        trial.temp_left = len(h.temp_files(save)) if save.exists() else 0
        if trial.loaded is not None and trial.loaded > trial.killed_at:
            raise AssertionError(f"tracker {trial.loaded} ahead of iteration {trial.killed_at}")
        resumed = h.launch("pretrain_gpt.py", [*h.pp2_flags(save), "--load", save],
                           trial_dir / "resumed.log", nproc=2)
        jobs.append(resumed)
        code = resumed.wait()
        assert code == 0, f"resumed run exited {code}\n{resumed.tail(1500)}"
        assert h.temp_files(save) == [], h.temp_files(save)
        assert h.tracker(save) == h.PP2_ITERS
        trial.resumed_ok = True
        first = (trial.loaded or 0) + 1
        got = resumed.losses()
        assert sorted(got) == list(range(first, h.PP2_ITERS + 1)), sorted(got)
        h.compare_losses(reference, got)
        h.compare_losses(reference, logged) if logged else None
        trial.losses_equal = True
    except AssertionError as err:
        trial.error = str(err).splitlines()[0][:200]
    finally:
        for job in jobs:
            job.reap()
        trial.seconds = time.monotonic() - start
    return trial


def _table(trials: list[Trial]) -> str:
    rows = ["| Fault | Trials | Killed at iteration (min-max) | Tracker absent / at a save | "
            "Temp files left by the kill (trials) | Resumed from the tracker | "
            "Losses equal | Failed |",
            "|---|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        mine = [t for t in trials if t.kind == kind]
        if not mine:
            continue
        at = [t.killed_at for t in mine if t.killed_at is not None]
        rows.append(
            f"| {kind} | {len(mine)} | {min(at, default=0)}-{max(at, default=0)} | "
            f"{sum(t.loaded is None for t in mine)} / {sum(t.loaded is not None for t in mine)} | "
            f"{sum(t.temp_left > 0 for t in mine)} | {sum(t.resumed_ok for t in mine)} | "
            f"{sum(t.losses_equal for t in mine)} | {sum(bool(t.error) for t in mine)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=1,
                        help="trials at once (each is two ranks and a launcher)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the trials' directories and logs here")
    args = parser.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="soak_faults_"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    reference_job = h.launch("pretrain_gpt.py", h.pp2_flags(work / "reference"),
                             work / "reference.log", nproc=2)
    code = reference_job.wait()
    if code != 0:
        print(reference_job.tail(), file=sys.stderr)
        return 1
    reference = reference_job.losses()
    # Every kind in turn (a random draw of 10 can miss one); the moments are random.
    trials = [Trial(i, KINDS[i % len(KINDS)]) for i in range(args.trials)]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        done = list(pool.map(lambda t: run_trial(t, args.seed, work, reference), trials))
    for t in done:
        status = "ok" if t.losses_equal else f"FAILED: {t.error}"
        print(f"trial {t.index:3d} {t.kind:13s} {t.detail:32s} killed at {t.killed_at}, "
              f"loaded {t.loaded}, {t.temp_left} temp file(s) left, {t.seconds:.0f} s: {status}")
    print()
    print(_table(done))
    print(f"\n{len(done)} trials, seed {args.seed}, {time.monotonic() - started:.0f} s")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(t.error for t in done) else 0


if __name__ == "__main__":
    sys.exit(main())
