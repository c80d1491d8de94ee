"""Context parallelism in half precision: CP=2 trains as CP=1 with --fp16 (dynamic loss
scaling, with overflowing steps skipped on both) and with --bf16.

The CP ranks' attention runs its blocks in fp32 from half-precision inputs and rounds the
merged output once, the CP=1 attention rounds its own way: the runs agree to the half-precision
tolerances of the other layouts' tests (tests/training/test_parallel_equivalence.py), the loss
of every iteration to 1e-3 and the final parameters to 4e-3, not to fp32's 1e-5. Llama-style
model (RoPE, GQA), the p2p ring; the skipped steps must be the same iterations.
"""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_llama import LLAMA

# Half-precision GEMMs are slow on CPUs without AVX512-BF16/AMX: short runs.
SHAPE = {"iters": 6, "seq": 16, "mbs": 1, "gbs": 2}
LOSS_TOL = 1e-3
# Final parameters: the bf16 tolerance of test_parallel_equivalence. Adam turns the rounding
# noise of near-zero gradients (output-layer rows of tokens not in the batch) into steps of
# about the learning rate (1e-3), in either direction: measured 1.5e-3 (fp16), 3.4e-3 (bf16).
PARAM_TOL = 4e-3
# fp16: the loss of the last CP rank times inf at iteration 3 (its gradients alone overflow
# before the reduction over DP x CP): every rank skips that step and halves the loss scale
# (hysteresis 1), as the CP=1 run does with the same inf.
FP16 = ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"]
INF_AT = 3
_PRECISIONS = {"fp16": FP16, "bf16": ["--bf16"]}


def _runs(corpus, cp: int) -> list[dict]:
    return [{"argv": e2e.gpt_argv(corpus, **SHAPE, extra=[
        *LLAMA, *flags, "--context-parallel-size", str(cp)]), "params": True,
        "inf_at": ([INF_AT], cp - 1, 2) if name == "fp16" else None}
        for name, flags in _PRECISIONS.items()]


@pytest.fixture(scope="module")
def cp1(gpt2_corpus):
    return dict(zip(_PRECISIONS, (r[0] for r in e2e.pooled(1, _runs(gpt2_corpus, 1)))))


@pytest.fixture(scope="module")
def cp2(gpt2_corpus):
    return dict(zip(_PRECISIONS, e2e.pooled(2, _runs(gpt2_corpus, 2))))


@pytest.mark.parametrize("precision", list(_PRECISIONS))
def test_cp2_half_precision_equals_cp1(cp1, cp2, precision):
    ref = cp1[precision]
    ref_losses = e2e.losses(ref)
    ref_skipped = [h["skipped"] for h in ref["history"]]
    assert len(ref_losses) == SHAPE["iters"]
    assert ref_skipped.count(False) >= 3, f"CP=1 took fewer than 3 steps: {ref_skipped}"
    if precision == "fp16":
        assert [i for i, x in enumerate(ref_skipped, 1) if x] == [INF_AT], ref_skipped
    for rank, result in enumerate(cp2[precision]):
        skipped = [h["skipped"] for h in result["history"]]
        assert skipped == ref_skipped, (f"{precision} rank {rank}: skipped {skipped}, "
                                        f"CP=1 {ref_skipped}")
        diff = e2e.max_abs_diff(ref_losses, e2e.losses(result))
        assert diff <= LOSS_TOL, (f"{precision} CP=2 rank {rank}: loss differs by {diff:.3g}\n"
                                  f"  CP=1 {ref_losses}\n  CP=2 {e2e.losses(result)}")
        diff = e2e.max_param_diff(ref["params"], result["params"])
        assert diff <= PARAM_TOL, f"{precision} CP=2 rank {rank}: parameters differ by {diff:.3g}"
