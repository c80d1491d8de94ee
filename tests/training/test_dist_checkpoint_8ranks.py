"""A torch_dist checkpoint saved at TP=2 x PP=2 x DP=2 with the distributed optimizer (8 gloo
ranks) resumes at TP=1 x PP=1 x DP=8 and TP=4 x PP=2 x DP=1 with the losses of the
uninterrupted run (to 1e-5 in fp32: other layouts only change summation orders), and at
TP=1 x DP=8 with the plain optimizer too (the same optimizer keys)."""

from __future__ import annotations

import pytest

from tests.training import e2e

SHAPE = {"seq": 16, "mbs": 1, "gbs": 8, "iters": 4}
TOL = 1e-5
DIST = ["--num-layers", "4", "--ckpt-format", "torch_dist"]
DISTOPT = ["--use-distributed-optimizer"]
TARGETS = {"tp1_pp1_dp8": (1, 1, DISTOPT), "tp4_pp2_dp1": (4, 2, DISTOPT),
           "tp1_pp1_dp8_plain_optimizer": (1, 1, [])}


@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("torch_dist_8ranks")

    def argv(tp, pp, *extra):
        return {"argv": e2e.gpt_argv(gpt2_corpus, **dict(SHAPE, tp=tp), extra=[
            *DIST, "--pipeline-model-parallel-size", str(pp), *extra])}

    plan = [argv(2, 2, *DISTOPT), argv(2, 2, *DISTOPT, "--save", save, "--save-interval", "2",
                                       "--exit-interval", "2")]
    plan += [argv(tp, pp, *opt, "--load", save) for tp, pp, opt in TARGETS.values()]
    results = e2e.pooled(8, plan, timeout=900.0)
    return {"straight": results[0], "first": results[1],
            **{name: results[2 + i] for i, name in enumerate(TARGETS)}}


def _last_stage_losses(result):
    return next(e2e.losses(r) for r in reversed(result) if r["history"]
                and "lm loss" in r["history"][0])


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_tp2_pp2_dp2_save_resumes_at_another_layout(runs, target):
    straight = _last_stage_losses(runs["straight"])
    assert _last_stage_losses(runs["first"]) == straight[:2]
    resumed = _last_stage_losses(runs[target])
    assert len(straight) == 4 and len(resumed) == 2
    assert e2e.max_abs_diff(straight[2:], resumed) < TOL, (straight, resumed)
