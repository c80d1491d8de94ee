"""Context parallelism does not change training: CP=2 equals the single process.

A tiny GPT and a Llama-style model (RMSNorm, SwiGLU, RoPE on half the head, grouped-query
attention with 2 groups, untied output) are trained for a few iterations from the same seed
through ``pretrain()`` with pretrain_gpt.py's providers, at CP=1 and at CP=2 with each
--cp-comm-type; every CP=2 run must give the single-process loss at every iteration to 1e-5 and
the same final parameters to 2e-5 (fp32, dropout 0).
"""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_llama import LLAMA

SHAPE = {"iters": 5, "seq": 32, "mbs": 1, "gbs": 2}
LOSS_TOL = 1e-5
PARAM_TOL = 2e-5

_MODELS = {"gpt": [], "llama": LLAMA}
# name: (model, extra flags) of the CP=2 runs
_CP2 = {"gpt_p2p": ("gpt", ["--cp-comm-type", "p2p"]),
        "gpt_all_gather": ("gpt", ["--cp-comm-type", "all_gather"]),
        "llama_p2p": ("llama", []),
        # one exchange per layer, as Megatron-Core's list form
        "llama_a2a_then_allgather": ("llama", ["--cp-comm-type", "a2a", "allgather"])}


def _run(corpus, model: str, extra=()) -> dict:
    return {"argv": e2e.gpt_argv(corpus, **SHAPE, extra=[*_MODELS[model], *extra]),
            "params": True}


@pytest.fixture(scope="module")
def single(gpt2_corpus):
    results = e2e.pooled(1, [_run(gpt2_corpus, model) for model in _MODELS])
    return {model: result[0] for model, result in zip(_MODELS, results)}


@pytest.fixture(scope="module")
def cp2(gpt2_corpus):
    runs = [_run(gpt2_corpus, model, ["--context-parallel-size", "2", *extra])
            for model, extra in _CP2.values()]
    return dict(zip(_CP2, e2e.pooled(2, runs)))


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
