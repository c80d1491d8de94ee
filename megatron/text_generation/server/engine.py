"""Requests served one at a time: a bounded queue in front of one generation thread.

Generation is collective across the model's ranks, so the server never runs two requests at
once: HTTP threads put :class:`Job` s in a queue of ``max_queue`` places (full: the caller
answers 503) and one worker thread runs them in order. A job reports its steps (for streaming)
and its end through its own event queue. Cancelling a job (its client disconnected) makes the
worker skip it if it has not started, or stop it at the next step (every rank stops with it);
either way its place is free again. An exception inside generation ends only that job.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron.core.log import get_logger
from megatron.text_generation.api import GenerationRequest, GenerationResult
from megatron.text_generation.generation import StepReport

logger = get_logger(__name__)

RunFn = Callable[[GenerationRequest, Callable[[StepReport], list[bool] | None]],
                 GenerationResult]
"""Runs one request on every rank (``lead_request`` bound to the model and tokenizer)."""


class QueueFull(Exception):
    """No place left in the queue (HTTP 503)."""


class Cancelled(Exception):
    """The job was cancelled before or while it ran."""


@dataclass
class Job:
    """One request in the queue. ``events`` receives ``("step", StepReport)`` (when
    ``stream``), then ``("done", GenerationResult)`` or ``("error", exception)``. ``watch`` (on
    the worker thread) may ask to stop rows after a step (stop strings)."""

    request: GenerationRequest
    stream: bool = False
    watch: Callable[[StepReport], list[bool] | None] | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end (skipping step events).

        Raises:
            the job's exception (ValueError for a bad request, Cancelled, or the failure).
        """
        while True:
            kind, value = self.events.get(timeout=timeout)
            if kind == "done":
                return value
            if kind == "error":
                raise value


class GenerationEngine:
    """The queue and the worker thread.

    Args:
        run: runs one request on every rank (with a per-step callback).
        max_queue: requests that may wait while one runs (>= 1).
    """

    def __init__(self, run: RunFn, max_queue: int = 16) -> None:
        if max_queue < 1:
            raise ValueError(f"--max-queue-size ({max_queue}) must be >= 1")
        self._run = run
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self.stats = {"served": 0, "failed": 0, "cancelled": 0, "refused": 0}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="generation", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        """Queue ``job``.

        Raises:
            QueueFull: every place is taken.
        """
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self._count("refused")
            raise QueueFull(f"server busy: {self.max_queue} requests already wait; retry "
                            "later") from None
        return job

    def queued(self) -> int:
        return self._jobs.qsize()

    def close(self, timeout: float = 30.0) -> None:
        """Finish the running job, then stop the worker (jobs still queued are cancelled)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.events.put(("error", Cancelled("the server is shutting down")))
        self._jobs.put(None)
        self._thread.join(timeout)

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                self._count("cancelled")
                job.events.put(("error", Cancelled("cancelled before it started")))
                continue
            self._run_one(job)

    def _run_one(self, job: Job) -> None:
        rows = len(job.request.prompts) if job.request.beam_width is None else 1

        def on_step(report: StepReport) -> list[bool] | None:
            # Runs on the serving rank only, between collective steps: an exception here would
            # leave the other ranks waiting, so a failing callback cancels the job instead.
            try:
                if job.cancelled.is_set():
                    return [True] * rows
                if job.stream:
                    job.events.put(("step", report))
                return job.watch(report) if job.watch is not None else None
            except Exception:  # noqa: BLE001
                logger.exception("a step callback failed; cancelling the request")
                job.cancel()
                return [True] * rows

        try:
            result = self._run(job.request, on_step)
        except ValueError as err:  # a request the model cannot take (e.g. too long)
            self._count("failed")
            job.events.put(("error", err))
            return
        except Exception as err:  # noqa: BLE001 - one failed request must not end the server
            logger.exception("generation failed")
            self._count("failed")
            job.events.put(("error", RuntimeError(f"generation failed: {type(err).__name__}: "
                                                  f"{err}")))
            return
        if job.cancelled.is_set():
            self._count("cancelled")
        else:
            self._count("served")
        job.events.put(("done", result))
