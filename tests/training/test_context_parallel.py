"""Context parallelism does not change training: CP=2 equals the single process.

A tiny GPT and a Llama-style model (RMSNorm, SwiGLU, RoPE on half the head, grouped-query
attention with 2 groups, untied output) are trained for a few iterations from the same seed
through ``pretrain()`` with pretrain_gpt.py's providers, at CP=1 and at CP=2 with each
--cp-comm-type, with recomputation, composed with TP (and SP), PP and DP (with the distributed
optimizer); every run must give the single-process loss at every iteration to 1e-5 and the same
final parameters to 2e-5 (fp32, dropout 0). Checkpoints do not depend on CP: a run stopped at
iteration 3 resumes exactly at the same CP size, at CP=1 from CP=2, and at CP=2 from CP=1.
"""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_llama import LLAMA
from tests.training.test_pipeline_parallel import _last_stage, _merged_params

SHAPE = {"iters": 5, "seq": 32, "mbs": 1, "gbs": 2}
LOSS_TOL = 1e-5
PARAM_TOL = 2e-5

# Learned absolute positions restarted after every end-of-document token: the position ids are
# split over CP like the tokens.
_MODELS = {"gpt": [], "llama": LLAMA, "gpt_reset_position_ids": ["--reset-position-ids"]}
# name: (model, extra flags) of the CP=2 runs
_CP2 = {"gpt_p2p": ("gpt", ["--cp-comm-type", "p2p"]),
        "gpt_all_gather": ("gpt", ["--cp-comm-type", "all_gather"]),
        "llama_p2p": ("llama", []),
        # one exchange per layer, as Megatron-Core's list form
        "llama_a2a_then_allgather": ("llama", ["--cp-comm-type", "a2a", "allgather"]),
        "gpt_full_recompute": ("gpt", ["--recompute-granularity", "full",
                                       "--recompute-method", "uniform"]),
        "llama_selective_recompute": ("llama", ["--recompute-activations"]),
        "gpt_reset_position_ids": ("gpt_reset_position_ids", [])}
# Four ranks: CP=2 with TP=2 and sequence parallelism, with PP=2, with DP=2.
_CP2_FOUR = {"tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--make-vocab-size-divisible-by", "64"],
             "pp2": ["--pipeline-model-parallel-size", "2"],
             "dp2_distopt": ["--use-distributed-optimizer"]}
STOP = 3  # the checkpointed runs stop here


def _run(corpus, model: str, extra=()) -> dict:
    return {"argv": e2e.gpt_argv(corpus, **SHAPE, extra=[*_MODELS[model], *extra]),
            "params": True}


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    return {name: str(tmp_path_factory.mktemp(f"cp_{name}"))
            for name in ("cp1", "cp2", "cp2_distopt")}


def _stop_and_save(save: str) -> list[str]:
    return ["--save", save, "--save-interval", "1000", "--exit-interval", str(STOP)]


@pytest.fixture(scope="module")
def single(gpt2_corpus, saves):
    runs = [_run(gpt2_corpus, model) for model in _MODELS]
    runs.append(_run(gpt2_corpus, "gpt", _stop_and_save(saves["cp1"])))
    results = [r[0] for r in e2e.pooled(1, runs)]
    return {**dict(zip(_MODELS, results)), "stopped": results[-1]}


@pytest.fixture(scope="module")
def cp2(gpt2_corpus, single, saves):
    cp = ["--context-parallel-size", "2"]
    runs = [_run(gpt2_corpus, model, [*cp, *extra]) for model, extra in _CP2.values()]
    runs += [_run(gpt2_corpus, "gpt", [*cp, *_stop_and_save(saves["cp2"])]),
             _run(gpt2_corpus, "gpt", [*cp, "--load", saves["cp2"]]),
             _run(gpt2_corpus, "gpt", [*cp, "--load", saves["cp1"]]),
             _run(gpt2_corpus, "gpt", [*cp, "--use-distributed-optimizer",
                                       *_stop_and_save(saves["cp2_distopt"])])]
    results = e2e.pooled(2, runs)
    out = dict(zip(_CP2, results))
    out["stopped"], out["resumed"], out["from_cp1"], out["stopped_distopt"] = results[-4:]
    return out


@pytest.fixture(scope="module")
def cp2_four(gpt2_corpus, single):
    runs = [{**_run(gpt2_corpus, "gpt", ["--context-parallel-size", "2", *extra]),
             "single_process_init": True} for extra in _CP2_FOUR.values()]
    return dict(zip(_CP2_FOUR, e2e.pooled(4, runs)))


