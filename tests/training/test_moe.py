"""A Llama-style MoE GPT (4 experts, top-2, a gated shared expert, aux and z losses) through
``pretrain()``: TP=2 with sequence parallelism and DP=2 with the distributed optimizer equal one
process (the loss at every iteration to 1e-5 and the final parameters, from the one-process
run's initial weights; the DP=2 run with sigmoid scores, aux-loss-free balancing and
--moe-grouped-gemm, whose expert-bias counts are summed over DP); the auxiliary losses reach the
log dict (per layer with --moe-per-layer-logging); the TP=2 run resumes exactly from its
save."""

from __future__ import annotations

import pytest

from tests.training import e2e

ITERS = 4
SHAPE = {"iters": ITERS, "seq": 16, "mbs": 1, "gbs": 4}
MOE = ["--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64",
       "--position-embedding-type", "rope", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-ffn-hidden-size",
       "32", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff",
       "1e-3", "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
       "--moe-per-layer-logging"]
BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.01", "--moe-grouped-gemm"]
LOSS_TOL = 1e-5


def _run(corpus, tp: int = 1, extra=(), init: bool = True) -> dict:
    return {"argv": e2e.gpt_argv(corpus, tp=tp, **SHAPE, extra=[*MOE, *extra]),
            "params": True, "single_process_init": init}


@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("moe_checkpoint")
    single, single_bias = (r[0] for r in e2e.pooled(1, [
        _run(gpt2_corpus, init=False), _run(gpt2_corpus, extra=BIAS, init=False)]))
    tp2, dp2_bias, resumed = e2e.pooled(2, [
        _run(gpt2_corpus, tp=2, extra=["--sequence-parallel", "--save", save,
                                       "--save-interval", "2"]),
        _run(gpt2_corpus, extra=[*BIAS, "--use-distributed-optimizer"]),
        _run(gpt2_corpus, tp=2, extra=["--sequence-parallel", "--load", save, "--ckpt-step",
                                       "2"], init=False)])
    return {"single": single, "single_bias": single_bias, "tp2_sp": tp2,
            "dp2_bias": dp2_bias, "resumed": resumed}


@pytest.mark.parametrize("layout,single", [("tp2_sp", "single"), ("dp2_bias", "single_bias")])
def test_moe_equals_one_process(runs, layout, single):
    ref = e2e.losses(runs[single])
    assert len(ref) == ITERS and not any(h["skipped"] for h in runs[single]["history"])
    got = e2e.losses(runs[layout][-1])
    assert e2e.max_abs_diff(ref, got) <= LOSS_TOL, (layout, ref, got)
    # TP=2's gathered SwiGLU fc1 is Megatron's rank-major [gate_0; up_0; gate_1; up_1]: the
    # other parameters compare directly.
    keep = [n for n in runs[single]["params"] if not (layout.startswith("tp") and
                                                       "dense_h_to_4h" in n)]
    for rank in runs[layout]:
        got = {n: rank["params"][n] for n in keep}
        want = {n: runs[single]["params"][n] for n in keep}
        assert e2e.max_param_diff(want, got) <= 1e-5, layout


def test_aux_losses_are_logged_per_layer(runs):
    step = runs["single"]["history"][0]
    for name in ("load_balancing_loss", "z_loss"):
        assert step[name] == pytest.approx((step[f"moe/{name}_layer_0"] +
                                            step[f"moe/{name}_layer_1"]) / 2)
        assert step[f"moe/{name}_layer_0"] > 0
    # A balanced top-2 router of 4 experts gives a load-balancing loss near 1 (over coeff).
    assert 0.9 < step["load_balancing_loss"] < 1.5
    got = runs["tp2_sp"][-1]["history"][0]
    for name in ("load_balancing_loss", "moe/z_loss_layer_1"):
        assert got[name] == pytest.approx(step[name], abs=1e-5)


def test_expert_bias_changes_the_run(runs):
    assert e2e.losses(runs["single_bias"]) != e2e.losses(runs["single"])


def test_tp2_resumes_exactly(runs):
    for straight, resumed in zip(runs["tp2_sp"], runs["resumed"]):
        assert resumed["iteration"] == ITERS and len(resumed["history"]) == 2
        assert e2e.max_abs_diff(e2e.losses(straight)[2:], e2e.losses(resumed)) <= 1e-6
