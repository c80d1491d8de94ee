"""The torch format on the expert grid where a rank's experts and its dense TP slice are in two
files (TP not dividing ETP x EP, e.g. TP=2, ETP=1, EP=3: rank 3 holds TP slice 1 and EP rank
0's experts, both written by other ranks): the model tensors, RNG states and non-distributed
optimizer state are combined from the two files by what each holds, and such a run on 6 ranks
resumes exactly with the plain and the distributed optimizer."""

from __future__ import annotations

import types

import pytest
import torch

from megatron.training.checkpointing import _with_dense_part

DENSE_KEY = "layers.0.mlp.router.weight"
EXPERT_KEY = "layers.0.mlp.local_experts.0.dense_h_to_4h.weight"


def _file(dense: float, expert: float, mixed: bool) -> dict:
    torch_sd = {"state": {0: {"exp_avg": torch.tensor([dense])},
                          1: {"exp_avg": torch.tensor([expert])}},
                "param_groups": [{"params": [0, 1], "lr": 0.1}]}
    optimizer = {"optimizer": torch_sd,
                 "fp32_from_fp16_params": [[torch.tensor([dense]), torch.tensor([expert])]]} \
        if mixed else torch_sd
    return {"model": {"language_model": {"encoder": {
                DENSE_KEY: torch.tensor([dense]), EXPERT_KEY: torch.tensor([expert])}}},
            "rng_state": [{"who": dense}], "iteration": 2, "optimizer": optimizer}


def _optimizer(mixed: bool):
    dense, expert = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    expert.allreduce = False
    inner = torch.optim.Adam([dense, expert])
    return types.SimpleNamespace(optimizer=inner,
                                 fp32_from_float16_groups=[[dense, expert]] if mixed else None)


def test_a_rank_combines_its_dense_and_expert_files():
    for mixed in (False, True):
        dense_file, expert_file = _file(1.0, 10.0, mixed), _file(2.0, 20.0, mixed)
        got = _with_dense_part(expert_file, dense_file, _optimizer(mixed))
        layer = got["model"]["language_model"]["encoder"]
        assert float(layer[DENSE_KEY]) == 1.0 and float(layer[EXPERT_KEY]) == 20.0
        assert list(layer) == [DENSE_KEY, EXPERT_KEY]
        assert got["rng_state"] == [{"who": 1.0}] and got["iteration"] == 2
        inner = got["optimizer"]["optimizer"] if mixed else got["optimizer"]
        assert float(inner["state"][0]["exp_avg"]) == 1.0
        assert float(inner["state"][1]["exp_avg"]) == 20.0
        if mixed:
            assert [float(t) for t in got["optimizer"]["fp32_from_fp16_params"][0]] == \
                [1.0, 20.0]


def test_the_distributed_optimizers_groups_pass_through():
    """Its per-parameter state is in distrib_optim.pt ([dense, expert] lists)."""
    groups = {"optimizer": {"param_groups": [{"lr": 0.1}]}}
    dense_file, expert_file = _file(1.0, 10.0, False), _file(2.0, 20.0, False)
    dense_file["optimizer"], expert_file["optimizer"] = groups, dict(groups)
    got = _with_dense_part(expert_file, dense_file, _optimizer(False))
    assert got["optimizer"] == groups


@pytest.fixture(scope="module")
def six_ranks(tmp_path_factory):
    from tests.training import e2e
    from tests.training.test_moe_expert_tensor_parallel_folding import BIASED

    flags = list(BIASED)
    flags[flags.index("--num-experts") + 1] = "3"
    flags[flags.index("--global-batch-size") + 1] = "6"
    flags += ["--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "3"]
    save = {kind: tmp_path_factory.mktemp(kind) for kind in ("plain", "distopt")}
    extra = {"plain": [], "distopt": ["--use-distributed-optimizer",
                                      "--moe-token-dispatcher-type", "alltoall"]}
    runs = [run for kind in save for run in (
        {"argv": [*flags, *extra[kind], "--save", str(save[kind]), "--save-interval", "2"],
         "params": True},
        {"argv": [*flags, *extra[kind], "--load", str(save[kind]), "--ckpt-step", "2"],
         "params": True})]
    results = e2e.pooled(6, runs)
    return save, dict(zip(["plain", "plain_resumed", "distopt", "distopt_resumed"], results))


@pytest.mark.parametrize("kind", ["plain", "distopt"])
def test_tp2_etp1_ep3_resumes_exactly(six_ranks, kind):
    from tests.training import e2e

    save, runs = six_ranks
    # In-stage rank r < ETP x EP = 3 writes mp_rank_{r % 2}_{r}: ranks 3-5 read two files.
    assert sorted(p.name for p in (save[kind] / "iter_0000002").iterdir() if p.is_dir()) == \
        ["mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001"]
    for first, second in zip(runs[kind], runs[f"{kind}_resumed"]):
        assert second["error"] is None, second["error"]
        assert len(second["history"]) == 1 and second["iteration"] == 3
        assert e2e.max_abs_diff(e2e.losses(first)[2:], e2e.losses(second)) <= 1e-6
        assert e2e.max_param_diff(first["params"], second["params"]) <= 1e-6


@pytest.fixture(scope="module")
def dense_stage(tmp_path_factory):
    """PP=2 x EP=2 with the distributed optimizer, MoE layers on the first stage only
    (``--moe-layer-freq [1,1,0,0]``): the second stage's ranks have no expert state."""
    from tests.training import e2e
    from tests.training.test_moe_expert_tensor_parallel_folding import BIASED

    flags = list(BIASED)
    flags[flags.index("--num-layers") + 1] = "4"
    flags += ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
              "--moe-layer-freq", "[1,1,0,0]", "--use-distributed-optimizer"]
    save = tmp_path_factory.mktemp("dense_stage")
    return e2e.pooled(4, [
        {"argv": [*flags, "--save", str(save), "--save-interval", "2"], "params": True},
        {"argv": [*flags, "--load", str(save), "--ckpt-step", "2"], "params": True}])


def test_a_stage_without_moe_layers_resumes_its_dense_optimizer_state(dense_stage):
    """The second stage's EP rank 1 reads the dense distrib_optim.pt of its TP rank's
    data-parallel rank 0 (EP rank 0's directory), not its own directory's (none there)."""
    from tests.training import e2e

    straight, resumed = dense_stage
    for first, second in zip(straight, resumed):
        assert second["error"] is None, second["error"]
        assert second["iteration"] == first["iteration"]
        if "lm loss" in first["history"][0]:  # the last stage's ranks
            assert e2e.max_abs_diff(e2e.losses(first)[2:], e2e.losses(second)) <= 1e-6
        assert e2e.max_param_diff(first["params"], second["params"]) <= 1e-6
