"""Named wall-clock timers with log levels, reduced over ranks for logging (Megatron's Timers).

``timers("forward-backward", log_level=1).start()`` ... ``.stop()``; a timer whose level is above
``--timing-log-level`` is a no-op. Device work is synchronized before reading the clock so GPU
timings are real. Core code (schedules, optimizers) takes an optional ``Timers`` and times its
steps with :func:`timed`, which does nothing without one.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch

from megatron.core import comm, device


class Timer:
    """One named timer accumulating elapsed seconds between start() and stop()."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._elapsed = 0.0
        self._started = False
        self._start_time = 0.0

    def start(self, barrier: bool = False) -> None:
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        if barrier:
            comm.barrier(comm.world_group())
        device.synchronize()
        self._start_time = time.perf_counter()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        if barrier:
            comm.barrier(comm.world_group())
        device.synchronize()
        self._elapsed += time.perf_counter() - self._start_time
        self._started = False

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (a running timer is included up to now)."""
        running = self._started
        if running:
            self.stop()
        value = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start()
        return value


class _NullTimer(Timer):
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def elapsed(self, reset: bool = True) -> float:
        return 0.0


class Timers:
    """A registry of timers filtered by ``log_level``; ``log_option`` is max, minmax or all."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax") -> None:
        self.log_level = log_level
        self.log_option = log_option
        self._timers: dict[str, Timer] = {}
        self._levels: dict[str, int] = {}
        self._null = _NullTimer("null")
        self._filtered: set[str] = set()  # names whose level is above --timing-log-level

    def __call__(self, name: str, log_level: int | None = None) -> Timer:
        if name in self._timers:
            return self._timers[name]
        if name in self._filtered:
            return self._null
        level = 0 if log_level is None else log_level
        if level > self.log_level:
            self._filtered.add(name)
            return self._null
        self._timers[name] = Timer(name)
        self._levels[name] = level
        return self._timers[name]

    def names(self) -> list[str]:
        return list(self._timers)

    def active(self, log_level: int) -> bool:
        """Whether timers of ``log_level`` record (``--timing-log-level`` is at least that)."""
        return log_level <= self.log_level

    def elapsed_ms(self, names: list[str], normalizer: float = 1.0,
                   reset: bool = True) -> dict[str, tuple[float, float]]:
        """Per timer (min over ranks, max over ranks) in milliseconds.

        Collective: every rank must call it with the same ``names``. A timer some ranks never
        started (say, one only the data-loading ranks run) counts on the ranks that have it; a
        name no rank has (filtered out by ``--timing-log-level``, or never started) is dropped.
        Compute the values once, then hand them to :meth:`format_values` and
        :meth:`write_values`, which do no communication.
        """
        # One MAX reduction gives both: [values, -values], missing timers as -inf.
        mine = [self._timers[n].elapsed(reset) * 1000.0 / normalizer if n in self._timers
                else None for n in names]
        both = torch.tensor([-math.inf if v is None else v for v in mine]
                            + [-math.inf if v is None else -v for v in mine],
                            dtype=torch.float64, device=device.get_device())
        comm.all_reduce(both, comm.world_group(), "max")
        high, low = both[:len(names)], -both[len(names):]
        return {n: (float(low[i]), float(high[i])) for i, n in enumerate(names)
                if high[i] > -math.inf}

    def format_values(self, values: dict[str, tuple[float, float]]) -> str:
        """Megatron's timer line from :meth:`elapsed_ms` values: ``(min, max) time across ranks
        (ms):`` (or ``max time ...`` with ``--timing-log-option max``), one row per timer."""
        if not values:
            return ""
        if self.log_option == "max":
            rows = [f"    {n} {'.' * max(1, 40 - len(n))}: {hi:.2f}"
                    for n, (_, hi) in values.items()]
            return "max time across ranks (ms):\n" + "\n".join(rows)
        rows = [f"    {n} {'.' * max(1, 40 - len(n))}: ({lo:.2f}, {hi:.2f})"
                for n, (lo, hi) in values.items()]
        return "(min, max) time across ranks (ms):\n" + "\n".join(rows)

    @staticmethod
    def write_values(values: dict[str, tuple[float, float]], writer, iteration: int) -> None:
        """Write each timer's max-over-ranks value to TensorBoard as ``{name}-time``."""
        for name, (_, high) in values.items():
            writer.add_scalar(f"{name}-time", high, iteration)

    def log_string(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> str:
        """Collective (every rank calls it): the timer line of ``names``."""
        return self.format_values(self.elapsed_ms(names, normalizer, reset))

    def write(self, names: list[str], writer, iteration: int, normalizer: float = 1.0,
              reset: bool = False) -> None:
        """Collective (every rank calls it, ``writer`` None where there is none, as Megatron's
        ``Timers.write``): the max-over-ranks values written as ``{name}-time``."""
        values = self.elapsed_ms(names, normalizer, reset)
        if writer is not None:
            self.write_values(values, writer, iteration)


@contextlib.contextmanager
def timed(timers: Timers | None, name: str, log_level: int,
          barrier: bool = False) -> Iterator[None]:
    """``with timed(timers, "optimizer-inner-step", 1): ...``: a no-op when ``timers`` is None
    or the level is above ``--timing-log-level``."""
    if timers is None:
        yield
        return
    timer = timers(name, log_level=log_level)
    timer.start(barrier=barrier)
    try:
        yield
    finally:
        timer.stop()
