"""``--ckpt-format torch_dist`` with expert parallelism on a 4-expert, top-2 MoE GPT (shared
expert, aux and z losses; tests.training.test_moe_expert_parallel_training's model): each EP
rank writes its experts into the global ``[layers, experts, ...]`` tensors under Megatron-Core's
keys, so a checkpoint saved at EP=2 (the distributed optimizer's expert state sharded over the
expert-data-parallel group) resumes at EP=1, and one saved at EP=1 resumes at EP=2, with the
losses of the uninterrupted runs (fp32, 1e-5).

On 4 ranks, EP=2 x TP=2 with sequence parallelism (parallel folding: each expert split over
its expert tensor-parallel group, ETP=2, or whole on one rank, ETP=1; the model has biases)
saves the experts as Megatron-Core's ``SequentialMLP`` does: the expert dimension chunked by
EP, an expert's own dimensions by ETP. Such a checkpoint, with the optimizer state (the plain
or the distributed optimizer's), resumes at EP=1 x TP=1, at EP=2 x TP=1 and at the other ETP
with the uninterrupted run's losses; so does EP=2 x TP=4 with ETP=1 (which the torch format's
``mp_rank_TT_EEE`` files cannot hold)."""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_moe_expert_parallel_training import FLAGS
from tests.training.test_moe_expert_tensor_parallel_training import BIASED, TP_EP

ITERS, SAVED_AT = 4, 2
TOL = 1e-5
EP2 = ["--expert-model-parallel-size", "2"]
DIST = ["--ckpt-format", "torch_dist"]
DISTOPT = "--use-distributed-optimizer"


def _run(*extra, init: bool = False, base=FLAGS) -> dict:
    flags = list(base)
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
    _assert_resumes_straight(runs[straight], runs[resumed])


def _assert_resumes_straight(straight: list[float], resumed: list[float]) -> None:
    assert len(straight) == ITERS and len(resumed) == ITERS - SAVED_AT
    assert e2e.max_abs_diff(straight[SAVED_AT:], resumed) <= TOL, (straight, resumed)


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


FC1, FC2 = ("decoder.layers.mlp.experts.experts.linear_fc1.weight",
            "decoder.layers.mlp.experts.experts.linear_fc2.weight")


def _etp(etp: int) -> list[str]:
    dispatcher = "alltoall" if etp == 2 else "allgather"
    return [*TP_EP, "--expert-tensor-parallel-size", str(etp), "--moe-token-dispatcher-type",
            dispatcher]


