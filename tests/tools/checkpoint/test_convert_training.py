"""tools/checkpoint/convert.py, end to end, with the optimizer state kept: a checkpoint trained
for one iteration at layout A, converted with ``--keep-optimizer-state`` to layout B, resumes
with ``--load`` (optimizer loaded) and trains on with the losses of the uninterrupted run at A
(fp32, 1e-5). With Adam this holds only when the moments, the step count and the scheduler are
carried and re-split exactly (fresh moments move the next loss by ~1e-2 here).

Cases: tied, TP1.DP4 plain -> TP2.PP2 with virtual stages (plain) and -> TP2.DP2 distributed
optimizer; untied, TP2.DP2 distributed optimizer -> TP1.DP4 plain and -> TP2.PP2 distributed
(DP1); bf16 (fp32 main params), TP2.DP2 plain -> TP1.DP4 distributed (1e-3: bf16 at another
DP size). A control converted without the state (fresh Adam) must miss the losses. bf16: plain
TP2 -> distributed TP1 -> plain TP2 is bitwise. Pooled gloo worlds; the converter runs without
processes.

Llama-style: SwiGLU (fc1's rows, and so its moments, are [gate_r; up_r] per TP rank)
with GQA (whole query groups per rank), RoPE, RMSNorm, no biases, untied; TP1.DP4 plain ->
TP2.DP2 plain and -> TP2.PP2 distributed optimizer resume the uninterrupted run, and TP2.PP2
distributed -> TP1 plain gives the source's state back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.checkpointing import DISTRIB_OPTIM_FILENAME, load_checkpoint_file, shard_files
from tests.training import e2e
from tests.tools.checkpoint import helpers
from tools.checkpoint import convert

LAYERS = ["--num-layers", "4"]
UNTIED = ["--untie-embeddings-and-output-weights"]
DISTOPT = ["--use-distributed-optimizer"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--ffn-hidden-size", "96", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", *UNTIED]
SAVED_AT, TOTAL_ITERS = 1, 3
LOSS_TOL = 1e-5
BF16_LOSS_TOL = 1e-3  # bf16 at another DP size (tests/training/test_checkpoint_load_modes.py)

# source: (TP, extra flags); saved at iteration SAVED_AT of a TOTAL_ITERS run at world 4
SOURCES = {"tied": (1, []), "distopt_untied": (2, [*DISTOPT, *UNTIED]),
           "bf16": (2, ["--bf16"]), "llama": (1, LLAMA)}
# target: (source, TP, PP, layers per virtual stage, target distributed optimizer)
TARGETS = {"tp2pp2_vpp": ("tied", 2, 2, 1, False),
           "tp2dp2_distopt": ("tied", 2, 1, None, True),
           "distopt_to_tp1dp4_plain": ("distopt_untied", 1, 1, None, False),
           "distopt_to_tp2pp2_distopt": ("distopt_untied", 2, 2, None, True),
           "bf16_to_tp1dp4_distopt": ("bf16", 1, 1, None, True),
           "llama_to_tp2dp2": ("llama", 2, 1, None, False),
           "llama_to_tp2pp2_distopt": ("llama", 2, 2, None, True)}
CONTROL = "tp2pp2_vpp"
"""Also converted without the optimizer state and resumed with --no-load-optim."""
FRESH_ADAM_MIN_DIFF = 1e-3


def _argv(corpus, tp: int, pp: int, vpp: int | None, extra) -> list[str]:
    flags = [*LAYERS, "--pipeline-model-parallel-size", str(pp), *extra]
    if vpp is not None:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(vpp)]
    return e2e.gpt_argv(corpus, tp=tp, iters=TOTAL_ITERS, extra=flags)


def _last_rank_losses(per_rank: list[dict]) -> list[float]:
    # The last rank is on the last pipeline stage in every layout (it computes the loss).
    result = per_rank[-1]
    assert result["error"] is None, result["error"]
    return e2e.losses(result)


def _convert(source: Path, target: Path, tp: int, pp: int = 1, vpp: int | None = None,
             distributed: bool | None = None, keep: bool = True) -> None:
    argv = ["--model-type", "GPT", "--load-dir", str(source), "--save-dir", str(target),
            "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size",
            str(pp)] + (["--keep-optimizer-state"] if keep else [])
    if vpp is not None:
        argv += ["--target-num-layers-per-virtual-pipeline-stage", str(vpp)]
    if distributed is not None:
        argv.append("--target-use-distributed-optimizer" if distributed
                    else "--no-target-use-distributed-optimizer")
    assert convert.main(argv) == 0


@pytest.fixture(scope="module")
def trained(gpt2_corpus, tmp_path_factory):
    """Each source trained straight for TOTAL_ITERS at world 4, saving every iteration: its
    losses are the reference, its iteration-SAVED_AT checkpoint the converter's input."""
    root = tmp_path_factory.mktemp("convert_training")
    runs = [{"argv": _argv(gpt2_corpus, tp, 1, None, [
        *extra, "--save", str(root / f"src_{name}"), "--save-interval", "1"])}
        for name, (tp, extra) in SOURCES.items()]
    results = e2e.pooled(4, runs)
    straight = {name: _last_rank_losses(r) for name, r in zip(SOURCES, results)}
    saved = {name: root / f"src_{name}" / f"iter_{SAVED_AT:07d}" for name in SOURCES}
    return root, saved, straight


