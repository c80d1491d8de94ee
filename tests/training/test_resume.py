"""Exact resume.

20 iterations straight vs 10 (``--exit-interval 10`` saves and stops) + ``--load`` + 10, with
dropout 0.1, so the data order, the optimizer state, the LR schedule and every RNG stream
(torch's and the tensor-parallel tracker's) must come back from the checkpoint for the losses to
agree. The SIGTERM exit of ``--exit-signal-handler`` (signal to one rank's process group with
loader workers: finish the iteration, save, exit 0 on every rank, resume exactly) is
``tests/faults/test_signals.py``.
"""

from __future__ import annotations

import pytest

from tests.training import e2e

RESUME_TOL = 1e-6
# Micro-batch 1, global batch 2: with TP=2 two accumulated micro-batches, with DP=2 one each.
SHAPE = {"seq": 32, "mbs": 1, "gbs": 2, "dropout": 0.1, "iters": 20}
LAYOUTS = {"tp2": {"tp": 2}, "dp2_distributed_optimizer":
           {"extra": ["--use-distributed-optimizer"]}}


@pytest.fixture(scope="module")
def resumed(gpt2_corpus, tmp_path_factory):
    """Per layout: (straight run, first half, resumed second half), each a list of ranks."""
    runs, saves = [], {}
    for name, layout in LAYOUTS.items():
        save = saves[name] = tmp_path_factory.mktemp(f"resume_{name}")
        extra = layout.get("extra", [])
        argv = dict(SHAPE, tp=layout.get("tp", 1))
        runs += [{"argv": e2e.gpt_argv(gpt2_corpus, **argv, extra=extra)},
                 {"argv": e2e.gpt_argv(gpt2_corpus, **argv, extra=[
                     *extra, "--save", save, "--save-interval", "1000", "--exit-interval", "10"])},
                 {"argv": e2e.gpt_argv(gpt2_corpus, **argv, extra=[*extra, "--load", save])}]
    # The TP=2 checkpoint at 10 once more, without its RNG state (two iterations are enough).
    runs.append({"argv": e2e.gpt_argv(gpt2_corpus, **dict(SHAPE, tp=2), extra=[
        "--load", saves["tp2"], "--no-load-rng", "--exit-interval", "12"])})
    results = e2e.pooled(2, runs)
    out = {name: results[3 * i: 3 * i + 3] for i, name in enumerate(LAYOUTS)}
    out["tp2_without_rng"] = results[-1]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_exact(resumed, layout):
    straight, first, second = resumed[layout]
    for rank in range(2):
        full = e2e.losses(straight[rank])
        assert len(full) == 20 and first[rank]["iteration"] == 10
        assert second[rank]["iteration"] == 20 and len(second[rank]["history"]) == 10
        halves = e2e.losses(first[rank]) + e2e.losses(second[rank])
        diff = e2e.max_abs_diff(full, halves)
        assert diff <= RESUME_TOL, (f"{layout}, rank {rank}: resumed losses differ by {diff:.3g}"
                                    f"\n  straight {full}\n  10 + 10  {halves}")
        grad_norms = [h["grad norm"] for h in straight[rank]["history"]]
        resumed_norms = [h["grad norm"] for h in first[rank]["history"] + second[rank]["history"]]
        assert max(abs(a - b) for a, b in zip(grad_norms, resumed_norms)) <= 1e-5


def test_resume_needs_the_rng_state(resumed):
    """With --no-load-rng the dropout masks after the resume differ: the exact-resume test above
    really depends on the RNG state in the checkpoint (and dropout is really on)."""
    straight = e2e.losses(resumed["tp2"][0][0])
    without_rng = e2e.losses(resumed["tp2_without_rng"][0])
    assert len(without_rng) == 2
    assert e2e.max_abs_diff(straight[10:12], without_rng) > 1e-4
