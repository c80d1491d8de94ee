"""SIGTERM and SIGINT to a running job, at PP=2 with the distributed optimizer.

Real ``torchrun`` jobs with ``--exit-signal-handler``; the signal arrives once iteration 3 is
logged:

* SIGTERM to torchrun (it forwards the signal to every rank's process group, as it does when a
  scheduler stops it), and SIGTERM to one rank's process group directly, with 2 loader workers
  (what a preemption of one node does: the workers get the signal too and must not take the
  rank down before it saves; the other rank learns of it collectively): the ranks finish the
  iteration, save a checkpoint at the iteration they reached, log ``exiting program after
  receiving SIGTERM`` and exit 0; the tracker names that checkpoint, and a run resumed from it
  logs the same losses as the run that never stopped.
* SIGINT (Ctrl-C) to torchrun: as Megatron-LM, ``--exit-signal-handler`` acts on SIGTERM only;
  SIGINT interrupts at once (exit code 130, named in the log, no hang), and the last periodic
  checkpoint is intact, complete and still the tracker's target.

* SIGTERM during the final save (the end of training): the save finishes, exit 0 (regression).

* SIGTERM to a finetuning rank's process group (``tasks/main.py --task MNLI``, 2 loader
  workers), while it is paused before a periodic save: the workers ignore it (every loader is
  built by ``megatron.data.loader``), the save finishes and the rank saves again and exits 0
  at the next iteration (regression: the workers died of it and the rank failed unsaved).

* ``pretrain_gpt.py`` under torchrun at PP=2 (the uninterrupted reference run): the iteration
  lines (with the loss) come from the last stage only, once per iteration, and the run exits 0.

``tests/training/test_fail_fast.py`` covers SIGINT to a rank blocked in a collective.
"""

from __future__ import annotations

import signal
import time

import pytest

from megatron.checkpointing.files import verify_checksum
from tests.faults import harness as h

ITERS = h.PP2_ITERS
SAVE_INTERVAL = 2
RESUMED = ("sigterm_torchrun",)  # the group case saves the same way: its checkpoint is checked
FINAL = 5
FINETUNE_PAUSE = 4  # a periodic save in the middle of the first epoch: its workers are alive
# Loader workers on: torchrun and SLURM signal a rank's whole process group, workers included,
# and a killed worker must not take the rank down before it saves (a blocker once).
LOADER_WORKERS = ("--num-workers", 2)


def _final_save_flags(save):
    """One rank, saves at 2 and 4 in the loop; the final save (iteration 5) is pretrain's own."""
    return h.tiny_gpt_flags(train_iters=FINAL, extra=[
        "--exit-signal-handler", "--save", save, "--save-interval", 2])


@pytest.fixture(scope="module")
def signalled(tmp_path_factory, pp2_reference):
    root = tmp_path_factory.mktemp("signals")
    cases = {"sigterm_torchrun": lambda job: job.signal_launcher(signal.SIGTERM),
             # The last rank's group only (it logs the iteration lines): rank 0 learns it from
             # the collective check of the signal.
             "sigterm_group": lambda job: job.signal_rank_group(-1, signal.SIGTERM),
             "sigint_torchrun": lambda job: job.signal_launcher(signal.SIGINT)}
    extra = {"sigterm_group": LOADER_WORKERS}
    jobs = {name: h.launch("pretrain_gpt.py", h.pp2_flags(root / name, *extra.get(name, ())),
                           root / f"{name}.log", nproc=2) for name in cases}
    # The final-save case starts with the others (its start-up overlaps theirs).
    final_save, go = root / "final_save", root / "go"
    jobs["final_save"] = h.launch(
        "pretrain_gpt.py", _final_save_flags(final_save), root / "final_save.log", nproc=1,
        hooks={"FAULT_PAUSE_IN_SAVE": f"{FINAL}:before", "FAULT_PAUSE_UNTIL": str(go)})
    jobs["finetune"] = h.launch(
        "tasks/main.py", h.finetune_flags(root / "mnli", root / "finetune", "--exit-signal-handler",
                                          *LOADER_WORKERS),
        root / "finetune.log", nproc=1,
        hooks={"FAULT_PAUSE_IN_SAVE": f"{FINETUNE_PAUSE}:before", "FAULT_PAUSE_UNTIL": str(go)})
    resumed = {}
    try:
        h.act_when_logged([(jobs[name], " iteration        3/", send)
                           for name, send in cases.items()] +
                          [(jobs[name], "FAULT-HOOK paused in save",
                            lambda job: job.signal_group(signal.SIGTERM))
                           for name in ("final_save", "finetune")])
        # A killed rank dies at once; give a handled signal time to land before the save
        # goes on.
        time.sleep(1.0)
        go.touch()
        codes = {name: job.wait() for name, job in jobs.items()}
        trackers = {name: h.tracker(root / name) for name in jobs}
        resumed = {name: h.launch("pretrain_gpt.py", [*h.pp2_flags(root / name), "--load",
                                                      root / name],
                                  root / f"{name}_resumed.log", nproc=2) for name in RESUMED}
        resumed_codes = {name: job.wait() for name, job in resumed.items()}
    finally:
        for job in [*jobs.values(), *resumed.values()]:
            job.reap()
    return {"jobs": jobs, "codes": codes, "trackers": trackers, "resumed": resumed,
            "resumed_codes": resumed_codes, "reference": pp2_reference, "root": root}


