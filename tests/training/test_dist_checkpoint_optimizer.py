"""The distributed optimizer's state in torch_dist: a run saved at TP=2 x PP=2 (4 gloo ranks)
resumes at TP=1 x DP=4, TP=4, PP=4 and TP=1 x PP=2 x DP=2 with the losses of the uninterrupted
run (to 1e-5 in fp32: other layouts only change summation orders).

Tied embeddings with virtual stages: a run saved at PP=2 x DP=2 with two virtual stages per
rank, whose last stage holds its own copy of the word embedding (the output layer's weight,
with its own Adam state), resumes at TP=1 x DP=4 (no copy) and TP=2 x PP=2 (a copy again, its
state read from the embedding's) with the losses of the saving run, which trains on past the
save."""

from __future__ import annotations

import pytest

from tests.training import e2e

SHAPE = {"seq": 16, "mbs": 1, "gbs": 4, "iters": 6}
TOL = 1e-5
DISTOPT = ["--use-distributed-optimizer", "--num-layers", "4"]
TARGETS = {"tp1_dp4": (1, 1), "tp4": (4, 1), "pp4": (1, 4), "tp1_pp2_dp2": (1, 2)}
VPP = ["--num-layers-per-virtual-pipeline-stage", "1"]
VPP_TARGETS = {"vpp_to_tp1_dp4": (1, 1), "vpp_to_tp2_pp2": (2, 2)}


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
    vpp_save = tmp_path_factory.mktemp("torch_dist_vpp")
    plan.append(argv(1, 2, *VPP, "--save", vpp_save, "--save-interval", "3",
                     "--ckpt-format", "torch_dist"))
    # The saving run saves again at its end: resume from the first save.
    plan += [argv(tp, pp, "--load", vpp_save, "--ckpt-step", "3", "--ckpt-format", "torch_dist")
             for tp, pp in VPP_TARGETS.values()]
    results = e2e.pooled(4, plan, timeout=600.0)
    first_vpp = 3 + len(TARGETS)
    return {"straight": results[0], "first": results[1], "no_optim": results[2 + len(TARGETS)],
            **{name: results[2 + i] for i, name in enumerate(TARGETS)},
            "vpp": results[first_vpp],
            **{name: results[first_vpp + 1 + i] for i, name in enumerate(VPP_TARGETS)}}


def _last_stage_losses(result):
    return next(e2e.losses(r) for r in reversed(result) if r["history"]
                and "lm loss" in r["history"][0])


def _assert_resumes_straight(straight_run, resumed_run) -> None:
    straight, resumed = _last_stage_losses(straight_run), _last_stage_losses(resumed_run)
    assert len(straight) == 6 and len(resumed) == 3
    assert e2e.max_abs_diff(straight[3:], resumed) < TOL, (straight, resumed)


@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_at_another_layout_gives_the_straight_losses(runs, target):
    _assert_resumes_straight(runs["straight"], runs[target])


def test_the_optimizer_state_matters(runs):
    straight = _last_stage_losses(runs["straight"])
    assert e2e.max_abs_diff(straight[3:], _last_stage_losses(runs["no_optim"])) > 1e-4


@pytest.mark.parametrize("target", list(VPP_TARGETS))
def test_tied_embeddings_with_virtual_stages_resume_at_another_layout(runs, target):
    _assert_resumes_straight(runs["vpp"], runs[target])
