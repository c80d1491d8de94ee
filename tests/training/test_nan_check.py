"""--check-for-nan-in-loss-and-grad (on by default) and the nan count of the log line.

Through the training loop on two data-parallel ranks:

* a learning rate so large that the first steps ruin the weights: the reported loss goes
  NaN/inf (at iteration 3); training stops there on every rank (no rank left waiting in a
  collective) naming the iteration and the rank;
* an inf injected into rank 1's training loss (the logged loss stays finite, the gradients blow
  up): in fp32 the local-gradient check stops iteration 2 naming rank 1, before the
  data-parallel reduction spreads the inf; with --fp16 the step is only skipped (the existing
  loss-scaling tests cover that path, tests/training/test_mixed_precision.py);
* --no-check-for-nan-in-loss-and-grad trains on, and "number of nan iterations" counts every
  iteration whose loss was NaN/inf (before: 0, as only skipped iterations were counted).
"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from tests.training import e2e

ITERS = 4
HUGE_LR = ["--lr", "1e30", "--min-lr", "1e29"]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _runs_with_log(rank: int, world_size: int, runs: list[dict]) -> tuple[list[dict], list[str]]:
    """e2e.run_pretrains, plus the log lines this rank printed."""
    from megatron.core.log import get_logger

    logger, handler = get_logger(), _Lines()
    logger.addHandler(handler)
    try:
        return e2e.run_pretrains(rank, world_size, runs, (FloatingPointError,)), handler.lines
    finally:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def runs(gpt2_corpus):
    from tests.multiprocess import run_distributed

    def argv(extra):
        return e2e.gpt_argv(gpt2_corpus, iters=ITERS, seq=16, mbs=1, gbs=2, extra=[
            "--log-interval", "1", *extra])

    named = {
        "huge_lr": {"argv": argv(HUGE_LR)},
        "inf_grads": {"argv": argv([]), "inf_at": ((2,), 1, 1)},
        "unchecked": {"argv": argv([*HUGE_LR, "--no-check-for-nan-in-loss-and-grad"])},
    }
    per_rank = run_distributed(2, _runs_with_log, list(named.values()), timeout=300)
    return {name: [(per_rank[r][0][i], per_rank[r][1]) for r in range(2)]
            for i, name in enumerate(named)}


def _first_nan_iteration(result: dict) -> int:
    return next(i for i, h in enumerate(result["history"], 1) if not math.isfinite(h["lm loss"]))


def test_nan_loss_stops_every_rank_naming_iteration_and_rank(runs):
    # The same run without the check shows where the loss goes bad.
    first_bad = _first_nan_iteration(runs["unchecked"][0][0])
    assert first_bad > 1
    for result, _ in runs["huge_lr"]:
        error = result["error"] or ""
        assert error.startswith(f"FloatingPointError: iteration {first_bad}: a reported loss is "
                                "NaN/inf (first on rank 0; here lm loss: "), error
        assert "the local loss first went NaN/inf on rank 0" in error
        assert "--no-check-for-nan-in-loss-and-grad" in error


def test_nan_gradients_stop_before_the_reduction_naming_the_rank(runs):
    for result, _ in runs["inf_grads"]:
        error = result["error"] or ""
        # Only rank 1's loss was poisoned, after the loss function: the reported (data-parallel
        # mean) loss is finite, the backward pass is not.
        assert error.startswith(
            "FloatingPointError: iteration 2: the local loss first went NaN/inf on rank 1; local "
            "gradients first went NaN/inf on rank 1 (before the data-parallel reduction)"), error
        assert "reported loss" not in error


def test_unchecked_run_trains_on_and_counts_nan_iterations(runs):
    result, lines = runs["unchecked"][-1]  # the log line is printed by the last rank
    assert result["error"] is None and result["iteration"] == ITERS
    bad = [i for i, h in enumerate(result["history"], 1) if not math.isfinite(h["lm loss"])]
    assert bad and bad[0] > 1, result["history"]
    counts = {}
    for line in lines:
        match = re.search(r"iteration\s+(\d+)/.*number of nan iterations:\s+(\d+)", line)
        if match:
            counts[int(match.group(1))] = int(match.group(2))
    # --log-interval 1: each line counts its own iteration.
    assert counts == {i: int(i in bad) for i in range(1, ITERS + 1)}, (counts, lines)


def _local_ddp(contiguous: bool) -> tuple[torch.nn.Module, DistributedDataParallel]:
    module = torch.nn.Linear(3, 2)
    config = DistributedDataParallelConfig(use_contiguous_buffers_in_local_ddp=contiguous,
                                           check_for_nan_in_grad=True)
    return module, DistributedDataParallel(module, config, dp_group=None)


@pytest.mark.parametrize("contiguous", [True, False])
def test_ddp_records_local_gradients_before_the_reduction(contiguous):
    """No process group: a world of one (the reduction is a no-op)."""
    _, ddp = _local_ddp(contiguous)
    for value, finite in ((1.0, True), (math.nan, False), (math.inf, False), (2.0, True)):
        ddp.zero_grad_buffer()
        ddp(torch.full((4, 3), value)).sum().backward()
        ddp.finish_grad_sync()
        assert ddp.local_grads_finite() is finite, value
    ddp.check_for_nan_in_grad = False
    ddp.zero_grad_buffer()
    ddp(torch.full((4, 3), math.nan)).sum().backward()
    ddp.finish_grad_sync()
    assert ddp.local_grads_finite()  # not checking: nothing recorded
