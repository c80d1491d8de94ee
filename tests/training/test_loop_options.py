"""Loop options through pretrain(): length in samples, batch-size ramp-up, exits,
--skip-train, evaluation lines, timers in TensorBoard, and the log lines a user's parser reads.

Every run is the tiny GPT of ``e2e.gpt_argv`` on a 2-rank world (DP=2), all in one pooled call;
each rank also returns the lines it logged, so the tests parse the real output of pretrain().
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import time
from types import SimpleNamespace

import pytest

from tests.multiprocess import run_distributed
from tests.training import e2e

# A user's log parser: Megatron's cells, in Megatron's order, matched from the line's start.
TRAIN_LINE = re.compile(
    r" iteration\s+(?P<iteration>\d+)/\s*(?P<train_iters>\d+) \|"
    r" consumed samples:\s+(?P<consumed>\d+) \|"
    r" elapsed time per iteration \(ms\): (?P<elapsed>[\d.]+) \|"
    r" learning rate: (?P<lr>[-+.\dE]+) \|"
    r" global batch size:\s+(?P<gbs>\d+) \|"
    r" lm loss: (?P<loss>[-+.\dE]+) \|"
    r" loss scale: (?P<scale>[\d.]+) \|"
    r" grad norm: (?P<grad_norm>[\d.]+) \|"
    r" number of skipped iterations:\s+(?P<skipped>\d+) \|"
    r" number of nan iterations:\s+(?P<nan>\d+) \|"
    r"(?P<extra>.*)$")
VALID_LINE = re.compile(r" validation loss at (?P<prefix>.+?) \|"
                        r" lm loss value: (?P<loss>[-+.\dE]+) \|"
                        r" lm loss PPL: (?P<ppl>[-+.\dE]+) \| $")

MAX_LR, MIN_LR = 1e-3, 1e-4  # e2e.gpt_argv's --lr and --min-lr


def parse(lines: list[str], pattern: re.Pattern) -> list[dict[str, str]]:
    return [m.groupdict() for m in map(pattern.match, lines) if m is not None]


# ---------------------------------------------------------------------------------------------
# Inside the ranks
# ---------------------------------------------------------------------------------------------

class _ListHandler(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(record.getMessage().split("\n"))


class _ShiftedClock:
    """Stands for the ``time`` module of loop.py and pretrain.py: ``time()`` is the real clock
    plus ``shift`` seconds, which the model provider sets to simulate a long set-up."""

    def __init__(self) -> None:
        self.shift = 0.0

    def time(self) -> float:
        return time.time() + self.shift


def run_capturing(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """``e2e.run_pretrains`` run by run, adding each run's logged lines as ``"log"``.

    A run's ``"setup_seconds"`` makes pretrain()'s model building look that long to the
    --exit-duration-in-mins clock.
    """
    import pretrain_gpt
    from megatron.core.log import get_logger

    loop = importlib.import_module("megatron.training.loop")
    pretrain_module = importlib.import_module("megatron.training.pretrain")
    logger = get_logger()
    out = []
    for run in runs:
        run = dict(run)
        setup_seconds = run.pop("setup_seconds", 0.0)
        lines: list[str] = []
        handler, level = _ListHandler(lines), logger.level
        clock, provider = _ShiftedClock(), pretrain_gpt.model_provider

        def slow_provider(*args, **kwargs):
            clock.shift += setup_seconds
            return provider(*args, **kwargs)

        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        if setup_seconds:
            loop.time = pretrain_module.time = clock
            pretrain_gpt.model_provider = slow_provider
        try:
            result = e2e.run_pretrains(rank, world_size, [run])[0]
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            loop.time = pretrain_module.time = time
            pretrain_gpt.model_provider = provider
        result["log"] = lines
        out.append(result)
    return out


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------

def samples_argv(corpus, samples: int, **kwargs) -> list[str]:
    """``e2e.gpt_argv`` with --train-samples instead of --train-iters / --lr-warmup-iters."""
    argv = e2e.gpt_argv(corpus, **kwargs)
    for flag in ("--train-iters", "--lr-warmup-iters"):
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv + ["--train-samples", str(samples)]


@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop_options")
    tb, ckpt = tmp / "tensorboard", tmp / "ckpt"
    c = gpt2_corpus
    specs = {
        # Logging, evaluation, and timers to TensorBoard on two ranks (the writer on rank 1).
        "log": {"argv": e2e.gpt_argv(c, iters=4, extra=[
            "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
            "--tensorboard-dir", tb, "--tensorboard-log-interval", "1",
            "--log-timers-to-tensorboard", "--timing-log-level", "2"])},
        # 44 samples of 8: 5 iterations; linear schedule over samples (warm-up 16, decay 32).
        "samples": {"argv": samples_argv(c, 44, extra=[
            "--log-interval", "1", "--lr-warmup-samples", "16", "--lr-decay-samples", "32",
            "--lr-decay-style", "linear"])},
        # Ramp-up 2 -> 6 by 2 over 8 samples: batches 2, 2, 4, 6 (14 samples), then
        # (30 - 14) // 6 = 2 full batches; the partial batch of 4 is dropped.
        "rampup": {"argv": samples_argv(c, 30, mbs=1, gbs=6, extra=[
            "--log-interval", "1", "--rampup-batch-size", "2", "2", "8"])},
        # --exit-interval still works when --exit-duration-in-mins is set (and not reached).
        "exit_both": {"argv": e2e.gpt_argv(c, iters=6, extra=[
            "--exit-duration-in-mins", "1000", "--exit-interval", "3"])},
        # A 61-second set-up: the 1-minute clock, started at the top of pretrain(), runs out
        # after the first iteration, which is saved.
        "exit_duration": {"setup_seconds": 61.0, "argv": e2e.gpt_argv(c, iters=6, extra=[
            "--exit-duration-in-mins", "1", "--save", ckpt, "--save-interval", "100"])},
        # Evaluation only, from that checkpoint.
        "skip_train": {"argv": e2e.gpt_argv(c, iters=6, extra=[
            "--load", ckpt, "--skip-train", "--eval-iters", "1"])},
    }
    per_rank = run_distributed(2, run_capturing, list(specs.values()), timeout=300)
    out = {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(specs)}
    out["tensorboard"] = e2e.read_scalars(tb)
    out["ckpt"] = ckpt
    return out


def test_log_lines_parse_with_megatrons_field_order(runs):
    log, history = runs["log"][-1]["log"], runs["log"][-1]["history"]
    parsed = parse(log, TRAIN_LINE)
    assert [int(p["iteration"]) for p in parsed] == [1, 2, 3, 4], log
    for i, (p, h) in enumerate(zip(parsed, history), start=1):
        assert int(p["train_iters"]) == 4 and int(p["consumed"]) == 8 * i
        assert int(p["gbs"]) == 8 and float(p["scale"]) == 1.0
        assert float(p["loss"]) == pytest.approx(h["lm loss"], rel=1e-6)
        assert float(p["grad_norm"]) == pytest.approx(h["grad norm"], abs=1e-3)
        assert float(p["lr"]) == pytest.approx(h["learning rate"], rel=1e-3)
        assert int(p["skipped"]) == 0 and int(p["nan"]) == 0
        assert re.fullmatch(r" tokens per second: [\d.]+ \|", p["extra"]), p["extra"]


def test_eval_interval_writes_validation_lines(runs):
    parsed = parse(runs["log"][-1]["log"], VALID_LINE)
    assert [p["prefix"] for p in parsed] == [
        "iteration 2", "iteration 4", "the end of training for val data"]
    for p in parsed:
        loss = float(p["loss"])
        assert 5.0 < loss < 12.0
        assert float(p["ppl"]) == pytest.approx(math.exp(loss), rel=1e-5)


def test_timers_to_tensorboard_on_two_ranks(runs):
    scalars = runs["tensorboard"]
    # Megatron-LM's names: level 1 (the step and the optimizer's parts), level 2 (compute).
    names = ("forward-backward", "forward-compute", "backward-compute", "batch-generator",
             "grads-all-reduce", "optimizer-copy-to-main-grad", "optimizer-clip-main-grad",
             "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer")
    for name in names:
        assert sorted(scalars[f"{name}-time"]) == [1, 2, 3, 4], sorted(scalars)
    rank0_log = runs["log"][0]["log"]
    assert rank0_log.count("(min, max) time across ranks (ms):") == 4
    timer_lines = [line.split()[0] for line in rank0_log if line.startswith("    ")
                   and "..." in line]
    assert timer_lines[:len(names)] == list(names)  # Megatron's order
    # Not started in this run (no loss scaler, no zero counting, no distributed optimizer).
    for absent in ("optimizer-unscale-and-check-inf", "optimizer-count-zeros",
                   "grads-reduce-scatter", "params-all-gather"):
        assert f"{absent}-time" not in scalars


def expected_lr(samples: int) -> float:
    """Linear, warm-up 16 samples, decay 32 samples, from MAX_LR to MIN_LR."""
    if samples <= 16:
        return MAX_LR * samples / 16
    if samples > 32:
        return MIN_LR
    return MIN_LR + (MAX_LR - MIN_LR) * (1.0 - (samples - 16) / 16)


def test_train_samples_sets_length_and_schedule_in_samples(runs):
    for rank_result in runs["samples"]:
        assert rank_result["iteration"] == 5 and len(rank_result["history"]) == 5
        lrs = [h["learning rate"] for h in rank_result["history"]]
        assert lrs == pytest.approx([expected_lr(8 * i) for i in range(1, 6)], rel=1e-9)
    parsed = parse(runs["samples"][-1]["log"], TRAIN_LINE)
    assert [(int(p["iteration"]), int(p["train_iters"])) for p in parsed] == \
        [(i, 5) for i in range(1, 6)]


def test_rampup_batch_size_per_iteration(runs):
    for rank_result in runs["rampup"]:
        assert rank_result["iteration"] == 6
        sizes = [int(h["global batch size"]) for h in rank_result["history"]]
        assert sizes == [2, 2, 4, 6, 6, 6]
    parsed = parse(runs["rampup"][-1]["log"], TRAIN_LINE)
    assert [int(p["gbs"]) for p in parsed] == [2, 2, 4, 6, 6, 6]
    assert [int(p["consumed"]) for p in parsed] == [2, 4, 8, 14, 20, 26]


def test_exit_interval_with_exit_duration_set(runs):
    for rank_result in runs["exit_both"]:
        assert rank_result["iteration"] == 3 and len(rank_result["history"]) == 3
    assert "exiting program at iteration 3" in runs["exit_both"][0]["log"]


def test_exit_duration_counts_setup_and_saves(runs):
    for rank_result in runs["exit_duration"]:
        assert rank_result["iteration"] == 1 and len(rank_result["history"]) == 1
    rank0_log = runs["exit_duration"][0]["log"]
    assert any(line.startswith("exiting program after ") for line in rank0_log)
    ckpt = runs["ckpt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (ckpt / "iter_0000001").is_dir()


def test_skip_train_only_evaluates_the_loaded_checkpoint(runs):
    for rank_result in runs["skip_train"]:
        assert rank_result["iteration"] == 1 and rank_result["history"] == []
    log = runs["skip_train"][-1]["log"]
    assert parse(log, TRAIN_LINE) == []
    assert [p["prefix"] for p in parse(log, VALID_LINE)] == ["the end of training for val data"]


# ---------------------------------------------------------------------------------------------
# Pure: the exit checks
# ---------------------------------------------------------------------------------------------

def trainer(iteration: int, exit_interval=None, exit_duration_in_mins=None, start_time=None):
    from megatron.training.loop import Trainer, TrainState

    cfg = SimpleNamespace(
        training=SimpleNamespace(exit_interval=exit_interval,
                                 exit_duration_in_mins=exit_duration_in_mins),
        checkpoint=SimpleNamespace(save=None))
    return Trainer(cfg, None, [], None, None, None, None, TrainState(iteration=iteration),
                   start_time=start_time)


def test_exit_checks_are_independent():
    assert trainer(3, exit_interval=3, exit_duration_in_mins=1000)._should_exit(None)
    assert not trainer(2, exit_interval=3, exit_duration_in_mins=1000)._should_exit(None)
    assert trainer(2, exit_interval=3, exit_duration_in_mins=1,
                   start_time=time.time() - 61)._should_exit(None)
    assert not trainer(2, exit_duration_in_mins=1)._should_exit(None)  # the clock starts now


# ---------------------------------------------------------------------------------------------
# Pure: what the loop keeps
# ---------------------------------------------------------------------------------------------

def test_train_state_does_not_grow_with_the_run():
    """TrainState holds counters only: nothing in it grows per iteration (the per-iteration
    values the tests compare are recorded by the tests, e2e._StepRecorder)."""
    import dataclasses

    from megatron.training.loop import TrainState

    state = TrainState()
    growing = [f.name for f in dataclasses.fields(state)
               if not isinstance(getattr(state, f.name), (int, float, type(None)))]
    assert not growing, growing
