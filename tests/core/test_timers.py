"""Timers: levels, accumulation, and the cross-rank (min, max) line."""

from __future__ import annotations

import time

import pytest

from megatron.core.timers import Timers
from tests.multiprocess import run_distributed


def test_levels_and_accumulation():
    timers = Timers(log_level=1)
    t = timers("step", log_level=1)
    for _ in range(2):
        t.start()
        time.sleep(0.01)
        t.stop()
    assert 0.015 < t.elapsed(reset=False) < 1.0
    assert t.elapsed() > 0 and t.elapsed() == 0.0  # reset after reading
    fine = timers("fine", log_level=2)  # above --timing-log-level: a no-op timer
    fine.start()
    timers("fine").stop()  # the same no-op, not a fresh timer that was never started
    assert "fine" not in timers.names()
    with pytest.raises(RuntimeError, match="not started"):
        timers("step").stop()


def _timer_line(rank, world_size):
    timers = Timers(log_level=0)
    t = timers("work")
    t.start()
    time.sleep(0.02 * (rank + 1))
    t.stop()
    return timers.elapsed_ms(["work"])["work"]


def test_min_max_across_ranks():
    results = run_distributed(2, _timer_line)
    low, high = results[0]
    assert results[0] == results[1]  # every rank gets the reduced pair
    assert 15 < low < high and high > 35


class _Writer:
    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag, value, step) -> None:
        self.scalars[tag] = (value, step)


def _write_on_last_rank(rank, world_size):
    timers = Timers(log_level=1)
    for name in ("fwd", "opt"):
        timers(name, log_level=1).start()
        time.sleep(0.01 * (rank + 1))
        timers(name).stop()
    timers("fine", log_level=2).start()  # filtered out on every rank alike
    # One collective on every rank; writing and formatting communicate no more.
    values = timers.elapsed_ms(["fwd", "opt", "fine"])
    writer = _Writer() if rank == world_size - 1 else None
    if writer is not None:
        Timers.write_values(values, writer, iteration=5)
    return values, timers.format_values(values), writer.scalars if writer else None


def test_write_and_line_from_one_reduction():
    results = run_distributed(2, _write_on_last_rank)
    (values, line, none), (values1, line1, scalars) = results
    assert none is None and values == values1 and line == line1
    assert sorted(values) == ["fwd", "opt"]
    assert scalars == {f"{n}-time": (values[n][1], 5) for n in ("fwd", "opt")}
    assert line.startswith("(min, max) time across ranks (ms):\n    fwd ")


def _timer_on_one_rank_only(rank, world_size):
    timers = Timers(log_level=2)
    timers("everywhere").start()
    timers("everywhere").stop()
    if rank == 1:  # e.g. only the ranks that load data time batch-generator
        timers("somewhere", log_level=2).start()
        time.sleep(0.02)
        timers("somewhere").stop()
    return timers.elapsed_ms(["everywhere", "somewhere", "nowhere"])


def test_timer_missing_on_some_ranks_counts_where_it_ran():
    results = run_distributed(2, _timer_on_one_rank_only)
    assert results[0] == results[1]
    assert sorted(results[0]) == ["everywhere", "somewhere"]
    low, high = results[0]["somewhere"]
    assert low == high and high > 15  # rank 1's value only, not a 0 from rank 0


def test_interval_timer_paused_around_evaluation_and_saves(monkeypatch):
    from megatron.core import timers as timers_module
    from megatron.training.loop import Trainer

    clock = [0.0]
    monkeypatch.setattr(timers_module.time, "perf_counter", lambda: clock[0])
    trainer = Trainer.__new__(Trainer)  # only its timers are used here
    trainer.timers = Timers(log_level=0)
    trainer.timers("interval-time", log_level=0).start()
    clock[0] += 1.0  # a training step
    with trainer._interval_timer_paused():
        clock[0] += 100.0  # evaluation or a checkpoint save
    clock[0] += 1.0
    assert trainer.timers("interval-time").elapsed() == pytest.approx(2.0)
    with pytest.raises(KeyError):  # an error inside propagates, the timer is not restarted
        with trainer._interval_timer_paused():
            raise KeyError("eval failed")
    assert not trainer.timers("interval-time").started
