"""``--compile-layers`` with mixture-of-experts layers: the expert-parallel test's 4-expert,
top-2 Llama-style MoE GPT (shared expert, aux and z losses, gradient clipping) trains the same
compiled as eager, fp32, with each token dispatcher, at one process and at EP=2 (each compiled
run against the one-process eager run from the same start weights: the loss every iteration
and every final parameter to 1e-5, as the dense compile-layers test).

Each layer is compiled with one graph break, around the dispatch-experts-combine region
(``MoELayer._routed_experts``: data-dependent token counts); the router, with its balancing and
z losses and their backward scale, is inside the layer's graph. The layers share their graphs
(the logged losses' layer row is a tensor, not a specialized integer).

Cost: one inductor compilation of the layer per world (one and two ranks) and six short runs.
"""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_compile_layers import run_counting_compiles
from tests.training.test_moe_expert_parallel_training import FLAGS, ITERS

TOL = 1e-5
COMPILE = ["--compile-layers"]
A2A = ["--moe-token-dispatcher-type", "alltoall"]
EP2 = ["--expert-model-parallel-size", "2"]


def _run(extra=(), init: bool = True, fresh: bool = False) -> dict:
    return {"argv": [*FLAGS, *extra], "params": True, "single_process_init": init,
            "fresh": fresh}


@pytest.fixture(scope="module")
def runs():
    from tests.multiprocess import run_distributed

    eager, allgather, alltoall = run_distributed(1, run_counting_compiles, [
        _run(init=False), _run(COMPILE, init=False, fresh=True),
        _run([*COMPILE, *A2A], init=False)], timeout=600)[0]
    per_rank = run_distributed(2, run_counting_compiles, [
        _run([*COMPILE, *EP2], fresh=True), _run([*COMPILE, *EP2, *A2A])], timeout=600)
    ep2_allgather, ep2_alltoall = ([per_rank[r][i] for r in range(2)] for i in range(2))
    return {"eager": eager, "allgather": [allgather], "alltoall": [alltoall],
            "ep2_allgather": ep2_allgather, "ep2_alltoall": ep2_alltoall}


LAYOUTS = ["allgather", "alltoall", "ep2_allgather", "ep2_alltoall"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_moe_trains_as_eager_one_process(runs, layout):
    ref = runs["eager"]
    assert ref["graphs"] == 0 and len(e2e.losses(ref)) == ITERS
    for rank in runs[layout]:
        assert e2e.max_abs_diff(e2e.losses(ref), e2e.losses(rank)) <= TOL, \
            (layout, e2e.losses(ref), e2e.losses(rank))
        assert set(rank["params"]) == set(ref["params"])
        assert e2e.max_param_diff(ref["params"], rank["params"]) <= TOL, layout
        for name in ("load_balancing_loss", "z_loss"):
            want = [h[name] for h in ref["history"]]
            assert e2e.max_abs_diff(want, [h[name] for h in rank["history"]]) <= TOL, name


@pytest.mark.parametrize("layout", ["allgather", "ep2_allgather"])
def test_moe_layers_compile_with_one_break_each(runs, layout):
    for rank in runs[layout]:  # the fresh captures
        assert rank["graphs"] >= 1, "--compile-layers compiled nothing"
        breaks = rank["graph_breaks"]
        assert breaks and all("_routed_experts" in reason for reason in breaks), breaks
        # Two graphs per layer code (before and after the experts), plus the first layer's
        # recompile for its input's strides (as the dense layers): not one per layer number.
        assert rank["graphs"] <= 6, rank["graphs"]
