"""Mixture of experts in half precision: EP=2 (with DP=2 for the dense layers) trains as one
process with --bf16 and with --fp16 (dynamic loss scaling; the aux and z losses' gradients
scaled by the loss scale as the language-model loss's), from the same start weights.

Half-precision tolerances of the other layouts' tests (tests/training/test_parallel_equivalence
.py): the loss of every iteration to 1e-3, the final parameters to 4e-3; the skipped steps
(fp16) must be the same iterations.
"""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_moe_expert_parallel_training import FLAGS

LOSS_TOL = 1e-3
PARAM_TOL = 4e-3
_PRECISIONS = {"bf16": ["--bf16"],
               "fp16": ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"]}


def _runs(ep: int) -> list[dict]:
    return [{"argv": [*FLAGS, *flags, "--expert-model-parallel-size", str(ep)],
             "params": True, "single_process_init": ep > 1}
            for flags in _PRECISIONS.values()]


@pytest.fixture(scope="module")
def single():
    return dict(zip(_PRECISIONS, (r[0] for r in e2e.pooled(1, _runs(1)))))


@pytest.fixture(scope="module")
def ep2():
    return dict(zip(_PRECISIONS, e2e.pooled(2, _runs(2))))


@pytest.mark.parametrize("precision", list(_PRECISIONS))
def test_ep2_half_precision_equals_one_process(single, ep2, precision):
    ref = single[precision]
    ref_losses = e2e.losses(ref)
    ref_skipped = [h["skipped"] for h in ref["history"]]
    assert ref_skipped.count(False) >= 2, f"one process took fewer than 2 steps: {ref_skipped}"
    for rank, result in enumerate(ep2[precision]):
        assert [h["skipped"] for h in result["history"]] == ref_skipped, rank
        diff = e2e.max_abs_diff(ref_losses, e2e.losses(result))
        assert diff <= LOSS_TOL, (f"{precision} EP=2 rank {rank}: loss differs by {diff:.3g}\n"
                                  f"  one process {ref_losses}\n  EP=2 {e2e.losses(result)}")
        diff = e2e.max_param_diff(ref["params"], result["params"])
        assert diff <= PARAM_TOL, f"{precision} EP=2 rank {rank}: parameters differ by {diff:.3g}"
