"""The distributed optimizer's state in torch_dist: a run saved at TP=2 x PP=2 (4 gloo ranks)
resumes at TP=1 x DP=4, TP=4, PP=4 and TP=1 x PP=2 x DP=2 with the losses of the uninterrupted
run (to 1e-5 in fp32: other layouts only change summation orders)."""

from __future__ import annotations

import pytest

from tests.training import e2e

SHAPE = {"seq": 16, "mbs": 1, "gbs": 4, "iters": 6}
TOL = 1e-5
DISTOPT = ["--use-distributed-optimizer", "--num-layers", "4"]
TARGETS = {"tp1_dp4": (1, 1), "tp4": (4, 1), "pp4": (1, 4), "tp1_pp2_dp2": (1, 2)}


@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("torch_dist_distopt")

    def argv(tp, pp, *extra):
        return {"argv": e2e.gpt_argv(gpt2_corpus, **dict(SHAPE, tp=tp), extra=[
            *DISTOPT, "--pipeline-model-parallel-size", str(pp), *extra])}

    plan = [argv(2, 2),
            argv(2, 2, "--save", save, "--save-interval", "3", "--exit-interval", "3",
                 "--ckpt-format", "torch_dist")]
    plan += [argv(tp, pp, "--load", save, "--ckpt-format", "torch_dist")
             for tp, pp in TARGETS.values()]
    # Control: without the optimizer state the losses after the resume differ.
    plan.append(argv(1, 1, "--load", save, "--ckpt-format", "torch_dist", "--no-load-optim"))
    results = e2e.pooled(4, plan, timeout=600.0)
    return {"straight": results[0], "first": results[1], "no_optim": results[-1],
            **{name: results[2 + i] for i, name in enumerate(TARGETS)}}


def _last_stage_losses(result):
    return next(e2e.losses(r) for r in reversed(result) if r["history"]
                and "lm loss" in r["history"][0])


@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_at_another_layout_gives_the_straight_losses(runs, target):
    straight = _last_stage_losses(runs["straight"])
    resumed = _last_stage_losses(runs[target])
    assert len(straight) == 6 and len(resumed) == 3
    assert e2e.max_abs_diff(straight[3:], resumed) < TOL, (straight, resumed)


def test_the_optimizer_state_matters(runs):
    straight = _last_stage_losses(runs["straight"])
    assert e2e.max_abs_diff(straight[3:], _last_stage_losses(runs["no_optim"])) > 1e-4