def _assert_equal_training(reference: dict, run_ranks: list[dict], what: str) -> None:
    ref = e2e.losses(reference)
    assert len(ref) == SHAPE["iters"] and ref[-1] < ref[0], f"the reference did not train: {ref}"
    for rank, result in enumerate(run_ranks):
        diff = e2e.max_abs_diff(ref, e2e.losses(result))
        assert diff <= LOSS_TOL, (f"{what}, rank {rank}: loss differs by {diff:.3g}\n"
                                  f"  reference {ref}\n  CP=2 {e2e.losses(result)}")
        diff = e2e.max_param_diff(reference["params"], result["params"])
        assert diff <= PARAM_TOL, f"{what}, rank {rank}: final parameters differ by {diff:.3g}"


@pytest.mark.parametrize("name", list(_CP2_FOUR))
def test_cp2_composed_with_tp_pp_dp_equals_single_process(single, cp2_four, name):
    """TP=2 x CP=2 with sequence parallelism, CP=2 x PP=2, CP=2 x DP=2 with the distributed
    optimizer (its shards span DP x CP)."""
    ranks = cp2_four[name]
    if name == "pp2":  # the loss lives on the last stage: its ranks, with every stage's params
        merged = _merged_params(ranks)
        ranks = [{**r, "params": merged} for r in _last_stage(ranks)]
        assert len(ranks) == 2
    _assert_equal_training(single["gpt"], ranks, f"CP=2 x {name}")


def test_checkpoints_do_not_depend_on_cp(single, cp2, gpt2_corpus, saves):
    """Stopped at 3 and resumed: at CP=2 from CP=2, at CP=2 from CP=1, at CP=1 from CP=2 (also
    with the distributed optimizer, whose state was sharded over DP x CP = 2 ranks) -- every
    second half continues the uninterrupted single-process losses exactly."""
    ref = e2e.losses(single["gpt"])
    at_cp1, at_cp1_distopt = (r for r in e2e.pooled(1, [
        _run(gpt2_corpus, "gpt", ["--load", saves["cp2"]]),
        _run(gpt2_corpus, "gpt", ["--load", saves["cp2_distopt"], "--use-distributed-optimizer"])]))
    for what, first, second in (("CP=2 -> CP=2", cp2["stopped"], cp2["resumed"]),
                                ("CP=1 -> CP=2", [single["stopped"]], cp2["from_cp1"]),
                                ("CP=2 -> CP=1", cp2["stopped"], at_cp1),
                                ("CP=2 -> CP=1, distributed optimizer", cp2["stopped_distopt"],
                                 at_cp1_distopt)):
        for rank, result in enumerate(second):
            assert result["iteration"] == SHAPE["iters"] and first[0]["iteration"] == STOP
            halves = e2e.losses(first[0]) + e2e.losses(result)
            diff = e2e.max_abs_diff(ref, halves)
            assert diff <= LOSS_TOL, (f"{what}, rank {rank}: resumed losses differ by "
                                      f"{diff:.3g}\n  straight {ref}\n  halves {halves}")
            diff = e2e.max_param_diff(single["gpt"]["params"], result["params"])
            assert diff <= PARAM_TOL, f"{what}, rank {rank}: final parameters differ by {diff:.3g}"


@pytest.mark.parametrize("name", list(_CP2))
def test_cp2_equals_single_process(single, cp2, name):
    reference = single[_CP2[name][0]]
    ref = e2e.losses(reference)
    assert len(ref) == SHAPE["iters"] and ref[-1] < ref[0], f"the reference did not train: {ref}"
    for rank, result in enumerate(cp2[name]):
        diff = e2e.max_abs_diff(ref, e2e.losses(result))
        assert diff <= LOSS_TOL, (f"{name}, rank {rank}: loss differs by {diff:.3g}\n"
                                  f"  reference {ref}\n  CP=2 {e2e.losses(result)}")
        diff = e2e.max_param_diff(reference["params"], result["params"])
        assert diff <= PARAM_TOL, f"{name}, rank {rank}: final parameters differ by {diff:.3g}"


def test_reset_position_ids_changed_the_positions(single):
    """The sequences of the --reset-position-ids runs hold a document boundary: the reset
    changed the loss (else its CP=2 comparison above would only repeat the plain one)."""
    plain, reset = e2e.losses(single["gpt"]), e2e.losses(single["gpt_reset_position_ids"])
    assert e2e.max_abs_diff(plain, reset) > 1e-4, (plain, reset)
