"""tools/checkpoint/convert.py, end to end: a checkpoint trained at TP1 (DP4), converted to
TP2.PP2 with virtual stages, TP1.PP4, TP4.PP1 (tied) and TP2.PP2 (untied output layer),
resumes with ``--load`` at the new layout and trains on with the same losses as the source
resumed at its own layout (fp32, pooled gloo worlds; the converter runs without processes)."""

from __future__ import annotations

import pytest

from tests.training import e2e
from tools.checkpoint import convert

LAYERS = ["--num-layers", "4"]
UNTIED = ["--untie-embeddings-and-output-weights"]
# The resumed runs start a fresh optimizer on every layout (the converter drops its state).
RESUME = ["--no-load-optim"]
SOURCE_ITERS, RESUMED_ITERS = 1, 3
LOSS_TOL = 1e-5

# name: (TP, PP, layers per virtual stage, extra flags)
LAYOUTS = {"tp2pp2_vpp": (2, 2, 1, []), "tp1pp4": (1, 4, None, []), "tp4pp1": (4, 1, None, []),
           "tp2pp2_untied": (2, 2, None, UNTIED)}


def _argv(corpus, tp: int, pp: int, vpp: int | None, iters: int, extra) -> list[str]:
    flags = [*LAYERS, "--pipeline-model-parallel-size", str(pp), *extra]
    if vpp is not None:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(vpp)]
    return e2e.gpt_argv(corpus, tp=tp, iters=iters, extra=flags)


def _last_rank_losses(per_rank: list[dict]) -> list[float]:
    # The last rank is on the last pipeline stage in every layout (it computes the loss).
    result = per_rank[-1]
    assert result["error"] is None, result["error"]
    return e2e.losses(result)


@pytest.fixture(scope="module")
def trained(gpt2_corpus, tmp_path_factory):
    """Sources (tied, untied) saved after 2 iterations at TP1.DP4, and their resumed losses."""
    root = tmp_path_factory.mktemp("convert_training")
    runs, sources = [], {}
    for name, extra in (("tied", []), ("untied", UNTIED)):
        save = str(root / f"src_{name}")
        sources[name] = save
        # The whole run's schedule (--train-iters), stopped and saved at SOURCE_ITERS.
        runs.append({"argv": _argv(gpt2_corpus, 1, 1, None, RESUMED_ITERS, [
            *extra, "--save", save, "--save-interval", str(SOURCE_ITERS),
            "--exit-interval", str(SOURCE_ITERS)])})
        runs.append({"argv": _argv(gpt2_corpus, 1, 1, None, RESUMED_ITERS,
                                   [*extra, "--load", save, *RESUME])})
    results = e2e.pooled(4, runs)
    print([round(r[-1].get("seconds") or 0, 1) for r in results])
    reference = {"tied": _last_rank_losses(results[1]), "untied": _last_rank_losses(results[3])}
    return root, sources, reference


@pytest.fixture(scope="module")
def converted(trained, gpt2_corpus):
    """Every target layout converted from its source and resumed (one pooled world)."""
    root, sources, _ = trained
    runs = []
    for name, (tp, pp, vpp, extra) in LAYOUTS.items():
        target = root / name
        argv = ["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron",
                "--load-dir", sources["untied" if extra else "tied"], "--save-dir", str(target),
                "--target-tensor-parallel-size", str(tp),
                "--target-pipeline-parallel-size", str(pp), "--megatron-path", "/ignored"]
        if vpp is not None:
            argv += ["--target-num-layers-per-virtual-pipeline-stage", str(vpp)]
        assert convert.main(argv) == 0
        runs.append({"argv": _argv(gpt2_corpus, tp, pp, vpp, RESUMED_ITERS,
                                   [*extra, "--load", str(target), *RESUME])})
    results = e2e.pooled(4, runs)
    print({name: round(r[-1].get("seconds") or 0, 1) for name, r in zip(LAYOUTS, results)})
    return {name: _last_rank_losses(result) for name, result in zip(LAYOUTS, results)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_converted_checkpoint_trains_on_with_the_source_losses(trained, converted, name):
    reference = trained[2]["untied" if LAYOUTS[name][3] else "tied"]
    assert len(reference) == RESUMED_ITERS - SOURCE_ITERS
    assert e2e.max_abs_diff(converted[name], reference) <= LOSS_TOL, \
        (name, converted[name], reference)
