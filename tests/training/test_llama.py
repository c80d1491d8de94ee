"""A Llama-style GPT (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases)
through ``pretrain()`` at TP=2 (with sequence parallelism) and PP=2 equals one process, and so
does TP=2 x PP=2 (with sequence parallelism) of the same model with --qk-layernorm (whose q/k
norm weights, whole on every TP rank, get their gradient summed over TP): the loss at every
iteration to 1e-5 from the one-process run's initial weights (``single_process_init``, as the
pipeline tests); the TP=2 run resumes exactly from its save at iteration 2; and TP=2's shards of
fc1 are Megatron-LM's [gate_r; up_r] and of the QKV weight whole key/value groups. With data
parallelism (DP=2) the distributed optimizer and both recompute granularities (full at PP=2,
selective at TP=2) equal one process too."""

from __future__ import annotations

import pytest
import torch

from tests.training import e2e

ITERS = 4
SHAPE = {"iters": ITERS, "seq": 16, "mbs": 1, "gbs": 4}
LLAMA = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
         "--ffn-hidden-size", "96", "--position-embedding-type", "rope", "--rotary-percent",
         "0.5", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
QK_NORM = ["--qk-layernorm"]
LOSS_TOL = 1e-5
FC1 = "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"
Q_NORM = "language_model.encoder.layers.1.self_attention.q_layernorm.weight"


def _run(corpus, tp: int = 1, extra=(), init: bool = True) -> dict:
    return {"argv": e2e.gpt_argv(corpus, tp=tp, **SHAPE, extra=[*LLAMA, *extra]),
            "params": True, "single_process_init": init}


@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("llama_checkpoint")
    single, single_qk = (r[0] for r in e2e.pooled(1, [
        _run(gpt2_corpus, init=False), _run(gpt2_corpus, extra=QK_NORM, init=False)]))
    tp2, pp2, resumed = e2e.pooled(2, [
        _run(gpt2_corpus, tp=2, extra=["--sequence-parallel", "--save", save,
                                       "--save-interval", "2"]),
        _run(gpt2_corpus, extra=["--pipeline-model-parallel-size", "2"]),
        _run(gpt2_corpus, tp=2, extra=["--sequence-parallel", "--load", save, "--ckpt-step",
                                       "2"], init=False)])
    tp2pp2_qk, dp2pp2, dp2tp2 = e2e.pooled(4, [
        _run(gpt2_corpus, tp=2, extra=[*QK_NORM, "--sequence-parallel",
                                       "--pipeline-model-parallel-size", "2"]),
        _run(gpt2_corpus, extra=["--pipeline-model-parallel-size", "2",
                                 "--use-distributed-optimizer", "--recompute-granularity",
                                 "full", "--recompute-method", "uniform",
                                 "--recompute-num-layers", "1"]),
        _run(gpt2_corpus, tp=2, extra=["--use-distributed-optimizer",
                                       "--recompute-activations"])])
    return {"single": single, "single_qk": single_qk, "tp2_sp": tp2, "pp2": pp2,
            "tp2pp2_qk": tp2pp2_qk, "dp2pp2_distopt_full": dp2pp2,
            "dp2tp2_distopt_selective": dp2tp2, "resumed": resumed}


def test_tp2_resumes_exactly(runs):
    """Iterations 3 and 4 after loading the iteration-2 save equal the straight run's."""
    for straight, resumed in zip(runs["tp2_sp"], runs["resumed"]):
        assert resumed["iteration"] == ITERS and len(resumed["history"]) == 2
        assert e2e.max_abs_diff(e2e.losses(straight)[2:], e2e.losses(resumed)) <= 1e-6


@pytest.mark.parametrize("layout,single", [("tp2_sp", "single"), ("pp2", "single"),
                                           ("tp2pp2_qk", "single_qk"),
                                           ("dp2pp2_distopt_full", "single"),
                                           ("dp2tp2_distopt_selective", "single")])
def test_llama_equals_one_process(runs, layout, single):
    ref = e2e.losses(runs[single])
    # Four iterations at warmup learning rates: each batch's loss, not a trend, is compared.
    assert len(ref) == ITERS and not any(h["skipped"] for h in runs[single]["history"])
    got = e2e.losses(runs[layout][-1])  # the last rank is on the last stage in every layout
    assert e2e.max_abs_diff(ref, got) <= LOSS_TOL, (layout, ref, got)


def test_qk_norm_weights_train_alike_on_every_rank(runs):
    """The q/k norm weights moved (their gradient is not lost) and ended equal to one
    process's on both TP ranks of the last stage (a missed TP sum of their partial gradients
    would leave the two ranks' copies apart)."""
    ref = runs["single_qk"]["params"][Q_NORM]
    assert float((ref - 1).abs().max()) > 1e-4  # trained away from the all-ones init
    assert e2e.losses(runs["single_qk"]) != e2e.losses(runs["single"])  # the norms act
    for rank in (2, 3):  # the last stage's TP ranks
        got = runs["tp2pp2_qk"][rank]["params"][Q_NORM]
        assert float((got - ref).abs().max()) <= 1e-5, rank


def test_tp2_shards_are_megatrons_layout(runs):
    """The TP=2 shards concatenated rank-major are [gate_0; up_0; gate_1; up_1] (Megatron's
    ColumnParallelLinear of 2 ffn rows); one process holds [gate; up]."""
    full = runs["single"]["params"][FC1]  # [2f, h]
    gathered = runs["tp2_sp"][0]["params"][FC1]  # rank-major concatenation of the shards
    gate, up = full.chunk(2)
    megatron = torch.cat([gate[:48], up[:48], gate[48:], up[48:]])
    assert float((gathered - megatron).abs().max()) <= 1e-4
