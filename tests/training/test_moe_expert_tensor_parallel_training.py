"""Expert parallelism composed with tensor parallelism (Megatron-Core's parallel folding)
through ``pretrain()`` on 4 ranks: EP=2 x TP=2 with sequence parallelism, each expert split
over its expert tensor-parallel group (ETP=2, the default; alltoall dispatcher) or whole on
one rank (ETP=1; allgather dispatcher), equals the one-process run from the same start
weights: the loss every iteration to 1e-5, the gradient norm, and every final parameter
(experts gathered over ETP and EP) in fp32. The model has biases (fc2's is replicated over
ETP: counted once, kept equal). The checkpoints use Megatron-LM's ``mp_rank_TT_EEE``
directories (TP rank, EP rank); the runs resume exactly (ETP=1 with the plain optimizer, ETP=2
and ETP=1 with the distributed optimizer, whose checkpoints also resume after convert.py to one
rank, and ETP=2's converted to ETP=1); a load at another ETP is refused by name; the logged
parameter norm counts every expert once."""

from __future__ import annotations

import pytest

from tests.training import e2e
from tests.training.test_moe_expert_parallel_training import FLAGS, ITERS

BIASED = [f for f in FLAGS if f != "--disable-bias-linear"]
TP_EP = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--expert-model-parallel-size", "2"]
LOSS_TOL = 1e-5


def _run(extra=(), init: bool = True) -> dict:
    return {"argv": [*BIASED, *extra], "params": True, "single_process_init": init}