TP4_EP2 = ["--tensor-model-parallel-size", "4", "--sequence-parallel",
           "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """Two EP=2 x TP=2 runs saving at iteration 2, ETP=2 with the plain optimizer and ETP=1
    with the distributed optimizer (dense state sharded over DP=2, expert state over the
    expert-DP group of 2), each resumed at other layouts of the same 4 ranks with either
    optimizer; and EP=2 x TP=4 with ETP=1 (fewer EP than TP ranks) resumed at one rank's
    layout."""
    root = tmp_path_factory.mktemp("torch_dist_ep_tp")
    save = ["--save-interval", str(SAVED_AT)]
    step = ["--ckpt-step", str(SAVED_AT)]
    plan = {
        "etp2": _run(*_etp(2), "--save", str(root / "etp2"), *save, init=True, base=BIASED),
        "etp1": _run(*_etp(1), DISTOPT, "--save", str(root / "etp1"), *save, init=True,
                     base=BIASED),
        "etp2_to_etp1": _run(*_etp(1), DISTOPT, "--load", str(root / "etp2"), *step,
                             base=BIASED),
        "etp2_to_ep1_tp1": _run("--load", str(root / "etp2"), *step, base=BIASED),
        "etp1_to_etp2": _run(*_etp(2), DISTOPT, "--load", str(root / "etp1"), *step,
                             base=BIASED),
        "etp1_to_ep2_tp1": _run(*EP2, DISTOPT, "--load", str(root / "etp1"), *step,
                                base=BIASED),
        "etp1_no_optim": _run("--load", str(root / "etp1"), *step, "--no-load-optim",
                              base=BIASED),
        # Fewer EP than TP ranks: each TP rank of a group holds other experts.
        "tp4": _run(*TP4_EP2, "--save", str(root / "tp4"), *save, init=True, base=BIASED),
        "tp4_to_ep1_tp1": _run("--load", str(root / "tp4"), *step, base=BIASED),
    }
    results = e2e.pooled(4, list(plan.values()))
    return {"root": root, **{n: _losses(r) for n, r in zip(plan, results)}}


@pytest.mark.parametrize("straight,resumed", [
    ("etp2", "etp2_to_etp1"), ("etp2", "etp2_to_ep1_tp1"), ("etp1", "etp1_to_etp2"),
    ("etp1", "etp1_to_ep2_tp1"), ("tp4", "tp4_to_ep1_tp1")])
def test_an_expert_and_tensor_parallel_checkpoint_resumes_at_other_layouts(tp_runs, straight,
                                                                             resumed):
    _assert_resumes_straight(tp_runs[straight], tp_runs[resumed])


def test_the_expert_and_tensor_parallel_optimizer_state_matters(tp_runs):
    assert e2e.max_abs_diff(tp_runs["etp1"][SAVED_AT:], tp_runs["etp1_no_optim"]) > 1e-4


def _chunks(directory, key) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    from megatron.checkpointing.dist import storage
    md = storage.read_metadata(directory).state_dict_metadata[key]
    return {(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks}


@pytest.mark.parametrize("etp", [1, 2])
def test_experts_are_chunked_by_ep_and_etp_as_megatron_core_writes_them(tp_runs, etp):
    """fc1 ``[layers, experts, 2 F, H]`` (SwiGLU: the gate and up halves as separate chunks,
    each split over ETP) and fc2 ``[layers, experts, H, F]`` (F split over ETP), one chunk per
    (layer, expert) and ETP rank, as Megatron-Core's SequentialMLP.sharded_state_dict."""
    directory = tp_runs["root"] / f"etp{etp}" / f"iter_{SAVED_AT:07d}"
    hidden, ffn = 32, 24
    part = ffn // etp
    want_fc1 = {((layer, e, half * ffn + r * part, 0), (1, 1, part, hidden))
                for layer in range(2) for e in range(4) for half in range(2) for r in range(etp)}
    want_fc2 = {((layer, e, 0, r * part), (1, 1, hidden, part))
                for layer in range(2) for e in range(4) for r in range(etp)}
    assert _chunks(directory, FC1) == want_fc1
    assert _chunks(directory, FC2) == want_fc2
    assert _chunks(directory, "optimizer.state.exp_avg." + FC2) == want_fc2


def test_both_expert_tensor_parallel_sizes_write_the_same_global_tensors(tp_runs):
    """ETP=2 and ETP=1 train the same model (to 1e-5): their checkpoints (the plain and the
    distributed optimizer's) hold the same global expert weights and moments, with every
    expert's state written."""
    from megatron.checkpointing.dist import storage

    assert e2e.max_abs_diff(tp_runs["etp2"], tp_runs["etp1"]) <= TOL
    assert e2e.max_abs_diff(tp_runs["etp2"], tp_runs["tp4"]) <= TOL
    keys = [FC1, FC2, "decoder.layers.mlp.experts.experts.linear_fc1.bias",
            "decoder.layers.mlp.experts.experts.linear_fc2.bias",
            "optimizer.state.exp_avg." + FC1, "optimizer.state.exp_avg_sq." + FC2]
    read = {etp: storage.read_plain_tensors(tp_runs["root"] / f"etp{etp}" /
                                            f"iter_{SAVED_AT:07d}", keys) for etp in (1, 2)}
    for key in keys:
        assert read[2][key].shape == read[1][key].shape and read[2][key].shape[:2] == (2, 4)
        assert (read[2][key] - read[1][key]).abs().max() <= 1e-5, key
    moments = read[2]["optimizer.state.exp_avg." + FC1]
    assert all(moments[:, e].abs().sum() > 0 for e in range(4))
