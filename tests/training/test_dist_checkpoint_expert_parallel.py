"""``--ckpt-format torch_dist`` with expert parallelism on a 4-expert, top-2 MoE GPT (shared
expert, aux and z losses; tests.training.test_moe_expert_parallel_training's model): each EP
rank writes its experts into the global ``[layers, experts, ...]`` tensors under Megatron-Core's
keys, so a checkpoint saved at EP=2 (the distributed optimizer's expert state sharded over the
expert-data-parallel group) resumes at EP=1, and one saved at EP=1 resumes at EP=2, with the
losses of the uninterrupted runs (fp32, 1e-5)."""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_moe_expert_parallel_training import FLAGS

ITERS, SAVED_AT = 4, 2
TOL = 1e-5
EP2 = ["--expert-model-parallel-size", "2"]
DIST = ["--ckpt-format", "torch_dist"]


def _run(*extra, init: bool = False) -> dict:
    flags = list(FLAGS)
    flags[flags.index("--train-iters") + 1] = str(ITERS)
    return {"argv": [*flags, *DIST, *extra], "single_process_init": init}


def _losses(per_rank: list[dict]) -> list[float]:
    assert per_rank[0]["error"] is None, per_rank[0]["error"]
    return e2e.losses(per_rank[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch_dist_ep")
    save = ["--save-interval", str(SAVED_AT)]
    step = ["--ckpt-step", str(SAVED_AT)]
    results = e2e.pooled(2, [
        _run(*EP2, "--use-distributed-optimizer", "--save", str(root / "ep2"), *save,
             init=True),
        _run("--use-distributed-optimizer", "--load", str(root / "ep2"), *step),
        _run("--save", str(root / "ep1"), *save, init=True),
        _run(*EP2, "--load", str(root / "ep1"), *step)])
    names = ["ep2", "ep2_to_ep1", "ep1", "ep1_to_ep2"]
    return {"root": root, **{n: _losses(r) for n, r in zip(names, results)}}


@pytest.mark.parametrize("straight,resumed", [("ep2", "ep2_to_ep1"), ("ep1", "ep1_to_ep2")])
def test_a_torch_dist_checkpoint_resumes_at_another_expert_parallel_size(runs, straight,
                                                                         resumed):
    assert len(runs[straight]) == ITERS and len(runs[resumed]) == ITERS - SAVED_AT
    assert e2e.max_abs_diff(runs[straight][SAVED_AT:], runs[resumed]) <= TOL, \
        (runs[straight], runs[resumed])


def test_both_layouts_write_the_same_global_expert_tensors(runs):
    """EP=2 and EP=1 train the same model (to 1e-5), and both checkpoints hold the experts as
    one [layers, experts, ...] tensor with all four experts."""
    from megatron.checkpointing.dist import storage

    assert e2e.max_abs_diff(runs["ep2"], runs["ep1"]) <= TOL
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    ep2 = storage.read_plain_tensors(runs["root"] / "ep2" / f"iter_{SAVED_AT:07d}", [key])[key]
    ep1 = storage.read_plain_tensors(runs["root"] / "ep1" / f"iter_{SAVED_AT:07d}", [key])[key]
    assert ep2.shape == ep1.shape and ep2.shape[:2] == (2, 4)
    assert (ep2 - ep1).abs().max() <= 1e-5
    exp_avg = "optimizer.state.exp_avg." + key
    moments = storage.read_plain_tensors(runs["root"] / "ep2" / f"iter_{SAVED_AT:07d}",
                                         [exp_avg])[exp_avg]
    assert all(moments[:, e].abs().sum() > 0 for e in range(4))  # each EP rank's experts


def test_the_converter_writes_an_expert_parallel_torch_dist_checkpoint_at_ep2(runs, tmp_path):
    """convert.py --source-ckpt-format torch_dist --target-expert-parallel-size 2: EP rank 1's
    local expert i is global expert 2 + i of the torch_dist tensor."""
    import torch

    from megatron.checkpointing.dist import storage
    from tools.checkpoint import convert

    source = runs["root"] / "ep2" / f"iter_{SAVED_AT:07d}"
    assert convert.main(["--model-type", "GPT", "--load-dir", str(source), "--save-dir",
                         str(tmp_path / "legacy"), "--source-ckpt-format", "torch_dist",
                         "--target-expert-parallel-size", "2"]) == 0
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    whole = storage.read_plain_tensors(source, [key])[key]
    shard = torch.load(tmp_path / "legacy" / f"iter_{SAVED_AT:07d}" / "mp_rank_00_001" /
                       "model_optim_rng.pt", weights_only=False)
    experts = shard["model"]["language_model"]["encoder"]
    for layer in range(2):
        for local in range(2):
            name = f"layers.{layer}.mlp.local_experts.{local}.dense_4h_to_h.weight"
            assert torch.equal(experts[name], whole[layer, 2 + local]), name
