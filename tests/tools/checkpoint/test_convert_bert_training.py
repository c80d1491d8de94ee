"""tools/checkpoint/convert.py --model-type BERT, end to end: a BERT (pooler, LM head, binary
head) trained one iteration at TP1 (DP4), converted with its optimizer state to TP2.PP2 (the
last stage holds the tied-embedding copy beside the heads) and to TP4 with the distributed
optimizer, resumes with ``--load`` and trains on with the lm and sop losses of the
uninterrupted run (fp32, 1e-5). pretrain_bert.py's provider and forward step, synthetic samples
(tests/training/test_bert_pretrain.py), one pooled gloo world per step."""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_bert_pretrain import bert_argv, pooled_bert
from tools.checkpoint import convert

SAVED_AT, TOTAL_ITERS = 1, 3
LOSS_TOL = 1e-5
KEYS = ("lm loss", "sop loss")
# name: (TP, PP, target distributed optimizer)
TARGETS = {"tp2pp2": (2, 2, False), "tp4_distopt": (4, 1, True)}


def _losses(per_rank: list[dict]) -> dict[str, list[float]]:
    result = per_rank[-1]  # the last rank is on the last pipeline stage
    return {key: [h[key] for h in result["history"]] for key in KEYS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_bert")
    source = root / "source"
    (straight,) = pooled_bert(4, [{"argv": bert_argv(iters=TOTAL_ITERS, extra=[
        "--save", source, "--save-interval", "1"])}])
    resumed = []
    for name, (tp, pp, distributed) in TARGETS.items():
        assert convert.main([
            "--model-type", "BERT", "--load-dir", str(source / f"iter_{SAVED_AT:07d}"),
            "--save-dir", str(root / name), "--target-tensor-parallel-size", str(tp),
            "--target-pipeline-parallel-size", str(pp), "--keep-optimizer-state",
            "--target-use-distributed-optimizer" if distributed
            else "--no-target-use-distributed-optimizer"]) == 0
        extra = ["--pipeline-model-parallel-size", str(pp), "--load", root / name]
        resumed.append({"argv": bert_argv(tp=tp, iters=TOTAL_ITERS, extra=[
            *extra, *(["--use-distributed-optimizer"] if distributed else [])])})
    results = pooled_bert(4, resumed)
    return _losses(straight), {name: _losses(r) for name, r in zip(TARGETS, results)}


@pytest.mark.parametrize("name", list(TARGETS))
def test_converted_bert_resumes_with_the_source_losses(runs, name):
    straight, converted = runs
    for key in KEYS:
        reference = straight[key][SAVED_AT:]
        assert len(converted[name][key]) == TOTAL_ITERS - SAVED_AT
        assert e2e.max_abs_diff(converted[name][key], reference) <= LOSS_TOL, \
            (name, key, converted[name][key], reference)
