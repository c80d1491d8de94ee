"""``--compile-layers`` (each transformer layer through ``torch.compile``, inductor's CPU backend
here) trains as the eager layers do, and resumes exactly with dropout on.

One pooled one-rank world, fp32, a 2-layer hidden-64 GPT, sequence 32:

* dropout 0: 3 iterations eager and compiled: the loss of every iteration and the parameters
  after the last agree to 1e-5 (inductor fuses, so sums run in another order; the eager side's
  C++ layer norm and bias-GeLU are not ATen's either). The compiled run must really compile the
  layers in one graph each: dynamo's counters show a captured graph and no graph break.
* dropout 0.1, compiled: 4 iterations straight equal 2 + save + resume 2 (inductor draws its
  dropout seeds from the default generator, which the checkpoint restores); without the RNG
  state (``--no-load-rng``) the resumed losses differ, so dropout is really drawn.

Cost: two inductor compilations of a layer (with and without dropout: about 20 s each on two
busy cores without inductor's on-disk cache, a few seconds with it) and seven short runs.
"""

from __future__ import annotations

import pytest

from tests.training import e2e

EQUAL_TOL = 1e-5
RESUME_TOL = 1e-6
SHAPE = {"seq": 32, "mbs": 2, "gbs": 4}


def run_counting_compiles(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """Each run through e2e's runner; its result gets dynamo's counters of that run (graphs
    captured, graph breaks by reason). A run marked ``fresh`` starts with dynamo's caches
    emptied, so that its layers must be compiled (captured) again to run compiled at all."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    out = []
    for run in runs:
        if run.get("fresh"):
            torch._dynamo.reset()
        counters.clear()
        result = e2e.run_pretrains(rank, world_size, [run])[0]
        result["graphs"] = counters["stats"]["unique_graphs"]
        result["graph_breaks"] = dict(counters["graph_break"])
        out.append(result)
    return out


@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    from tests.multiprocess import run_distributed

    save = tmp_path_factory.mktemp("compiled_resume")

    def argv(iters, dropout, *extra):
        return e2e.gpt_argv(gpt2_corpus, iters=iters, dropout=dropout, **SHAPE,
                            extra=["--compile-layers", *extra])

    plan = {
        "eager": {"argv": argv(3, 0.0)[:-1], "params": True},  # the same flags, less the flag
        "compiled": {"argv": argv(3, 0.0), "params": True, "fresh": True},
        "straight": {"argv": argv(4, 0.1)},
        "first": {"argv": argv(4, 0.1, "--save", save, "--save-interval", "1000",
                               "--exit-interval", "2")},
        "second": {"argv": argv(4, 0.1, "--load", save)},
        "without_rng": {"argv": argv(4, 0.1, "--load", save, "--no-load-rng")},
    }
    assert plan["eager"]["argv"][-1] != "--compile-layers" and "--compile-layers" not in \
        plan["eager"]["argv"]
    results = run_distributed(1, run_counting_compiles, list(plan.values()), timeout=600)[0]
    return dict(zip(plan, results))


def test_compiled_layers_train_as_the_eager_ones(runs):
    eager, compiled = runs["eager"], runs["compiled"]
    assert eager["graphs"] == 0
    assert compiled["graphs"] >= 1, "--compile-layers compiled nothing"  # a fresh capture
    assert compiled["graph_breaks"] == {}, f"graph breaks at TP=1: {compiled['graph_breaks']}"
    assert len(e2e.losses(compiled)) == 3
    loss_diff = e2e.max_abs_diff(e2e.losses(eager), e2e.losses(compiled))
    assert loss_diff <= EQUAL_TOL, (e2e.losses(eager), e2e.losses(compiled))
    param_diff = e2e.max_param_diff(eager["params"], compiled["params"])
    assert param_diff <= EQUAL_TOL, param_diff


def test_compiled_layers_resume_exactly_with_dropout(runs):
    straight = e2e.losses(runs["straight"])
    halves = e2e.losses(runs["first"]) + e2e.losses(runs["second"])
    assert len(straight) == 4 and runs["first"]["iteration"] == 2
    assert e2e.max_abs_diff(straight, halves) <= RESUME_TOL, (straight, halves)
    without_rng = e2e.losses(runs["without_rng"])
    assert e2e.max_abs_diff(straight[2:], without_rng) > 1e-4, "dropout drew nothing"
