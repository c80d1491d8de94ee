"""Timers: levels, accumulation, and the cross-rank (min, max) line."""

from __future__ import annotations

import time

import pytest

from megatron.training.timers import Timers
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
