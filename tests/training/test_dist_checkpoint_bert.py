"""BERT in ``--ckpt-format torch_dist``: a run saved at TP=2 (2 gloo ranks) with the
distributed optimizer resumes at TP=1 x DP=2 and at PP=2 (the last stage's copy of the tied
embedding, the pooler and the heads there) with the lm and sop losses of the saving run, which
trains on past the save (1e-5, fp32). The checkpoint holds Megatron-Core's BertModel keys: the
layers stacked under ``encoder.``, ``encoder.final_layernorm``, ``pooler.dense``,
``lm_head.dense``, ``lm_head.layer_norm``, the LM head's bias as ``output_layer.bias``,
``binary_head``, with the optimizer state of each."""

from __future__ import annotations

import pytest

from megatron.checkpointing import checkpoint_dir
from megatron.checkpointing.dist import storage
from tests.training import e2e
from tests.training.test_bert_pretrain import bert_argv, pooled_bert

SAVED_AT, ITERS = 2, 4
TOL = 1e-5
DIST = ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
TARGETS = {"tp1_dp2": [], "pp2": ["--pipeline-model-parallel-size", "2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save = tmp_path_factory.mktemp("bert_torch_dist")
    plan = [{"argv": bert_argv(tp=2, iters=ITERS, extra=[
        *DIST, "--save", save, "--save-interval", SAVED_AT])}]
    plan += [{"argv": bert_argv(tp=1, iters=ITERS, extra=[
        *DIST, *extra, "--load", save, "--ckpt-step", SAVED_AT])} for extra in TARGETS.values()]
    results = pooled_bert(2, plan)
    return save, results[0], dict(zip(TARGETS, results[1:]))


def _losses(result: list[dict], key: str) -> list[float]:
    # The last rank is on the last pipeline stage in every layout (it computes the losses).
    return [h[key] for h in result[-1]["history"]]


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_tp2_bert_save_resumes_at_another_layout(runs, target):
    _, straight, resumed = runs
    for key in ("lm loss", "sop loss"):
        reference, mine = _losses(straight, key), _losses(resumed[target], key)
        assert len(reference) == ITERS and len(mine) == ITERS - SAVED_AT
        assert e2e.max_abs_diff(reference[SAVED_AT:], mine) < TOL, (key, reference, mine)


def test_the_keys_are_megatron_cores_bert(runs):
    save, _, _ = runs
    md = storage.read_metadata(checkpoint_dir(save, SAVED_AT)).state_dict_metadata
    shapes = {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")}
    hidden = 64
    vocab = shapes["embedding.word_embeddings.weight"][0]
    assert shapes["encoder.layers.self_attention.linear_qkv.weight"] == (2, 3 * hidden, hidden)
    assert shapes["encoder.layers.mlp.linear_fc1.layer_norm_weight"] == (2, hidden)
    assert shapes["encoder.final_layernorm.weight"] == (hidden,)
    assert shapes["embedding.tokentype_embeddings.weight"] == (2, hidden)
    assert shapes["pooler.dense.weight"] == (hidden, hidden)
    assert shapes["lm_head.dense.weight"] == (hidden, hidden)
    assert shapes["lm_head.layer_norm.bias"] == (hidden,)
    assert shapes["output_layer.bias"] == (vocab,)
    assert shapes["binary_head.weight"] == (2, hidden)
    assert shapes["optimizer.state.exp_avg.output_layer.bias"] == (vocab,)
    assert shapes["optimizer.state.fp32_param.binary_head.bias"] == (2,)
    assert "output_layer.weight" not in shapes  # tied: the embedding's
    assert not any(k.startswith("decoder.") for k in md)
    assert "encoder.layers.self_attention.linear_qkv._extra_state/shard_0_2" in md
