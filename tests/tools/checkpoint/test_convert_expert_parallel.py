"""Expert-parallel checkpoints through tools/checkpoint/convert.py and the distributed
optimizer, resumed through pretrain() on a 4-expert, top-2 MoE GPT (shared expert, aux and z
losses, clipping; tests.training.test_moe_expert_parallel_training's model):

* an EP=2 checkpoint with its optimizer state converted to EP=1 (and to EP=1 x TP=2 with
  sequence parallelism), and one converted back from EP=1 to EP=2, resume with the losses of
  the uninterrupted EP=2 run (fp32, 1e-5); without the optimizer state they differ;
* an EP=2 x TP=2 checkpoint with each expert whole on one rank (``--expert-tensor-parallel-size
  1``: files mp_rank_00_000 and mp_rank_01_001) converted to TP=1 at EP=1 and EP=2, and an
  EP=2 checkpoint converted to it (``--target-expert-tensor-parallel-size 1``), resume with
  the uninterrupted losses; ETP=1 -> TP=1 -> ETP=1 gives back the same files' tensors;
* EP=2 x DP=2 with the distributed optimizer saves Megatron-LM's ``[dense, expert]``
  ``distrib_optim.pt`` lists in each ``mp_rank_00_EEE`` and resumes exactly; converted to EP=1
  it resumes at DP=2 with the same losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training import e2e
from tests.training.test_moe_expert_parallel_training import FLAGS
from tools.checkpoint import convert

ITERS, SAVED_AT = 4, 2
TOL = 1e-5
EP2 = ["--expert-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]


def _flags(*extra) -> list[str]:
    flags = list(FLAGS)
    flags[flags.index("--train-iters") + 1] = str(ITERS)
    return [*flags, *extra]


def _run(*extra, init: bool = False) -> dict:
    return {"argv": _flags(*extra), "single_process_init": init}


def _convert(source: Path, target: Path, ep: int, tp: int = 1, keep: bool = True,
             distributed: bool | None = None, etp: int | None = None) -> None:
    argv = ["--model-type", "GPT", "--load-dir", str(source), "--save-dir", str(target),
            "--target-tensor-parallel-size", str(tp), "--target-expert-parallel-size", str(ep)]
    argv += [] if etp is None else ["--target-expert-tensor-parallel-size", str(etp)]
    argv += ["--keep-optimizer-state"] if keep else []
    if distributed is not None:
        argv.append("--target-use-distributed-optimizer" if distributed
                    else "--no-target-use-distributed-optimizer")
    assert convert.main(argv) == 0


def _losses(per_rank: list[dict]) -> list[float]:
    assert per_rank[0]["error"] is None, per_rank[0]["error"]
    return e2e.losses(per_rank[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_ep")
    save = ["--save-interval", str(SAVED_AT)]
    straight, = e2e.pooled(2, [_run(*EP2, "--save", str(root / "ep2"), *save, init=True)])
    distopt, distopt_resumed = e2e.pooled(4, [
        _run(*EP2, *DISTOPT, "--save", str(root / "ep2_distopt"), *save, init=True),
        _run(*EP2, *DISTOPT, "--load", str(root / "ep2_distopt"), "--ckpt-step",
             str(SAVED_AT))])
    source = root / "ep2" / f"iter_{SAVED_AT:07d}"
    _convert(source, root / "ep1", ep=1)
    _convert(source, root / "ep1_tp2", ep=1, tp=2)
    _convert(root / "ep1", root / "ep1_to_ep2", ep=2)
    _convert(source, root / "control", ep=1, keep=False)
    _convert(root / "ep2_distopt" / f"iter_{SAVED_AT:07d}", root / "distopt_ep1", ep=1)
    resumed = e2e.pooled(2, [
        _run("--load", str(root / "ep1")),
        _run("--load", str(root / "ep1_tp2"), "--tensor-model-parallel-size", "2",
             "--sequence-parallel"),
        _run(*EP2, "--load", str(root / "ep1_to_ep2")),
        _run("--load", str(root / "control"), "--no-load-optim"),
        _run(*DISTOPT, "--load", str(root / "distopt_ep1"))])
    names = ["ep1", "ep1_tp2_sp", "ep1_to_ep2", "control", "distopt_ep1"]
    return {"root": root, "straight": _losses(straight), "distopt": _losses(distopt),
            "distopt_resumed": _losses(distopt_resumed),
            **{name: _losses(result) for name, result in zip(names, resumed)}}


@pytest.mark.parametrize("name", ["ep1", "ep1_tp2_sp", "ep1_to_ep2"])
def test_a_converted_expert_parallel_checkpoint_resumes_the_uninterrupted_run(runs, name):
    straight = runs["straight"]
    assert len(straight) == ITERS and len(runs[name]) == ITERS - SAVED_AT
    assert e2e.max_abs_diff(straight[SAVED_AT:], runs[name]) <= TOL, (straight, runs[name])


def test_without_the_optimizer_state_the_losses_differ(runs):
    assert e2e.max_abs_diff(runs["straight"][SAVED_AT:], runs["control"]) > 1e-4


def test_the_converted_layouts_on_disk(runs):
    root = runs["root"]
    assert sorted(p.name for p in (root / "ep1" / f"iter_{SAVED_AT:07d}").iterdir()
                  if p.is_dir()) == ["mp_rank_00"]
    assert sorted(p.name for p in (root / "ep1_tp2" / f"iter_{SAVED_AT:07d}").iterdir()
                  if p.is_dir()) == ["mp_rank_00", "mp_rank_01"]
    back = root / "ep1_to_ep2" / f"iter_{SAVED_AT:07d}"
    source = root / "ep2" / f"iter_{SAVED_AT:07d}"
    for shard in ("mp_rank_00_000", "mp_rank_00_001"):
        before = torch.load(source / shard / "model_optim_rng.pt", weights_only=False)
        after = torch.load(back / shard / "model_optim_rng.pt", weights_only=False)
        assert after["args"].expert_model_parallel_size == 2
        flat_before, flat_after = dict(_leaves(before["model"])), dict(_leaves(after["model"]))
        assert list(flat_before) == list(flat_after)  # the same keys, in module order
        for key, value in flat_before.items():
            assert torch.equal(value, flat_after[key]), (shard, key)


def test_expert_parallel_distributed_optimizer_resumes_exactly(runs):
    straight = runs["distopt"]
    assert e2e.max_abs_diff(runs["straight"], straight) <= TOL
    assert e2e.max_abs_diff(straight[SAVED_AT:], runs["distopt_resumed"]) <= 1e-6
    assert e2e.max_abs_diff(straight[SAVED_AT:], runs["distopt_ep1"]) <= TOL


def test_distrib_optim_is_megatron_lms_dense_expert_list(runs):
    iteration = runs["root"] / "ep2_distopt" / f"iter_{SAVED_AT:07d}"
    first = torch.load(iteration / "mp_rank_00_000" / "distrib_optim.pt", weights_only=False)
    second = torch.load(iteration / "mp_rank_00_001" / "distrib_optim.pt", weights_only=False)
    assert isinstance(first, list) and len(first) == 2 and first[0] is not None
    assert second[0] is None and second[1] is not None
    # The experts' part is sharded over the expert-DP group (2 ranks), the dense over DP (4).
    (dtype, layout), = first[1]["layout"][0].items()
    assert layout["data_parallel_size"] == 2
    assert first[0]["layout"][0][dtype]["data_parallel_size"] == 4
    assert not torch.equal(first[1][0][dtype]["exp_avg"], second[1][0][dtype]["exp_avg"])


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_another_expert_tensor_split_and_unsplittable_targets_are_refused(tmp_path, capsys):
    """Experts split over more ranks than TP in the torch format (two writers would share a
    file name: a directory no run writes), and a target EP that does not divide the experts,
    are refused by flag before anything is written."""
    from tests.tools.checkpoint import helpers
    from tests.tools.checkpoint.test_convert_moe import MOE

    moe_args = dict(add_bias_linear=False, normalization="RMSNorm",
                    position_embedding_type="rope", swiglu=True, num_experts=4,
                    moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                    moe_shared_expert_gate=True)
    model = helpers.gpt(**MOE)
    helpers.save_single(tmp_path / "etp2", model,
                        helpers.args_of(model, expert_tensor_parallel_size=2, **moe_args))
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model, **moe_args))
    argv = ["--model-type", "GPT", "--save-dir", str(tmp_path / "out")]
    assert convert.main([*argv, "--load-dir", str(tmp_path / "etp2")]) == 2
    assert "--expert-tensor-parallel-size 2" in capsys.readouterr().err
    assert convert.main([*argv, "--load-dir", str(tmp_path / "src"),
                         "--target-expert-parallel-size", "3"]) == 2
    assert "--target-expert-parallel-size 3" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_distributed_optimizer_state_round_trips_over_ep_bitwise(runs, tmp_path):
    """EP=1 -> EP=2 (the [dense, expert] lists written per EP rank) -> EP=1 gives back the
    same distrib_optim.pt buffers and weights."""
    start = runs["root"] / "distopt_ep1"
    _convert(start, tmp_path / "ep2", ep=2)
    iteration = tmp_path / "ep2" / f"iter_{SAVED_AT:07d}"
    first = torch.load(iteration / "mp_rank_00_000" / "distrib_optim.pt", weights_only=False)
    second = torch.load(iteration / "mp_rank_00_001" / "distrib_optim.pt", weights_only=False)
    assert first[0] is not None and second[0] is None and second[1] is not None
    _convert(tmp_path / "ep2", tmp_path / "back", ep=1)
    before = torch.load(start / f"iter_{SAVED_AT:07d}" / "mp_rank_00" / "distrib_optim.pt",
                        weights_only=False)
    after = torch.load(tmp_path / "back" / f"iter_{SAVED_AT:07d}" / "mp_rank_00" /
                       "distrib_optim.pt", weights_only=False)
    (dtype, buffers), = before[0].items()
    assert set(after[0][dtype]) == set(buffers)
    for name, tensor in buffers.items():
        assert torch.equal(after[0][dtype][name], tensor), name


ETP1 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", *EP2,
        "--expert-tensor-parallel-size", "1"]


@pytest.fixture(scope="module")
def etp_runs(runs):
    root = runs["root"]
    straight, = e2e.pooled(4, [_run(*ETP1, "--save", str(root / "etp1"), "--save-interval",
                                    str(SAVED_AT), init=True)])
    source = root / "etp1" / f"iter_{SAVED_AT:07d}"
    _convert(source, root / "etp1_to_tp1", ep=1)
    _convert(source, root / "etp1_to_ep2", ep=2)
    _convert(root / "ep2" / f"iter_{SAVED_AT:07d}", root / "ep2_to_etp1", ep=2, tp=2, etp=1)
    _convert(root / "etp1_to_tp1", root / "etp1_back", ep=2, tp=2, etp=1)
    tp1, ep2 = e2e.pooled(2, [_run("--load", str(root / "etp1_to_tp1")),
                              _run(*EP2, "--load", str(root / "etp1_to_ep2"))])
    from_ep2, = e2e.pooled(4, [_run(*ETP1, "--load", str(root / "ep2_to_etp1"))])
    return {"root": root, "straight": _losses(straight), "tp1": _losses(tp1),
            "ep2": _losses(ep2), "from_ep2": _losses(from_ep2)}


@pytest.mark.parametrize("name,straight", [("tp1", "etp1"), ("ep2", "etp1"),
                                           ("from_ep2", "ep2")])
def test_an_expert_tensor_parallel_1_conversion_resumes_the_uninterrupted_run(
        runs, etp_runs, name, straight):
    want = etp_runs["straight"] if straight == "etp1" else runs["straight"]
    assert e2e.max_abs_diff(runs["straight"], etp_runs["straight"]) <= TOL  # same model
    assert len(etp_runs[name]) == ITERS - SAVED_AT
    assert e2e.max_abs_diff(want[SAVED_AT:], etp_runs[name]) <= TOL, (want, etp_runs[name])


def test_expert_tensor_parallel_1_round_trips_bitwise(etp_runs):
    root = etp_runs["root"]
    source, back = (root / name / f"iter_{SAVED_AT:07d}" for name in ("etp1", "etp1_back"))
    dirs = sorted(p.name for p in back.iterdir() if p.is_dir())
    assert dirs == sorted(p.name for p in source.iterdir() if p.is_dir()) == \
        ["mp_rank_00_000", "mp_rank_01_001"]
    for shard in dirs:
        before = torch.load(source / shard / "model_optim_rng.pt", weights_only=False)
        after = torch.load(back / shard / "model_optim_rng.pt", weights_only=False)
        assert after["args"].expert_tensor_parallel_size == 1
        flat_before, flat_after = dict(_leaves(before["model"])), dict(_leaves(after["model"]))
        assert list(flat_before) == list(flat_after)
        for key, value in flat_before.items():
            assert torch.equal(value, flat_after[key]), (shard, key)
        # fp32: the torch optimizer's state dict itself (fp16/bf16 wrap it with the mains).
        states = [sd["optimizer"].get("optimizer", sd["optimizer"])["state"]
                  for sd in (before, after)]
        assert len(states[0]) == len(states[1]) > 0
        for index, state in states[0].items():
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[name], states[1][index][name]), (shard, index, name)


def test_unwritable_expert_tensor_splits_are_refused(etp_runs, tmp_path, capsys):
    source = etp_runs["root"] / "etp1_to_tp1"
    argv = ["--model-type", "GPT", "--load-dir", str(source), "--save-dir", str(tmp_path / "o"),
            "--target-tensor-parallel-size", "2", "--target-expert-tensor-parallel-size", "1"]
    assert convert.main(argv) == 2  # ETP x EP 1 < TP 2: a dense slice would go unwritten
    err = capsys.readouterr().err
    assert "--target-expert-parallel-size 1" in err and "every TP slice" in err
    assert convert.main([*argv[:-1], "3"]) == 2
    assert "--target-expert-tensor-parallel-size 3" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