@pytest.fixture(scope="module")
def converted(trained, gpt2_corpus):
    """Every target converted from its source and resumed (one pooled world)."""
    root, saved, _ = trained
    runs = []
    for name, (source, tp, pp, vpp, distributed) in TARGETS.items():
        target = root / name
        _convert(saved[source], target, tp, pp, vpp, distributed)
        extra = [*SOURCES[source][1], "--load", str(target)]
        extra = [f for f in extra if f not in DISTOPT] + (DISTOPT if distributed else [])
        runs.append({"argv": _argv(gpt2_corpus, tp, pp, vpp, extra)})
    source, tp, pp, vpp, _ = TARGETS[CONTROL]
    _convert(saved[source], root / "control", tp, pp, vpp, keep=False)
    runs.append({"argv": _argv(gpt2_corpus, tp, pp, vpp, [
        *SOURCES[source][1], "--load", str(root / "control"), "--no-load-optim"])})
    results = e2e.pooled(4, runs)
    return {name: _last_rank_losses(result)
            for name, result in zip([*TARGETS, "control"], results)}


@pytest.mark.parametrize("name", list(TARGETS))
def test_converted_optimizer_state_resumes_the_uninterrupted_run(trained, converted, name):
    reference = trained[2][TARGETS[name][0]][SAVED_AT:]
    assert len(converted[name]) == TOTAL_ITERS - SAVED_AT
    tol = BF16_LOSS_TOL if TARGETS[name][0] == "bf16" else LOSS_TOL
    assert e2e.max_abs_diff(converted[name], reference) <= tol, \
        (name, converted[name], reference)


def test_without_the_optimizer_state_the_losses_differ(trained, converted):
    """The control: the same conversion without --keep-optimizer-state, resumed with fresh Adam
    moments, misses the uninterrupted run (so the test above can fail)."""
    reference = trained[2][TARGETS[CONTROL][0]][SAVED_AT:]
    assert e2e.max_abs_diff(converted["control"], reference) > FRESH_ADAM_MIN_DIFF, \
        (converted["control"], reference)


def _optimizer_states(iteration_dir: Path) -> dict:
    """Every shard's optimizer entries, scheduler and distrib_optim.pt."""
    out = {}
    for rank, path in shard_files(iteration_dir).items():
        sd = load_checkpoint_file(path)
        distrib = path.with_name(DISTRIB_OPTIM_FILENAME)
        out[rank] = (sd["optimizer"], sd.get("opt_param_scheduler"),
                     load_checkpoint_file(distrib) if distrib.is_file() else None)
    return out


@pytest.mark.parametrize("source, hops", [
    ("tied", [(2, 2, 1, None), (1, 1, None, None)]),
    ("bf16", [(1, 1, None, True), (2, 1, None, False)]),
    ("llama", [(2, 2, None, True), (1, 1, None, False)])])
def test_optimizer_state_round_trip_is_bitwise(trained, tmp_path, source, hops):
    """Through other layouts and back (bf16: through the distributed optimizer's layout):
    moments, fp32 main params, step, grad scaler and scheduler come back bit for bit."""
    _, saved, _ = trained
    current = saved[source]
    for i, (tp, pp, vpp, distributed) in enumerate(hops):
        _convert(current, tmp_path / f"hop{i}", tp, pp, vpp, distributed)
        current = tmp_path / f"hop{i}"
    back = _optimizer_states(next(current.glob("iter_*")))
    helpers.assert_equal_nested(back, _optimizer_states(saved[source]), source)
    if source == "bf16":  # the fp32 main params are carried, not re-derived from bf16 weights
        mains = back[(0, 0)][0]["fp32_from_fp16_params"]
        assert all(m.dtype == torch.float32 for group in mains for m in group)