def _layout(etp: int, dispatcher: str, *extra: str) -> dict:
    return _run([*TP_EP, "--expert-tensor-parallel-size", str(etp),
                 "--moe-token-dispatcher-type", dispatcher, *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save = {etp: tmp_path_factory.mktemp(f"etp{etp}_checkpoint") for etp in (1, 2)}
    distopt = {etp: tmp_path_factory.mktemp(f"etp{etp}_distopt_checkpoint") for etp in (1, 2)}
    logs = tmp_path_factory.mktemp("etp_tensorboard")
    single, = (r[0] for r in e2e.pooled(1, [_run(_tensorboard(logs / "single"), init=False)]))
    saving = ("--save-interval", "2", "--save")
    # One dispatcher per ETP here (the other pairings at the layer, in float64:
    # tests/core/transformer/test_moe_expert_parallel.py).
    results = e2e.pooled(4, [
        _layout(2, "alltoall", *saving, str(save[2])),
        _layout(1, "allgather", *saving, str(save[1]), *_tensorboard(logs / "etp1")),
        {**_layout(1, "allgather", "--load", str(save[1]), "--ckpt-step", "2"),
         "single_process_init": False},
        *(run for etp, dispatcher in ((2, "alltoall"), (1, "allgather")) for run in (
            _layout(etp, dispatcher, "--use-distributed-optimizer", *saving, str(distopt[etp])),
            {**_layout(etp, dispatcher, "--use-distributed-optimizer", "--load",
                       str(distopt[etp]), "--ckpt-step", "2"), "single_process_init": False}))])
    names = ["etp2_alltoall", "etp1_allgather", "resumed", "etp2_distopt",
             "etp2_distopt_resumed", "etp1_distopt", "etp1_distopt_resumed"]
    return {"single": single, "save": save, "logs": logs, "distopt": distopt,
            **dict(zip(names, results))}


def _tensorboard(path) -> list[str]:
    return ["--log-params-norm", "--tensorboard-dir", str(path)]


@pytest.mark.parametrize("layout", ["etp2_alltoall", "etp1_allgather"])
def test_ep2_tp2_equals_one_process(runs, layout):
    ref = runs["single"]
    assert len(e2e.losses(ref)) == ITERS and not any(h["skipped"] for h in ref["history"])
    want = [h["grad norm"] for h in ref["history"]]
    for rank in runs[layout]:
        assert e2e.max_abs_diff(e2e.losses(ref), e2e.losses(rank)) <= LOSS_TOL, layout
        norms = [h["grad norm"] for h in rank["history"]]
        assert all(n > 0 for n in want) and e2e.max_abs_diff(want, norms) <= 1e-5, \
            (want, norms)
        # TP=2's gathered SwiGLU fc1 (dense and ETP=2 experts) is Megatron's rank-major
        # [gate_0; up_0; gate_1; up_1]: compared as the shards are laid out.
        assert set(rank["params"]) == set(ref["params"])
        assert e2e.max_param_diff(_rank_major(ref["params"], layout), rank["params"]) <= 1e-5
    # The run changed the experts and their fc2 biases (untouched weights prove nothing).
    name = "language_model.encoder.layers.1.mlp.local_experts.3.dense_4h_to_h.bias"
    assert name in ref["params"] and float(ref["params"][name].abs().max()) > 0


def test_params_norm_counts_every_expert_once(runs):
    # At ETP=1 the TP rank 1 holds experts of its own, their fc2 biases included.
    want = e2e.read_scalars(runs["logs"] / "single")["params-norm"]
    got = e2e.read_scalars(runs["logs"] / "etp1")["params-norm"]
    assert sorted(want) == sorted(got) == list(range(1, ITERS + 1))
    assert max(abs(want[i] - got[i]) for i in want) <= 1e-5, (want, got)


def _rank_major(params: dict, layout: str) -> dict:
    """The one-process SwiGLU fc1 weights ``[gate; up]`` in the order TP=2's shards gather to
    (the experts' only where ETP is 2)."""
    import torch

    out = dict(params)
    for name, value in params.items():
        if "dense_h_to_4h" not in name or (".local_experts." in name
                                           and layout.startswith("etp1")):
            continue
        gate, up = value.chunk(2, dim=0)
        out[name] = torch.cat([torch.cat([g, u]) for g, u in zip(gate.chunk(2), up.chunk(2))])
    return out


def test_checkpoint_directories_are_tp_and_ep_ranks(runs):
    # ETP=2: every rank holds its own (TP slice, experts); ETP=1: the TP rank is the EP rank
    # (the EP group is the TP pair), the DP replica writes nothing.
    got = {etp: sorted(p.name for p in (runs["save"][etp] / "iter_0000002").iterdir()
                       if p.is_dir()) for etp in (1, 2)}
    assert got[2] == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert got[1] == ["mp_rank_00_000", "mp_rank_01_001"]


@pytest.mark.parametrize("straight,resumed", [("etp1_allgather", "resumed"),
                                               ("etp2_distopt", "etp2_distopt_resumed"),
                                               ("etp1_distopt", "etp1_distopt_resumed")])
def test_ep2_tp2_resumes_exactly(runs, straight, resumed):
    """The plain optimizer at ETP=1, the distributed optimizer at ETP=2 and 1 (its
    distrib_optim.pt: the dense part in the directory of each TP rank's data-parallel rank 0,
    EP rank 0's at ETP=2 and EP rank = TP rank's at ETP=1; the experts' in each EP rank's)."""
    for first, second in zip(runs[straight], runs[resumed]):
        assert second["iteration"] == ITERS and len(second["history"]) == ITERS - 2
        assert e2e.max_abs_diff(e2e.losses(first)[2:], e2e.losses(second)) <= 1e-6
        assert e2e.max_param_diff(first["params"], second["params"]) <= 1e-6
    # The distributed optimizer trains the same model as the plain one.
    for etp in ("etp2_distopt", "etp1_distopt"):
        assert e2e.max_abs_diff(e2e.losses(runs["etp2_alltoall"][0]),
                                e2e.losses(runs[etp][0])) <= LOSS_TOL


def test_loading_at_another_expert_tensor_parallel_size_is_refused(runs):
    import torch

    from megatron.checkpointing.compat import check_compatible
    from megatron.checkpointing.errors import CheckpointError
    from megatron.config.cli import build_parser, parse_flags
    from megatron.config.validate import validate

    shard = runs["save"][2] / "iter_0000002" / "mp_rank_00_000" / "model_optim_rng.pt"
    saved = torch.load(shard, weights_only=False)["args"]
    assert saved.expert_tensor_parallel_size == 2
    flags = [*BIASED, *TP_EP, "--expert-tensor-parallel-size", "1"]
    cfg = validate(parse_flags(build_parser(), flags), world_size=4)
    with pytest.raises(CheckpointError, match="--expert-tensor-parallel-size: checkpoint 2, "
                                              "flags 1"):
        check_compatible(saved, cfg, shard)


@pytest.mark.parametrize("etp", [2, 1])
def test_the_distributed_optimizer_checkpoint_converts_to_one_rank(runs, tmp_path, etp):
    """The ETP=2 and ETP=1 distributed-optimizer checkpoints converted by
    tools/checkpoint/convert.py to EP=1 x TP=1 with their optimizer state (the plain
    optimizer's) resume with the uninterrupted run's losses."""
    from tools.checkpoint import convert

    target = tmp_path / "ep1_tp1"
    source = runs["distopt"][etp] / "iter_0000002"
    assert convert.main(["--model-type", "GPT", "--load-dir", str(source),
                         "--save-dir", str(target), "--target-tensor-parallel-size", "1",
                         "--target-expert-parallel-size", "1", "--keep-optimizer-state",
                         "--no-target-use-distributed-optimizer"]) == 0
    resumed, = e2e.pooled(1, [{"argv": [*BIASED, "--load", str(target)]}])
    assert resumed[0]["error"] is None, resumed[0]["error"]
    straight = e2e.losses(runs[f"etp{etp}_distopt"][0])
    assert e2e.max_abs_diff(straight[2:], e2e.losses(resumed[0])) <= LOSS_TOL, \
        (straight, e2e.losses(resumed[0]))


def test_a_conversion_to_etp1_with_the_distributed_optimizer_resumes(runs, tmp_path):
    """convert.py writes the ETP=2 distributed-optimizer checkpoint at ETP=1 (the dense part
    of each TP rank's distrib_optim.pt in EP rank = TP rank's directory); the ETP=1 run
    resumes from it with the uninterrupted run's losses."""
    from tools.checkpoint import convert

    target = tmp_path / "etp1"
    assert convert.main(["--model-type", "GPT", "--load-dir",
                         str(runs["distopt"][2] / "iter_0000002"), "--save-dir", str(target),
                         "--target-tensor-parallel-size", "2", "--target-expert-parallel-size",
                         "2", "--target-expert-tensor-parallel-size", "1",
                         "--keep-optimizer-state", "--target-use-distributed-optimizer"]) == 0
    resumed = e2e.pooled(4, [{**_layout(1, "allgather", "--use-distributed-optimizer",
                                        "--load", str(target)),
                              "single_process_init": False, "params": False}])[0]
    straight = e2e.losses(runs["etp2_distopt"][0])
    for rank in resumed:
        assert rank["error"] is None, rank["error"]
        assert e2e.max_abs_diff(straight[2:], e2e.losses(rank)) <= LOSS_TOL, \
            (straight, e2e.losses(rank))
