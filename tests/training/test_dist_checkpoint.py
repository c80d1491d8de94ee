"""``--ckpt-format torch_dist`` through pretrain(): a run saved at TP=2 resumes at TP=2 and at
TP=1 x DP=2 with the losses of the same resume from a ``--ckpt-format torch`` checkpoint (the
optimizer state starts afresh in both: saved with --no-save-optim); ``--auto-detect-ckpt-format``
reads either; the other format without it is refused by name; an ``--async-save`` checkpoint
resumes like a synchronous one."""

from __future__ import annotations

import pytest

from tests.training import e2e

SHAPE = {"seq": 32, "mbs": 1, "gbs": 2, "iters": 6}
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    dist_dir = tmp_path_factory.mktemp("torch_dist")
    legacy_dir = tmp_path_factory.mktemp("torch")
    async_dir = tmp_path_factory.mktemp("torch_dist_async")

    def argv(tp, *extra):
        return {"argv": e2e.gpt_argv(gpt2_corpus, **dict(SHAPE, tp=tp), extra=list(extra))}

    save = ("--save-interval", "3", "--exit-interval", "3", "--no-save-optim")
    plan = [
        argv(2, "--save", dist_dir, *save, "--ckpt-format", "torch_dist"),
        argv(2, "--save", legacy_dir, *save),
        argv(2, "--load", dist_dir, "--no-load-optim", "--ckpt-format", "torch_dist"),
        argv(2, "--load", legacy_dir, "--no-load-optim"),
        argv(1, "--load", dist_dir, "--no-load-optim", "--auto-detect-ckpt-format"),
        argv(2, "--save", async_dir, *save, "--ckpt-format", "torch_dist", "--async-save"),
        argv(2, "--load", async_dir, "--no-load-optim", "--ckpt-format", "torch_dist"),
    ]
    results = e2e.pooled(2, plan)
    return results, dist_dir


def test_torch_dist_resume_equals_the_torch_format_resume(runs):
    results, _ = runs
    saved_dist, saved_legacy, resumed_dist, resumed_legacy, resumed_tp1 = results[:5]
    assert e2e.losses(saved_dist[0]) == e2e.losses(saved_legacy[0])
    assert resumed_dist[0]["iteration"] == 6 and len(resumed_dist[0]["history"]) == 3
    assert e2e.max_abs_diff(e2e.losses(resumed_dist[0]), e2e.losses(resumed_legacy[0])) == 0.0
    # Another layout: the same weights, so the same losses up to TP's summation order.
    assert e2e.max_abs_diff(e2e.losses(resumed_tp1[0]), e2e.losses(resumed_legacy[0])) < TOL


def test_the_other_format_is_refused_by_name(runs, gpt2_corpus):
    _, dist_dir = runs
    plan = [{"argv": e2e.gpt_argv(gpt2_corpus, **dict(SHAPE, tp=2),
                                  extra=["--load", dist_dir, "--no-load-optim"])}]
    with pytest.raises(RuntimeError, match="holds a torch_dist checkpoint.*--ckpt-format "
                                           "torch_dist or --auto-detect-ckpt-format"):
        e2e.pooled(2, plan)


def test_an_async_save_resumes_like_a_synchronous_one(runs):
    results, _ = runs
    resumed_dist, resumed_async = results[2], results[6]
    assert e2e.losses(results[5][0]) == e2e.losses(results[0][0])
    assert e2e.losses(resumed_async[0]) == e2e.losses(resumed_dist[0])
