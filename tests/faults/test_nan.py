"""NaN/inf losses beyond tests/training/test_nan_check.py (fp32 GPT, DP=2: the stop
naming iteration and rank, the local-gradient check, the count on the log line): the same
promises at pipeline parallelism, in bf16 (no loss scaler: nothing skips the step) and for
BERT, whose two losses are both reported.

One pooled world of two ranks, tiny models on ``--mock-data``, a learning rate that ruins the
weights within a few steps (1e30): the loss turns NaN/inf by itself, nothing is injected.

* GPT, PP=2: the loss exists only on the last stage (rank 1); every rank stops at the same
  iteration, naming rank 1; no rank is left waiting in a pipeline send/recv;
* GPT, bf16, DP=2: stops naming the iteration and rank 0; with
  --no-check-for-nan-in-loss-and-grad it trains on, the log line shows the loss as nan/inf and
  counts each such iteration in "number of nan iterations";
* BERT, PP=2: stops naming rank 1 and shows both losses (lm loss, sop loss).
"""

from __future__ import annotations

import logging
import math
import re

import pytest

from tests.training import e2e
from tests.training.test_bert_pretrain import bert_argv

ITERS = 5
HUGE_LR = ["--lr", "1e30", "--min-lr", "1e29"]
COMMON = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
          "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
          "--global-batch-size", "2", "--train-iters", str(ITERS), "--lr-warmup-iters", "0",
          "--mock-data", "--vocab-size", "512", "--use-cpu-initialization",
          "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
          "--distributed-backend", "gloo", "--seed", "1234", *HUGE_LR]
PP2 = ["--pipeline-model-parallel-size", "2"]
UNCHECKED = "--no-check-for-nan-in-loss-and-grad"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _bert_run(argv: list[str]) -> dict:
    import pretrain_bert
    from megatron.training.pretrain import pretrain
    from tests.training.test_bert_pretrain import synthetic_datasets_provider

    try:
        state = pretrain(synthetic_datasets_provider, pretrain_bert.model_provider,
                         pretrain_bert.forward_step,
                         argv=pretrain_bert.with_default_tokenizer(argv))
    except FloatingPointError as err:
        return {"error": f"FloatingPointError: {err}", "iteration": None}
    return {"error": None, "iteration": state.iteration}


def _runs(rank: int, world_size: int, runs: list[dict]) -> list[tuple[dict, list[str]]]:
    """Each run on this rank: (result, the log lines this rank printed)."""
    from megatron.core import parallel_state
    from megatron.core.log import get_logger

    out = []
    for run in runs:
        parallel_state.destroy_model_parallel()
        handler = _Lines()
        get_logger().addHandler(handler)
        try:
            if run.get("bert"):
                result = _bert_run(run["argv"])
            else:
                result = e2e._one_run(run, (FloatingPointError,))
        finally:
            get_logger().removeHandler(handler)
        out.append((result, handler.lines))
    return out


@pytest.fixture(scope="module")
def runs():
    from tests.multiprocess import run_distributed

    named = {
        "gpt_pp2": {"argv": [*COMMON, *PP2]},
        "gpt_bf16": {"argv": [*COMMON, "--bf16"]},
        "gpt_bf16_unchecked": {"argv": [*COMMON, "--bf16", UNCHECKED]},
        "bert_pp2": {"argv": bert_argv(iters=ITERS, extra=[
            *PP2, *HUGE_LR, "--lr-warmup-iters", "0", "--log-interval", "1"]), "bert": True},
    }
    per_rank = run_distributed(2, _runs, list(named.values()), timeout=300)
    return {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(named)}


def _logged(lines: list[str]) -> dict[int, tuple[str, int]]:
    """{iteration: (lm loss as printed, nan count)} of the training log lines."""
    out = {}
    for line in lines:
        match = re.search(r"iteration\s+(\d+)/.*\| lm loss: (\S+) \|.*number of nan "
                          r"iterations:\s+(\d+)", line)
        if match:
            out[int(match.group(1))] = (match.group(2), int(match.group(3)))
    return out


def _stopped(results, rank_named: int) -> int:
    """Every rank stopped at the same iteration naming ``rank_named`` (each showing its own
    view of the loss); returns the iteration."""
    iterations = set()
    for result, _ in results:
        error = result["error"] or ""
        match = re.match(r"FloatingPointError: iteration (\d+): a reported loss is NaN/inf "
                         rf"\(first on rank {rank_named}; here ", error)
        assert match, error
        assert "--no-check-for-nan-in-loss-and-grad" in error
        iterations.add(int(match.group(1)))
    assert len(iterations) == 1, iterations
    return iterations.pop()


def test_pipeline_parallel_stops_every_stage_naming_the_last(runs):
    iteration = _stopped(runs["gpt_pp2"], rank_named=1)
    first_stage_error = runs["gpt_pp2"][0][0]["error"]
    assert "here no loss: not the last pipeline stage)" in first_stage_error
    assert re.search(r"here lm loss: (nan|inf)\)", runs["gpt_pp2"][1][0]["error"])
    assert 1 <= iteration <= ITERS
    # The iterations before it were logged (by the last stage) with finite losses.
    logged = _logged(runs["gpt_pp2"][1][1])
    assert sorted(logged) == list(range(1, iteration)), logged
    assert all(math.isfinite(float(loss)) and count == 0 for loss, count in logged.values())


def test_bf16_stops_and_unchecked_counts_every_nan_iteration(runs):
    iteration = _stopped(runs["gpt_bf16"], rank_named=0)
    result, lines = runs["gpt_bf16_unchecked"][1]  # the log line is the last rank's
    assert result["error"] is None and result["iteration"] == ITERS
    bad = [i for i, h in enumerate(result["history"], 1) if not math.isfinite(h["lm loss"])]
    assert bad and bad[0] == iteration, (bad, iteration)  # the same step goes bad
    logged = _logged(lines)
    assert sorted(logged) == list(range(1, ITERS + 1)), lines
    for i, (loss, count) in logged.items():
        assert count == int(i in bad), (i, logged)
        assert (loss.lower() in ("nan", "inf", "-inf")) == (i in bad), (i, logged)


def test_bert_reports_both_losses_and_stops_naming_the_last_stage(runs):
    _stopped(runs["bert_pp2"], rank_named=1)
    error = runs["bert_pp2"][1][0]["error"]
    assert re.search(r"here lm loss: \S+, sop loss: \S+\)", error), error
