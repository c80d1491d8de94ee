"""Zero-shot evaluation of an MoE checkpoint (experts on every other layer, a gated shared
expert, softmax before the top-k) loaded with only --load and --use-checkpoint-args: the
WikiText perplexity equals the straightforward computation over the saved model, and the
LAMBADA accuracy counts what that model predicts."""

from __future__ import annotations

import math

import pytest

from tasks.zeroshot_gpt import evaluate
from tests.multiprocess import run_distributed
from tests.tasks.zeroshot_gpt.test_evaluate import (MODEL, STRIDE, _each_tokenizer_loaded_once,
                                                    _gpt2_flags, _lambada_from_predictions,
                                                    _reference_perplexity, _save, _task)
from tests.tasks.zeroshot_gpt.test_evaluate import wiki_file  # noqa: F401  (the fixture)

MOE = MODEL + ("--normalization RMSNorm --swiglu --ffn-hidden-size 32 --disable-bias-linear "
               "--position-embedding-type rope --num-experts 4 --moe-ffn-hidden-size 12 "
               "--moe-layer-freq [0,1] --moe-router-topk 2 "
               "--moe-shared-expert-intermediate-size 8 --moe-shared-expert-gate "
               "--moe-router-pre-softmax").split()


def _runs(rank: int, world_size: int, tmp: str, shared: str, wiki: str) -> dict:
    del rank, world_size
    from megatron.core import parallel_state
    from megatron.training.initialize import build_tokenizer_from_config

    with _each_tokenizer_loaded_once():
        tok_flags = _gpt2_flags(shared)
        cfg, model = _save(MOE + tok_flags, f"{tmp}/moe")
        tokenizer = build_tokenizer_from_config(cfg)
        lambada = f"{tmp}/lambada_test.jsonl"
        corpus = open(f"{shared}/corpus/tinyshakespeare.txt", encoding="utf-8").read()[:20000]
        out = {"reference": _reference_perplexity(model, tokenizer, wiki),
               "lambada_expected": _lambada_from_predictions(model, tokenizer, corpus, lambada)}
        parallel_state.destroy_model_parallel()
        load = ["--load", f"{tmp}/moe", "--use-checkpoint-args"]
        out["wiki"] = _task(evaluate.run_wikitext, tok_flags + load + [
            "--valid-data", wiki, "--overlapping-eval", str(STRIDE)])
        out["lambada"] = _task(evaluate.run_lambada, tok_flags + load + [
            "--valid-data", lambada, "--eval-micro-batch-size", "2"])
        return out


def test_moe_perplexity_and_accuracy_equal_the_reference(tmp_path, shared_data, wiki_file):
    out = run_distributed(1, _runs, str(tmp_path), str(shared_data), str(wiki_file))[0]
    ref = out["reference"]
    assert abs(ref["avg_loss"] - math.log(50257)) > 0.5  # scaled weights: far from uniform
    got = out["wiki"]
    assert isinstance(got, dict), got
    assert got["num_tokenized_tokens"] == ref["num_tokenized_tokens"]
    for key in ("avg_loss", "ppl", "adjusted_ppl"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5), key
    expected, total = out["lambada_expected"]
    assert 4 <= expected < total
    lam = out["lambada"]
    assert isinstance(lam, dict), lam
    assert (lam["correct"], lam["total"]) == (expected, total)
