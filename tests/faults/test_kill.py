"""kill -9 during training and inside checkpoint saves: nothing saved is lost.

Real jobs (``torchrun`` + ``pretrain_gpt.py`` / ``pretrain_bert.py``, tiny models on
``--mock-data``), killed with SIGKILL -- no handler runs, nothing is flushed -- then started
again with ``--load`` on the same ``--save``. After every kill:

* the tracker names a complete checkpoint (the resumed run loads it: every shard, checksums
  verified) and never the save the kill interrupted;
* the temporary files the killed save left are removed by the next start, and its own saves
  (over the interrupted iteration's directory too) finish with none left;
* the resumed run's losses equal the uninterrupted run's from the loaded iteration on (same
  flags, CPU, fp32, dropout on: the RNG state must come back too), compared on the log lines.

Three cases, started together so their start-ups overlap:

* GPT, DP=2 with the distributed optimizer: one rank killed inside the save of iteration 6,
  after every shard is in and the new tracker is written under its temporary name (the last
  moment before the save counts);
* GPT, PP=2 with the distributed optimizer: the whole job (torchrun and both ranks, as a node
  dying) killed at a seeded random moment during training (``FAULT_SEED``), compared with an
  uninterrupted run;
* BERT, one rank: killed in the middle of writing its shard (temporary file half-done);
* finetuning (``tasks/main.py --task MNLI`` on the synthetic MNLI files of
  ``tasks/finetune_sample_data.py``), one rank: killed inside the save of iteration 8 (the end
  of its first epoch); the resumed run restarts mid-epoch from iteration 4.

``scripts/soak_faults.py`` repeats the random-moment kill many times (not run by CI).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.faults import harness as h

SEED = int(os.environ.get("FAULT_SEED", "0"))
GPT_DP2 = {"save_interval": 3, "iters": 8, "extra": ["--use-distributed-optimizer"]}
BERT = {"save_interval": 2, "iters": 6}
FINETUNE_ITERS = 16  # 2 epochs of 64 samples, global batch 8


def _gpt(save: Path, case: dict) -> list[str]:
    return h.tiny_gpt_flags(train_iters=case["iters"], extra=[
        *case["extra"], "--save", save, "--save-interval", case["save_interval"]])


def _bert(vocab: Path, save: Path) -> list[str]:
    return h.tiny_bert_flags(vocab, train_iters=BERT["iters"], extra=[
        "--save", save, "--save-interval", BERT["save_interval"]])


def _hook_pid(job: h.Job) -> int:
    line = job.wait_for(r"^FAULT-HOOK paused in save: .*$", regex=True)
    return int(re.search(r"pid (\d+)\)", line).group(1))


@pytest.fixture(scope="module")
def killed_and_resumed(shared_data, tmp_path_factory, pp2_reference):
    """Each case: the killed job, what its kill left, and the resumed job (all finished)."""
    root = tmp_path_factory.mktemp("kill")
    vocab = shared_data / "tokenizers" / "bert-base-uncased-vocab.txt"
    flags = {"gpt_dp2": _gpt(root / "gpt_dp2", GPT_DP2),
             "gpt_pp2": h.pp2_flags(root / "gpt_pp2"),
             "bert": _bert(vocab, root / "bert"),
             "finetune": h.finetune_flags(root / "mnli", root / "finetune")}
    scripts = {"gpt_pp2": "pretrain_gpt.py", "gpt_dp2": "pretrain_gpt.py",
               "bert": "pretrain_bert.py", "finetune": "tasks/main.py"}
    nproc = {"gpt_pp2": 2, "gpt_dp2": 2, "bert": 1, "finetune": 1}
    jobs = {
        "gpt_dp2": h.launch("pretrain_gpt.py", flags["gpt_dp2"], root / "gpt_dp2.log", nproc=2,
                            hooks={"FAULT_PAUSE_IN_SAVE": "6:tracker"}),
        "gpt_pp2": h.launch("pretrain_gpt.py", flags["gpt_pp2"], root / "gpt_pp2.log", nproc=2),
        "bert": h.launch("pretrain_bert.py", flags["bert"], root / "bert.log", nproc=1,
                         hooks={"FAULT_PAUSE_IN_SAVE": "4:shard"}),
        "finetune": h.launch("tasks/main.py", flags["finetune"], root / "finetune.log", nproc=1,
                             hooks={"FAULT_PAUSE_IN_SAVE": "8:shard"}),
    }
    resumed = {}
    try:
        # The timed kill first: the paused jobs wait for theirs as long as it takes.
        jobs["gpt_pp2"].wait_for(" iteration        3/")
        time.sleep(h.seeded_delay(SEED, 0.0, 0.5))
        jobs["gpt_pp2"].kill_all()
        # One rank, paused before the tracker's rename.
        os.kill(_hook_pid(jobs["gpt_dp2"]), signal.SIGKILL)
        _hook_pid(jobs["bert"])
        jobs["bert"].kill_all()  # mid-shard
        _hook_pid(jobs["finetune"])
        jobs["finetune"].kill_all()
        codes = {name: job.wait() for name, job in jobs.items()}
        left = {name: {"tracker": h.tracker(root / name), "temp": h.temp_files(root / name)}
                for name in jobs}
        resumed = {name: h.launch(scripts[name], [*flags[name], "--load", root / name],
                                  root / f"{name}_resumed.log", nproc=nproc[name])
                   for name in jobs}
        resumed_codes = {name: job.wait() for name, job in resumed.items()}
    finally:
        for job in [*jobs.values(), *resumed.values()]:
            job.reap()
    return {name: {"killed": jobs[name], "code": codes[name], "left": left[name],
                   "resumed": resumed[name], "resumed_code": resumed_codes[name],
                   "root": root / name} for name in jobs} | {"reference": pp2_reference}


def _check_resumed(case: dict, loaded: int, final: int) -> None:
    resumed: h.Job = case["resumed"]
    assert case["resumed_code"] == 0, resumed.tail()
    text = resumed.text()
    assert f"successfully loaded checkpoint from {case['root']} at iteration {loaded}" in text, \
        resumed.tail()
    assert min(resumed.losses()) == loaded + 1, resumed.tail()
    assert h.tracker(case["root"]) == final
    assert h.temp_files(case["root"]) == []
    if case["left"]["temp"]:
        assert f"removed {len(case['left']['temp'])} temporary file(s) of an interrupted " \
               f"save under {case['root']}" in text, resumed.tail()


def test_rank_killed_before_the_tracker_moves_keeps_the_previous_checkpoint(killed_and_resumed):
    case = killed_and_resumed["gpt_dp2"]
    assert case["code"] != 0, case["killed"].tail()
    # Both shards of iteration 6 were in place, but the kill came before the tracker's rename.
    assert case["left"]["tracker"] == 3
    assert [p.name for p in case["left"]["temp"]] == \
        [p.name for p in case["left"]["temp"] if p.name.startswith(".latest_checkpointed")]
    assert len(case["left"]["temp"]) == 1
    _check_resumed(case, loaded=3, final=8)
    # The killed run was uninterrupted up to iteration 6: the resumed one repeats 4..6 exactly.
    killed = case["killed"].losses()
    assert max(killed) == 6
    h.compare_losses(killed, {i: v for i, v in case["resumed"].losses().items() if i <= 6})


def test_whole_job_killed_at_a_random_moment_resumes_exactly(killed_and_resumed):
    case = killed_and_resumed["gpt_pp2"]
    assert case["code"] != 0, case["killed"].tail()
    loaded = case["left"]["tracker"]
    assert loaded is not None and loaded % 2 == 0, case["killed"].tail()
    killed_at = max(case["killed"].losses())
    assert 3 <= killed_at < h.PP2_ITERS, "the kill did not land during training"
    assert loaded <= killed_at, "the tracker is ahead of the training"
    _check_resumed(case, loaded=loaded, final=h.PP2_ITERS)
    reference = killed_and_resumed["reference"].losses()
    assert sorted(case["resumed"].losses()) == list(range(loaded + 1, h.PP2_ITERS + 1))
    h.compare_losses(reference, case["resumed"].losses())
    h.compare_losses(reference, case["killed"].losses())


def test_bert_killed_mid_shard_leaves_the_previous_checkpoint(killed_and_resumed):
    case = killed_and_resumed["bert"]
    assert case["code"] != 0, case["killed"].tail()
    assert case["left"]["tracker"] == 2
    assert [p.name.split(".tmp-")[0] for p in case["left"]["temp"]] == [".model_optim_rng.pt"]
    _check_resumed(case, loaded=2, final=BERT["iters"])
    killed = case["killed"].losses()
    assert max(killed) == 4
    h.compare_losses(killed, {i: v for i, v in case["resumed"].losses().items() if i <= 4})


def test_finetuning_killed_in_a_save_resumes_mid_epoch_exactly(killed_and_resumed):
    case = killed_and_resumed["finetune"]
    assert case["code"] != 0, case["killed"].tail()
    assert case["left"]["tracker"] == 4
    assert len(case["left"]["temp"]) == 1, case["left"]["temp"]
    _check_resumed(case, loaded=4, final=FINETUNE_ITERS)
    killed = case["killed"].losses()
    assert max(killed) == 8
    resumed = case["resumed"].losses()
    assert sorted(resumed) == list(range(5, FINETUNE_ITERS + 1))
    h.compare_losses(killed, {i: v for i, v in resumed.items() if i <= 8})
