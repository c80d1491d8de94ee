"""Checkpoints that must not load, and saves that die half-way.

A corrupt (truncated) file, a checkpoint of another shape (``--hidden-size``) or another TP size,
and a hostile pickle are refused through ``pretrain(--load)`` with a CheckpointError naming the
problem; the hostile one runs none of its code. A save killed after the shard but before the
tracker, or in the middle of the shard, leaves the previous checkpoint as the one that loads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron.training.checkpointing import (MODEL_FILENAME, TRACKER_FILENAME, CheckpointError,
                                             load_checkpoint_file)
from tests.training import e2e

SHAPE = {"seq": 32, "mbs": 1, "gbs": 2}
ERRORS = (CheckpointError, e2e.SimulatedCrash)


class _Hostile:
    """Pickles as a call to os.system: loading it with plain pickle would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def saved(gpt2_corpus, tmp_path_factory) -> Path:
    """A TP=1 checkpoint of the tiny GPT at iteration 2 (of a 4-iteration schedule)."""
    root = tmp_path_factory.mktemp("ckpt_safety") / "good"
    result = e2e.pooled(1, [{"argv": e2e.gpt_argv(gpt2_corpus, iters=4, **SHAPE, extra=[
        "--save", root, "--save-interval", "1000", "--exit-interval", "2"])}])[0][0]
    assert result["iteration"] == 2
    assert (root / TRACKER_FILENAME).read_text() == "2"
    return root


def _copy(saved: Path, dest: Path) -> Path:
    shutil.copytree(saved, dest)
    return dest


def _shard(root: Path, iteration: int = 2, tp_rank: int = 0) -> Path:
    return root / f"iter_{iteration:07d}" / f"mp_rank_{tp_rank:02d}" / MODEL_FILENAME


def test_refused_checkpoints(gpt2_corpus, saved, tmp_path):
    """Truncated, wrong hidden size, hostile: each refused with a message that says why."""
    truncated = _copy(saved, tmp_path / "truncated")
    shard = _shard(truncated)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    hostile = tmp_path / "hostile"
    marker = tmp_path / "HOSTILE_CODE_RAN"
    good = torch.load(_shard(saved), map_location="cpu", weights_only=False)
    _shard(hostile).parent.mkdir(parents=True)
    torch.save({**good, "optimizer": {"state": _Hostile(marker)}}, _shard(hostile))
    (hostile / TRACKER_FILENAME).write_text("2")

    def load(root, **kw):
        return {"argv": e2e.gpt_argv(gpt2_corpus, iters=4, **{**SHAPE, **kw.pop("shape", {})},
                                     extra=["--load", root, *kw.pop("extra", [])])}

    truncated_run, wider_run, hostile_run = (r[0] for r in e2e.pooled(1, [
        load(truncated),
        load(saved, extra=["--hidden-size", "128"]),
        load(hostile)], expect_error=ERRORS))

    assert truncated_run["error"] is not None, "a truncated checkpoint was loaded"
    assert truncated_run["error"].startswith("CheckpointError")
    assert "corrupt or truncated" in truncated_run["error"] and str(shard) in truncated_run["error"]

    assert wider_run["error"] is not None, "a checkpoint of another hidden size was loaded"
    assert "--hidden-size: checkpoint 64, flags 128" in wider_run["error"]

    assert hostile_run["error"] is not None, "a hostile checkpoint was loaded"
    assert "refusing to load" in hostile_run["error"] and "allowlist" in hostile_run["error"]
    assert f"holds {os.system.__module__}.system," in hostile_run["error"], hostile_run["error"]
    assert not marker.exists(), "loading the checkpoint ran code from it"
    with pytest.raises(CheckpointError, match=r"refusing to load .* holds \w+\.system"):
        load_checkpoint_file(_shard(hostile))  # and in this process too
    assert not marker.exists()
    # The hostile file really is hostile: plain pickle loading would have run the command.
    torch.load(_shard(hostile), map_location="cpu", weights_only=False)
    assert marker.exists()


def test_other_tensor_parallel_size_is_refused(gpt2_corpus, saved):
    """A TP=1 checkpoint loaded with TP=2 (same padded vocabulary): every rank refuses, naming
    the TP sizes (the missing mp_rank_01 shard is not what the message is about)."""
    results = e2e.pooled(2, [{"argv": e2e.gpt_argv(gpt2_corpus, tp=2, iters=4, **SHAPE,
                                                   extra=["--load", saved])}],
                         expect_error=ERRORS)[0]
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} loaded a TP=1 checkpoint with TP=2"
        assert "--tensor-model-parallel-size: checkpoint 1, flags 2" in result["error"], \
            result["error"]


@pytest.mark.parametrize("stage", ["tracker", "shard"])
def test_crash_during_save_keeps_previous_checkpoint(gpt2_corpus, tmp_path, stage):
    """Save at iteration 2, then die while saving iteration 4 (after its shard, before the
    tracker; or half-way through the shard): the tracker still says 2, and --load resumes
    from 2 (and its loss matches the uninterrupted run's iterations 3-4)."""
    root = tmp_path / "ckpt"
    argv = e2e.gpt_argv(gpt2_corpus, iters=4, **SHAPE, extra=[
        "--save", root, "--save-interval", "2"])
    crashed, resumed, straight = (r[0] for r in e2e.pooled(1, [
        {"argv": argv, "crash_save": (4, stage)},
        {"argv": e2e.gpt_argv(gpt2_corpus, iters=4, **SHAPE, extra=["--load", root])},
        {"argv": e2e.gpt_argv(gpt2_corpus, iters=4, **SHAPE)}], expect_error=ERRORS))
    assert crashed["error"] is not None and "simulated crash" in crashed["error"]
    assert (root / TRACKER_FILENAME).read_text() == "2"
    assert _shard(root, 2).is_file()
    assert _shard(root, 4).is_file() == (stage == "tracker")  # the orphan, never pointed at
    assert resumed["error"] is None and resumed["iteration"] == 4
    assert len(resumed["history"]) == 2
    assert e2e.max_abs_diff(e2e.losses(resumed), e2e.losses(straight)[2:]) <= 1e-6
