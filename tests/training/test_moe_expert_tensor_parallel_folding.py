"""Any ``--expert-tensor-parallel-size`` (Megatron-Core's parallel folding) through
``pretrain()`` on 4 ranks: the experts split over more ranks than the dense layers (TP=1,
ETP=2, EP=2), over fewer (TP=4 with sequence parallelism, ETP=2, EP=2) and on a folded grid
without expert parallelism (TP=2, ETP=1, EP=1: each expert whole, its gradients reduced over
the TP pair) each equal the one-process run from the same start weights with the alltoall and
allgather dispatchers and the distributed optimizer: the loss every iteration to 1e-5, the
gradient norm and every final parameter. The torch format resumes exactly where its
``mp_rank_TT_EEE`` files hold the layout (TP=4, ETP=2: ranks of expert-DP rank 0 write), also
after convert.py re-splits it to ETP=1 at other TP / EP sizes with the optimizer state;
``torch_dist`` resumes at other TP / ETP / EP sizes."""

from __future__ import annotations

import pytest
import torch

from tests.training import e2e
from tests.training.test_moe_expert_parallel_training import FLAGS, ITERS

BIASED = [f for f in FLAGS if f != "--disable-bias-linear"]
LOSS_TOL = 1e-5
DISTOPT = ["--use-distributed-optimizer"]
TORCH_DIST = ["--ckpt-format", "torch_dist"]
LAYOUTS = {  # name -> (TP, ETP, EP)
    "tp4_etp2_ep2": (4, 2, 2), "tp1_etp2_ep2": (1, 2, 2), "tp2_etp1_ep1": (2, 1, 1),
    "tp2_etp1_ep2": (2, 1, 2), "tp1_etp1_ep4": (1, 1, 4)}


def _layout(name: str, dispatcher: str, *extra: str, init: bool = True) -> dict:
    tp, etp, ep = LAYOUTS[name]
    argv = [*BIASED, "--tensor-model-parallel-size", str(tp),
            "--expert-tensor-parallel-size", str(etp), "--expert-model-parallel-size", str(ep),
            "--moe-token-dispatcher-type", dispatcher, *extra]
    if tp > 1:
        argv.append("--sequence-parallel")
    return {"argv": argv, "params": True, "single_process_init": init}


