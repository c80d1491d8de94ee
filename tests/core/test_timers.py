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
