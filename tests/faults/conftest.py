"""Fixtures shared by the fault suite's modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults import harness as h


class Reference:
    """An uninterrupted run of :data:`harness.PP2` (started once per session, in the
    background: its start-up overlaps the jobs of the tests that compare with it)."""

    def __init__(self, root: Path) -> None:
        self.job = h.launch("pretrain_gpt.py", h.pp2_flags(root / "save"), root / "reference.log",
                            nproc=2)
        self._losses: dict[int, float] | None = None

    def losses(self) -> dict[int, float]:
        if self._losses is None:
            assert self.job.wait() == 0, self.job.tail()
            self._losses = self.job.losses()
            assert sorted(self._losses) == list(range(1, h.PP2_ITERS + 1)), self.job.tail()
        return self._losses


@pytest.fixture(scope="session")
def pp2_reference(tmp_path_factory):
    reference = Reference(tmp_path_factory.mktemp("pp2_reference"))
    try:
        yield reference
    finally:
        reference.job.reap()
