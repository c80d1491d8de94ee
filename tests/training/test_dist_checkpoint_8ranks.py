"""A torch_dist checkpoint saved at TP=2 x PP=2 x DP=2 with the distributed optimizer (8 gloo
ranks) resumes with the losses of the uninterrupted run (to 1e-5 in fp32: other layouts only
change summation orders) at another layout, loaded directly (no conversion step): at
TP=1 x PP=1 x DP=1, TP=4, PP=4 and DP=4 (worlds of 1 and 4), TP=4 x PP=2, and at TP=1 x DP=8
with the plain optimizer (the same optimizer keys).

At each of the first four the same checkpoint converted offline by tools/checkpoint/convert.py
(``--source-ckpt-format torch_dist --keep-optimizer-state``) to that layout in the torch format
resumes with the direct load's losses, and so does the checkpoint converted torch_dist ->
torch_dist (through the converter's TP1.PP1 torch checkpoint, the other direction) at
TP=1 x PP=1 x DP=1. The second resumed iteration's loss depends on Adam's moments and step
count: a lost or mis-split optimizer state misses it (tests/training/
test_dist_checkpoint_optimizer.py's control shows by how much)."""

from __future__ import annotations

import pytest

from tests.training import e2e
from tools.checkpoint import convert

SHAPE = {"seq": 16, "mbs": 1, "gbs": 8, "iters": 4}
SAVED_AT = 2
TOL = 1e-5
LAYERS = ["--num-layers", "4"]
DIST = ["--ckpt-format", "torch_dist"]
DISTOPT = ["--use-distributed-optimizer"]
TARGETS = {"tp4_pp2_dp1": (4, 2, DISTOPT), "tp1_pp1_dp8_plain_optimizer": (1, 1, [])}
"""Resumed directly in the saving world of 8: (TP, PP, optimizer flags)."""
LAYOUTS = {"tp1_pp1_dp1": (1, 1, 1), "tp4": (4, 1, 4), "pp4": (1, 4, 4), "dp4": (1, 1, 4)}
"""Resumed directly and from the offline conversion: (TP, PP, world size)."""


def _argv(corpus, tp: int, pp: int, *extra) -> dict:
    return {"argv": e2e.gpt_argv(corpus, **dict(SHAPE, tp=tp), extra=[
        *LAYERS, "--pipeline-model-parallel-size", str(pp), *extra])}


def _convert(source, target, *flags) -> None:
    assert convert.main(["--model-type", "GPT", "--load-dir", str(source), "--save-dir",
                         str(target), "--source-ckpt-format", "torch_dist",
                         "--keep-optimizer-state", *map(str, flags)]) == 0


@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("torch_dist_8ranks")
    save = root / "tp2_pp2_dp2"
    plan = [_argv(gpt2_corpus, 2, 2, *DIST, *DISTOPT),
            _argv(gpt2_corpus, 2, 2, *DIST, *DISTOPT, "--save", save, "--save-interval",
                  SAVED_AT, "--exit-interval", SAVED_AT)]
    plan += [_argv(gpt2_corpus, tp, pp, *DIST, *opt, "--load", save)
             for tp, pp, opt in TARGETS.values()]
    results = e2e.pooled(8, plan, timeout=900.0)
    out = {"straight": results[0], "first": results[1],
           **{name: results[2 + i] for i, name in enumerate(TARGETS)}}

    for name, (tp, pp, _) in LAYOUTS.items():
        _convert(save, root / f"converted_{name}", "--target-tensor-parallel-size", tp,
                 "--target-pipeline-parallel-size", pp)
    _convert(save, root / "converted_torch_dist", "--target-ckpt-format", "torch_dist")
    for world in (4, 1):
        names = [name for name, layout in LAYOUTS.items() if layout[2] == world]
        plan = []
        for name in names:
            tp, pp, _ = LAYOUTS[name]
            plan += [_argv(gpt2_corpus, tp, pp, *DIST, *DISTOPT, "--load", save),
                     _argv(gpt2_corpus, tp, pp, *DISTOPT, "--load", root / f"converted_{name}")]
        if world == 1:
            plan.append(_argv(gpt2_corpus, 1, 1, *DIST, *DISTOPT, "--load",
                              root / "converted_torch_dist"))
        results = e2e.pooled(world, plan, timeout=900.0)
        for i, name in enumerate(names):
            out[name], out[f"converted_{name}"] = results[2 * i], results[2 * i + 1]
        if world == 1:
            out["converted_torch_dist"] = results[-1]
    return out


def _last_stage_losses(result):
    return next(e2e.losses(r) for r in reversed(result) if r["history"]
                and "lm loss" in r["history"][0])


@pytest.mark.parametrize("target", [*TARGETS, *LAYOUTS])
def test_a_tp2_pp2_dp2_save_resumes_at_another_layout(runs, target):
    straight = _last_stage_losses(runs["straight"])
    assert _last_stage_losses(runs["first"]) == straight[:SAVED_AT]
    resumed = _last_stage_losses(runs[target])
    assert len(straight) == 4 and len(resumed) == 4 - SAVED_AT
    assert e2e.max_abs_diff(straight[SAVED_AT:], resumed) < TOL, (straight, resumed)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_offline_conversion_resumes_as_the_direct_load(runs, layout):
    direct = _last_stage_losses(runs[layout])
    converted = _last_stage_losses(runs[f"converted_{layout}"])
    assert len(converted) == 4 - SAVED_AT
    assert e2e.max_abs_diff(direct, converted) < TOL, (direct, converted)
    straight = _last_stage_losses(runs["straight"])
    assert e2e.max_abs_diff(straight[SAVED_AT:], converted) < TOL, (straight, converted)


def test_a_torch_dist_to_torch_dist_conversion_resumes_as_the_direct_load(runs):
    direct = _last_stage_losses(runs["tp1_pp1_dp1"])
    converted = _last_stage_losses(runs["converted_torch_dist"])
    assert e2e.max_abs_diff(direct, converted) < TOL, (direct, converted)
