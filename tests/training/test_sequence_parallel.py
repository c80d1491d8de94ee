"""``--sequence-parallel`` through ``pretrain()``.

A tiny GPT (4 layers, hidden 64, GPT-2 vocabulary padded to 50304, seq 32, global batch 4 of
micro-batches of 1, fp32, dropout 0) trains for 4 iterations. With sequence parallelism it must
give the loss of every iteration and the final parameters of the same run without it: at TP=2
(against that very run), and at TP=2 x PP=2 x VPP=2 and TP=2 x DP=2 with the distributed
optimizer and selective recomputation (against the one-process run, which
the TP, PP and DP runs equal: test_parallel_equivalence.py, test_pipeline_parallel.py; TP=4 with
full recomputation is tests/core/models/test_sequence_parallel.py's, at the model level). The
replicated parameters (LayerNorms, row-parallel biases, whose gradients each TP rank only has a
part of) end bitwise equal on every TP rank. With dropout on, an SP run reproduces itself
exactly. The SP run's checkpoint of iteration 2 resumes without SP as the SP run went on.
"""

from __future__ import annotations

import pytest

from tests.training import e2e

ITERS = 4
SHAPE = {"iters": ITERS, "seq": 32, "mbs": 1, "gbs": 4}
LAYERS = ["--num-layers", "4"]
SP = ["--sequence-parallel"]
LOSS_TOL = 1e-5
PARAM_TOL = 2e-5
RESUME_TOL = 1e-6
PP2_VPP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def _run(corpus, tp: int, extra=(), init: bool = False, **shape) -> dict:
    argv = e2e.gpt_argv(corpus, tp=tp, **{**SHAPE, **shape}, extra=[*LAYERS, *extra])
    return {"argv": argv, "params": True, "single_process_init": init}


@pytest.fixture(scope="module")
def single(gpt2_corpus):
    return e2e.pooled(1, [_run(gpt2_corpus, 1)])[0][0]


@pytest.fixture(scope="module")
def two_ranks(gpt2_corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("sp_checkpoint")
    runs = {"tp2": _run(gpt2_corpus, 2),
            "tp2_sp": _run(gpt2_corpus, 2, [*SP, "--save", save, "--save-interval", "2"]),
            "resumed_without_sp": _run(gpt2_corpus, 2, ["--load", save, "--ckpt-step", "2"]),
            "dropout_a": _run(gpt2_corpus, 2, SP, dropout=0.1, iters=3),
            "dropout_b": _run(gpt2_corpus, 2, SP, dropout=0.1, iters=3)}
    return dict(zip(runs, e2e.pooled(2, list(runs.values()))))


_FOUR = {"tp2pp2vpp2_sp": (2, [*SP, *PP2_VPP2]),
         "tp2dp2_sp_distopt_selective": (2, [*SP, "--use-distributed-optimizer",
                                             "--recompute-activations"])}


@pytest.fixture(scope="module")
def four_ranks(gpt2_corpus):
    runs = [_run(gpt2_corpus, tp, extra, init="--pipeline-model-parallel-size" in extra)
            for tp, extra in _FOUR.values()]
    return dict(zip(_FOUR, e2e.pooled(4, runs)))


def _merged_params(run_ranks: list[dict]) -> dict:
    """Every rank's parameters in one dict (pipeline stages hold different ones); a parameter
    held by several ranks (TP/DP replicas) must be bitwise the same on all of them."""
    merged: dict = {}
    for rank, result in enumerate(run_ranks):
        for name, value in result["params"].items():
            if name == "word_embeddings.weight":
                continue  # the last stage's tied copy; the embedding itself is compared
            if name in merged:
                assert bool((merged[name] == value).all()), f"{name} differs on rank {rank}"
            else:
                merged[name] = value
    return merged


def _assert_same_training(reference: dict, run_ranks: list[dict], what: str) -> None:
    ref = e2e.losses(reference)
    assert len(ref) == ITERS
    with_loss = [r for r in run_ranks if r["history"] and "lm loss" in r["history"][0]]
    assert with_loss, what
    for result in with_loss:
        diff = e2e.max_abs_diff(ref, e2e.losses(result))
        assert diff <= LOSS_TOL, f"{what}: loss differs by {diff:.3g}\n  {ref}\n  " \
                                 f"{e2e.losses(result)}"
    diff = e2e.max_param_diff(reference["params"], _merged_params(run_ranks))
    assert diff <= PARAM_TOL, f"{what}: final parameters differ by {diff:.3g}"


def test_tp2_with_and_without_sequence_parallel(two_ranks):
    _assert_same_training(two_ranks["tp2"][0], two_ranks["tp2_sp"], "TP=2 with SP")


@pytest.mark.parametrize("layout", list(_FOUR))
def test_four_ranks_equal_single_process(single, four_ranks, layout):
    _assert_same_training(single, four_ranks[layout], layout)


def test_dropout_runs_reproduce_themselves(two_ranks):
    a, b = two_ranks["dropout_a"], two_ranks["dropout_b"]
    for rank in range(2):
        assert e2e.losses(a[rank]) == e2e.losses(b[rank])
        assert all(bool((a[rank]["params"][n] == b[rank]["params"][n]).all())
                   for n in a[rank]["params"])
    _merged_params(a)  # LayerNorms equal on both TP ranks with dropout on too
    assert e2e.losses(a[0]) != e2e.losses(two_ranks["tp2_sp"][0])[:3], "dropout was off"


def test_checkpoint_saved_with_sp_resumes_without_it(two_ranks):
    """The SP run's iteration-2 checkpoint, loaded without --sequence-parallel: iterations 3
    and 4 as the SP run had them, and its final parameters."""
    straight, resumed = two_ranks["tp2_sp"], two_ranks["resumed_without_sp"]
    for rank in range(2):
        assert resumed[rank]["iteration"] == ITERS and len(resumed[rank]["history"]) == 2
        diff = e2e.max_abs_diff(e2e.losses(straight[rank])[2:], e2e.losses(resumed[rank]))
        assert diff <= RESUME_TOL, f"rank {rank}: resumed losses differ by {diff:.3g}"
    diff = e2e.max_param_diff(_merged_params(straight), _merged_params(resumed))
    assert diff <= PARAM_TOL, f"final parameters differ by {diff:.3g}"