def _resume(name: str, dispatcher: str, load, *extra: str) -> dict:
    return _layout(name, dispatcher, "--load", str(load), "--ckpt-step", "2", *extra,
                   init=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save = {key: tmp_path_factory.mktemp(key) for key in ("torch_distopt", "dist_tp1")}
    saving = ("--save-interval", "2", "--save")
    single, = (r[0] for r in e2e.pooled(1, [{"argv": BIASED, "params": True}]))
    # Each dispatcher and each optimizer at least once; the resumes that other files cover at
    # ETP 1 or TP (the same layout in torch_dist, the plain optimizer's torch files) left out.
    plan = {
        "tp4_etp2_ep2/alltoall+distopt": _layout("tp4_etp2_ep2", "alltoall", *DISTOPT,
                                                 *saving, str(save["torch_distopt"])),
        "tp4/distopt_resumed": _resume("tp4_etp2_ep2", "allgather", save["torch_distopt"],
                                       *DISTOPT),
        "tp1_etp2_ep2/allgather": _layout("tp1_etp2_ep2", "allgather", *TORCH_DIST, *saving,
                                          str(save["dist_tp1"])),
        "tp2_etp1_ep1/alltoall+distopt": _layout("tp2_etp1_ep1", "alltoall", *DISTOPT),
        # torch_dist at other sizes: TP=1 ETP=2 EP=2's at TP=2 ETP=1 EP=1.
        "tp1_saved/tp2_resumed": _resume("tp2_etp1_ep1", "alltoall", save["dist_tp1"],
                                         *DISTOPT, *TORCH_DIST),
    }
    results = dict(zip(plan, e2e.pooled(4, list(plan.values()))))
    return {"single": single, "save": save, **results}


STRAIGHT = ["tp4_etp2_ep2/alltoall+distopt", "tp1_etp2_ep2/allgather",
            "tp2_etp1_ep1/alltoall+distopt"]


def _rank_major(params: dict, tp: int, etp: int) -> dict:
    """The one-process SwiGLU fc1 weights ``[gate; up]`` in the order the shards gather to:
    ``[gate_0; up_0; gate_1; up_1 ...]`` over TP (dense) or ETP (routed experts)."""
    import torch

    out = dict(params)
    for name, value in params.items():
        parts = etp if ".local_experts." in name else tp
        if "dense_h_to_4h" not in name or parts == 1:
            continue
        gate, up = value.chunk(2, dim=0)
        out[name] = torch.cat([torch.cat([g, u]) for g, u in
                               zip(gate.chunk(parts), up.chunk(parts))])
    return out


@pytest.mark.parametrize("name", STRAIGHT)
def test_layout_equals_one_process(runs, name):
    ref = runs["single"]
    assert len(e2e.losses(ref)) == ITERS and not any(h["skipped"] for h in ref["history"])
    want = [h["grad norm"] for h in ref["history"]]
    tp, etp, _ = LAYOUTS[name.split("/")[0]]
    expected = _rank_major(ref["params"], tp, etp)
    for rank in runs[name]:
        assert rank["error"] is None, rank["error"]
        assert e2e.max_abs_diff(e2e.losses(ref), e2e.losses(rank)) <= LOSS_TOL, name
        norms = [h["grad norm"] for h in rank["history"]]
        assert all(n > 0 for n in want) and e2e.max_abs_diff(want, norms) <= 1e-5, \
            (want, norms)
        assert set(rank["params"]) == set(ref["params"])
        assert e2e.max_param_diff(expected, rank["params"]) <= 1e-5
    # The run moved the experts (untouched weights prove nothing).
    name = "language_model.encoder.layers.1.mlp.local_experts.3.dense_4h_to_h.bias"
    assert float(ref["params"][name].abs().max()) > 0


def test_torch_format_writers_are_the_expert_data_parallel_rank_0_ranks(runs):
    # TP=4 ETP=2 EP=2: in-stage rank r writes mp_rank_{r % TP}_{r // ETP}.
    got = sorted(p.name for p in (runs["save"]["torch_distopt"] / "iter_0000002").iterdir()
                 if p.is_dir())
    assert got == ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_02_001", "mp_rank_03_001"]


@pytest.mark.parametrize("straight,resumed", [
    ("tp4_etp2_ep2/alltoall+distopt", "tp4/distopt_resumed")])
def test_resumes_exactly(runs, straight, resumed):
    for first, second in zip(runs[straight], runs[resumed]):
        assert second["error"] is None, second["error"]
        assert second["iteration"] == ITERS and len(second["history"]) == ITERS - 2
        assert e2e.max_abs_diff(e2e.losses(first)[2:], e2e.losses(second)) <= 1e-6
        assert e2e.max_param_diff(first["params"], second["params"]) <= 1e-6


@pytest.mark.parametrize("straight,resumed", [
    ("tp1_etp2_ep2/allgather", "tp1_saved/tp2_resumed")])
def test_torch_dist_resumes_at_another_expert_layout(runs, straight, resumed):
    for rank in runs[resumed]:
        assert rank["error"] is None, rank["error"]
        assert rank["iteration"] == ITERS
        assert e2e.max_abs_diff(e2e.losses(runs[straight][0])[2:], e2e.losses(rank)) \
            <= LOSS_TOL


def test_torch_format_converts_to_other_expert_tensor_parallel_sizes(runs, tmp_path):
    """convert.py reads TP=4 ETP=2 EP=2 (each expert's two ETP slices from files of two TP
    ranks, the distributed optimizer's [dense, expert] lists) and writes ETP=1 at TP=2 EP=2
    with the plain optimizer (files mp_rank_00_000 and mp_rank_01_001) and at TP=1 EP=4 with
    the distributed optimizer: both resume with the uninterrupted run's losses."""
    from tools.checkpoint import convert

    targets = {"tp2_etp1_ep2": tmp_path / "tp2_etp1_ep2", "tp1_etp1_ep4": tmp_path / "ep4"}
    for (source, distributed), (name, target) in zip(
            (("torch_distopt", False), ("torch_distopt", True)), targets.items()):
        tp, etp, ep = LAYOUTS[name]
        assert convert.main([
            "--model-type", "GPT", "--load-dir", str(runs["save"][source] / "iter_0000002"),
            "--save-dir", str(target), "--target-tensor-parallel-size", str(tp),
            "--target-expert-parallel-size", str(ep),
            "--target-expert-tensor-parallel-size", str(etp), "--keep-optimizer-state",
            "--target-use-distributed-optimizer" if distributed
            else "--no-target-use-distributed-optimizer"]) == 0
    assert sorted(p.name for p in (targets["tp2_etp1_ep2"] / "iter_0000002").iterdir()
                  if p.is_dir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    resumed = e2e.pooled(4, [
        _layout("tp2_etp1_ep2", "alltoall", "--load", str(targets["tp2_etp1_ep2"]), init=False),
        _layout("tp1_etp1_ep4", "allgather", "--load", str(targets["tp1_etp1_ep4"]), *DISTOPT,
                init=False)])
    for per_rank in resumed:
        want = e2e.losses(runs["tp4_etp2_ep2/alltoall+distopt"][0])[2:]
        for rank in per_rank:
            assert rank["error"] is None, rank["error"]
            assert e2e.max_abs_diff(want, e2e.losses(rank)) <= LOSS_TOL, \
                (want, e2e.losses(rank))


def test_both_formats_convert_to_one_rank_with_the_same_weights(runs, tmp_path):
    """The torch_dist checkpoint of TP=1 x ETP=2 x EP=2 and the torch one of TP=4 x ETP=2 x
    EP=2 (each expert's ETP slices in two files), converted to one rank, hold the same weights
    (the two runs trained the same model)."""
    from tools.checkpoint import convert

    flat = {}
    for source, fmt in (("dist_tp1", "torch_dist"), ("torch_distopt", "torch")):
        assert convert.main(["--model-type", "GPT", "--source-ckpt-format", fmt,
                             "--load-dir", str(runs["save"][source] / "iter_0000002"),
                             "--save-dir", str(tmp_path / source)]) == 0
        shard, = (tmp_path / source).glob("iter_*/mp_rank_00/model_optim_rng.pt")
        sd = torch.load(shard, weights_only=False)
        assert sd["iteration"] == 2
        assert sd["args"].expert_tensor_parallel_size == 1
        flat[source] = dict(_leaves(sd["model"]))
    assert set(flat["dist_tp1"]) == set(flat["torch_distopt"])
    assert any(".local_experts.3." in key for key in flat["torch_distopt"])
    assert e2e.max_param_diff(flat["dist_tp1"], flat["torch_distopt"]) <= 1e-5


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value.float()
