"""Context parallelism with compiled layers and with the interleaved pipeline schedule: both
equal the single process (loss every iteration to 1e-5, final parameters to 2e-5; fp32,
dropout 0).

* CP=2 with ``--compile-layers`` (each layer through ``torch.compile``, inductor's CPU backend):
  a GPT with each ``--cp-comm-type`` of the GPT (p2p, all_gather) and a Llama-style model with
  a2a, and p2p with selective recomputation (the recomputed attention core runs eagerly). The
  layers really compile: dynamo captures graphs, and the one graph break is the
  context-parallel attention core (``context_parallel_attention`` runs eagerly by design).
* CP=2 x PP=2 with two virtual stages per rank (a 4-layer GPT, one layer per virtual stage):
  the interleaved schedule's stage tensors are the CP-split ``[s / CP, b, h]``.

Cost: the inductor compilations of a layer on both ranks (shared by the runs where the traced
code is the same) and five short runs on two ranks, one on four.
"""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_compile_layers import run_counting_compiles
from tests.training.test_llama import LLAMA
from tests.training.test_pipeline_parallel import _last_stage, _merged_params

SHAPE = {"iters": 4, "seq": 32, "mbs": 1, "gbs": 2}
LOSS_TOL = 1e-5
PARAM_TOL = 2e-5
CP2 = ["--context-parallel-size", "2"]
FOUR_LAYERS = ["--num-layers", "4"]

_MODELS = {"gpt": [], "llama": LLAMA, "gpt4": FOUR_LAYERS}
# name: (reference model, extra flags) of the compiled CP=2 runs
_COMPILED = {"gpt_p2p": ("gpt", ["--cp-comm-type", "p2p"]),
             "gpt_all_gather": ("gpt", ["--cp-comm-type", "all_gather"]),
             "llama_a2a": ("llama", ["--cp-comm-type", "a2a"]),
             "gpt_p2p_selective_recompute": ("gpt", ["--recompute-activations"])}


def _run(corpus, model: str, extra=()) -> dict:
    return {"argv": e2e.gpt_argv(corpus, **SHAPE, extra=[*_MODELS[model], *extra]),
            "params": True}


@pytest.fixture(scope="module")
def single(gpt2_corpus):
    return dict(zip(_MODELS, (r[0] for r in e2e.pooled(1, [_run(gpt2_corpus, m)
                                                            for m in _MODELS]))))


@pytest.fixture(scope="module")
def compiled(gpt2_corpus, single):
    from tests.multiprocess import run_distributed

    runs = [_run(gpt2_corpus, model, [*CP2, "--compile-layers", *extra])
            for model, extra in _COMPILED.values()]
    runs[0]["fresh"] = True  # dynamo's caches emptied: the first run must capture its graphs
    per_rank = run_distributed(2, run_counting_compiles, runs, timeout=900)
    return {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(_COMPILED)}


def _assert_equal_training(reference: dict, run_ranks: list[dict], what: str) -> None:
    ref = e2e.losses(reference)
    assert len(ref) == SHAPE["iters"] and ref[-1] < ref[0], f"the reference did not train: {ref}"
    for rank, result in enumerate(run_ranks):
        diff = e2e.max_abs_diff(ref, e2e.losses(result))
        assert diff <= LOSS_TOL, (f"{what}, rank {rank}: loss differs by {diff:.3g}\n"
                                  f"  reference {ref}\n  run {e2e.losses(result)}")
        diff = e2e.max_param_diff(reference["params"], result["params"])
        assert diff <= PARAM_TOL, f"{what}, rank {rank}: final parameters differ by {diff:.3g}"


@pytest.mark.parametrize("name", list(_COMPILED))
def test_cp2_with_compiled_layers_equals_single_process(single, compiled, name):
    _assert_equal_training(single[_COMPILED[name][0]], compiled[name], f"compiled CP=2 {name}")


def test_compiled_layers_break_only_at_the_cp_attention(compiled):
    for rank, result in enumerate(compiled["gpt_p2p"]):  # the fresh capture
        assert result["graphs"] >= 1, f"rank {rank}: --compile-layers compiled nothing"
        assert any("context_parallel_attention" in r for r in result["graph_breaks"]), \
            f"rank {rank}: the CP attention was traced, not run eagerly: {result['graph_breaks']}"
    for name, ranks in compiled.items():
        for rank, result in enumerate(ranks):
            # Dynamo counts a break where it captures: later runs may reuse the graphs. The
            # selectively recomputed core runs eagerly as a whole (checkpoint_eagerly).
            others = [r for r in result["graph_breaks"] if "context_parallel_attention" not in r
                      and "function checkpoint" not in r]
            assert not others, f"{name}, rank {rank}: unexpected graph breaks {others}"


def test_cp2_pp2_virtual_stages_equal_single_process(gpt2_corpus, single):
    run = {**_run(gpt2_corpus, "gpt4", [*CP2, "--pipeline-model-parallel-size", "2",
                                        "--num-layers-per-virtual-pipeline-stage", "1"]),
           "single_process_init": True}
    ranks = e2e.pooled(4, [run])[0]
    merged = _merged_params(ranks)
    ranks = [{**r, "params": merged} for r in _last_stage(ranks)]
    assert len(ranks) == 2  # the two CP ranks of the last stage
    _assert_equal_training(single["gpt4"], ranks, "CP=2 x PP=2 x VPP=2")