@pytest.mark.parametrize("case", ["sigterm_torchrun", "sigterm_group"])
def test_sigterm_saves_exits_cleanly_and_resumes_exactly(signalled, case):
    job: h.Job = signalled["jobs"][case]
    text = job.text()
    assert "exiting program after receiving SIGTERM" in text, job.tail()
    # Every rank ended cleanly; torchrun itself reports the signal it got, only then.
    assert "failed" not in text.replace("failed (exitcode", ""), job.tail()
    if case == "sigterm_group":
        assert signalled["codes"][case] == 0, job.tail()
    reached = max(job.losses())
    assert 3 <= reached < ITERS
    assert signalled["trackers"][case] == reached
    assert f"successfully saved checkpoint at iteration {reached:7d}" in text
    root = signalled["root"] / case
    shards = sorted((root / f"iter_{reached:07d}").rglob("*.pt"))
    assert [p.name for p in shards] == ["distrib_optim.pt", "model_optim_rng.pt"] * 2, shards
    assert all(verify_checksum(p) for p in shards)
    reference = signalled["reference"].losses()
    h.compare_losses(reference, job.losses())
    if case not in RESUMED:
        return
    resumed: h.Job = signalled["resumed"][case]
    assert signalled["resumed_codes"][case] == 0, resumed.tail()
    assert sorted(resumed.losses()) == list(range(reached + 1, ITERS + 1)), resumed.tail()
    h.compare_losses(reference, resumed.losses())


def test_sigint_interrupts_at_once_and_keeps_the_last_checkpoint(signalled):
    job: h.Job = signalled["jobs"]["sigint_torchrun"]
    text = job.text()
    assert signalled["codes"]["sigint_torchrun"] != 0, job.tail()
    assert "failed: interrupted (SIGINT)" in text, job.tail()
    assert "exiting program after receiving" not in text
    saved = signalled["trackers"]["sigint_torchrun"]
    assert saved is not None and saved % SAVE_INTERVAL == 0 and saved <= max(job.losses())
    root = signalled["root"] / "sigint_torchrun"
    shards = sorted((root / f"iter_{saved:07d}").rglob("*.pt"))
    # Two pipeline stages, each with its model and its distributed-optimizer shard.
    assert [p.name for p in shards] == ["distrib_optim.pt", "model_optim_rng.pt"] * 2, shards
    assert all(verify_checksum(p) for p in shards)
    assert h.temp_files(root) == []


def test_sigterm_during_the_final_save_lets_it_finish(signalled):
    """Regression: the handler was removed when the training loop returned, so a SIGTERM during
    the final save (a preemption at the very end) killed the rank half-way through it and the
    last iterations were lost. Megatron-LM's handler stays for the whole run; so does ours now.
    """
    job: h.Job = signalled["jobs"]["final_save"]
    assert f"successfully saved checkpoint at iteration {FINAL:7d}" in job.text(), job.tail()
    assert signalled["trackers"]["final_save"] == FINAL
    assert signalled["codes"]["final_save"] == 0, job.tail()
    assert h.temp_files(signalled["root"] / "final_save") == []


def test_sigterm_to_a_finetuning_process_group_saves_with_loader_workers(signalled):
    """Regression: the finetuning loaders were plain DataLoaders whose workers died
    of the scheduler's SIGTERM, and torch failed the rank at once ("DataLoader worker ... is
    killed by signal: Terminated"): no checkpoint, exit 1."""
    job: h.Job = signalled["jobs"]["finetune"]
    text = job.text()
    assert "killed by signal" not in text, job.tail()
    assert signalled["codes"]["finetune"] == 0, job.tail()
    assert "exiting program after receiving SIGTERM" in text, job.tail()
    # The paused save completes; the signal is acted on after the next iteration.
    assert f"successfully saved checkpoint at iteration {FINETUNE_PAUSE:7d}" in text, job.tail()
    assert signalled["trackers"]["finetune"] == FINETUNE_PAUSE + 1, job.tail()
    assert h.temp_files(signalled["root"] / "finetune") == []


def test_pretrain_gpt_under_torchrun_at_pp2_logs_from_the_last_stage(pp2_reference):
    """``torchrun --nproc-per-node 2 pretrain_gpt.py ... --pipeline-model-parallel-size 2``
    (the suite's uninterrupted reference job): exits 0, says its pipeline size, and logs each
    iteration's line with the loss once, from the last stage."""
    losses = pp2_reference.losses()  # asserts exit 0 and iterations 1..PP2_ITERS
    text = pp2_reference.job.text()
    assert "pipeline model parallel with size 2" in text, pp2_reference.job.tail()
    assert text.count("lm loss:") == ITERS == len(losses), pp2_reference.job.tail()
