"""``--ckpt-format torch_dist`` through pretrain() with an MoE model (router, 4 experts, a gated
shared expert, the aux-loss-free expert bias) and the plain (non-distributed) optimizer's state:
a run saved at DP=2 resumes with the losses of the uninterrupted run at the same layout, at
TP=2 with sequence parallelism, and with the distributed optimizer (the same keys); without the
optimizer state the losses differ. A bf16 run (the optimizer's fp32 main copies saved as
``fp32_param``) resumes exactly."""

from __future__ import annotations

import pytest
import torch

from tests.training import e2e
from tests.training.test_moe import BIAS, MOE

SHAPE = {"seq": 16, "mbs": 1, "gbs": 4, "iters": 6}
TOL = 1e-5
DIST = ["--ckpt-format", "torch_dist"]


@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("torch_dist_moe")
    save_bf16 = tmp_path_factory.mktemp("torch_dist_bf16")

    def argv(tp, *extra, model=(*MOE, *BIAS)):
        return {"argv": e2e.gpt_argv(gpt2_corpus, **dict(SHAPE, tp=tp),
                                     extra=[*model, *extra])}

    first = ("--save-interval", "3", "--exit-interval", "3", *DIST)
    plan = [argv(1), argv(1, "--save", save, *first),
            argv(1, "--load", save, *DIST),
            argv(2, "--sequence-parallel", "--load", save, *DIST),
            argv(1, "--use-distributed-optimizer", "--load", save, *DIST),
            argv(1, "--load", save, "--no-load-optim", *DIST),
            argv(1, "--bf16", model=()), argv(1, "--bf16", "--save", save_bf16, *first, model=()),
            argv(1, "--bf16", "--load", save_bf16, *DIST, model=())]
    results = e2e.pooled(2, plan, timeout=600.0)
    names = ["straight", "first", "same", "tp2_sp", "distopt", "no_optim", "bf16", "bf16_first",
             "bf16_resumed"]
    return dict(zip(names, results)), save, save_bf16


def test_the_checkpoint_holds_the_moe_and_optimizer_keys(runs):
    from megatron.checkpointing.dist import storage
    _, save, _ = runs
    keys = storage.read_metadata(save / "iter_0000003").state_dict_metadata
    for key in ("decoder.layers.mlp.router.weight", "decoder.layers.mlp.router.expert_bias",
                "decoder.layers.mlp.experts.experts.linear_fc1.weight",
                "decoder.layers.mlp.shared_experts.gate_weight",
                "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight",
                "optimizer.state.exp_avg_sq.decoder.layers.mlp.router.weight"):
        assert key in keys, key
    assert tuple(keys["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == \
        (2, 4, 64, 64)
    # fp32 parameters are their own main copies: Megatron-Core stores no fp32_param for them.
    assert not any(k.startswith("optimizer.state.fp32_param.") for k in keys)


@pytest.mark.parametrize("target,tol", [("same", 0.0), ("tp2_sp", TOL), ("distopt", TOL)])
def test_an_moe_resume_equals_the_uninterrupted_run(runs, target, tol):
    results, _, _ = runs
    straight = e2e.losses(results["straight"][0])
    resumed = e2e.losses(results[target][0])
    assert len(straight) == 6 and len(resumed) == 3
    assert e2e.losses(results["first"][0]) == straight[:3]
    assert e2e.max_abs_diff(straight[3:], resumed) <= tol, (straight, resumed)


def test_the_optimizer_state_matters(runs):
    results, _, _ = runs
    straight = e2e.losses(results["straight"][0])
    assert e2e.max_abs_diff(straight[3:], e2e.losses(results["no_optim"][0])) > 1e-4


def test_a_bf16_resume_is_exact(runs):
    from megatron.checkpointing.dist import storage
    results, _, save_bf16 = runs
    keys = storage.read_metadata(save_bf16 / "iter_0000003").state_dict_metadata
    assert "optimizer.state.fp32_param.decoder.layers.mlp.linear_fc1.weight" in keys
    straight = e2e.losses(results["bf16"][0])
    assert e2e.losses(results["bf16_resumed"][0]) == straight[3:]


def test_the_converter_round_trips_an_moe_checkpoint(runs, tmp_path):
    """convert.py's torch_dist <-> torch step names every MoE tensor (experts split per layer
    and expert) and writes them back as they were."""
    from megatron.checkpointing.dist import storage
    from tools.checkpoint.dist_format import legacy_to_torch_dist, torch_dist_to_legacy
    _, save, _ = runs
    legacy = torch_dist_to_legacy(save, tmp_path / "legacy")
    back = legacy_to_torch_dist(legacy, tmp_path / "dist")
    before = storage.read_plain_tensors(save / "iter_0000003")
    after = storage.read_plain_tensors(back)
    model_keys = {k for k in before if not k.startswith("optimizer.")}
    assert model_keys == set(after)
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in model_keys
    for key in model_keys:
        assert torch.equal(before[key], after[key]), key
