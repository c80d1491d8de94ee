"""``--async-save``: the save call copies this rank's state to host memory and returns; a
background thread writes it with DCP over a process group of its own (so its collectives never
interleave with training's), then gathers the checksums, and global rank 0 writes them and
moves the tracker file. The tracker therefore names an iteration only once every rank's write
is complete: a process killed during the write leaves the previous checkpoint the one a resume
loads.

One save is in flight at a time: the next save call (and the end of training) first waits for
the previous one; :func:`wait` reports how long the caller was blocked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron.core import comm
from megatron.checkpointing.dist import storage
from megatron.checkpointing.errors import CheckpointError


class AsyncSaver:
    """The save in flight on this rank (one per process: :data:`SAVER`)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group = None

    def _checkpoint_group(self):
        # Created by every rank at its first asynchronous save (the same save call on all).
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def start(self, directory: Path, state: dict[str, Any], fully_parallel: bool,
              publish: Callable[[dict[str, str]], None]) -> None:
        """Write the staged ``state`` in the background; then, on global rank 0, ``publish``
        the every-rank ``{file: sha256}`` (checksums, tracker)."""
        self.wait()
        group = self._checkpoint_group()

        def run() -> None:
            try:
                digests = storage.write(directory, state, fully_parallel, group)
                every = comm.all_gather_object(digests, group)
                if dist.get_rank() == 0:
                    publish({k: v for d in every for k, v in d.items()})
                comm.barrier(group)
            except BaseException as err:  # noqa: BLE001 - reported by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name="async-checkpoint-save", daemon=True)
        self._thread.start()

    def wait(self) -> float:
        """Block until the save in flight is complete; returns the seconds blocked.

        Raises:
            CheckpointError: the background write failed.
        """
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"the asynchronous checkpoint save failed: "
                                  f"{type(error).__name__}: {error}") from error
        return time.perf_counter() - start

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


SAVER = AsyncSaver()
"""This process's asynchronous saver (the one place that knows of a save in flight)."""
