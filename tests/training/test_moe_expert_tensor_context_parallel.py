"""Expert parallelism with tensor and context parallelism together (Megatron-Core's parallel
folding at TP=2 x CP=2 on 4 ranks): each rank routes its own tokens (sequence parallelism
splits the rows over TP, context parallelism the sequence over CP), the dispatcher exchanges
them over the expert grid's ETP x EP group, the balancing-loss counts span TP x CP
(``aux_loss``) or TP x DP x CP (``global_aux_loss`` and the expert-bias counts), the experts'
gradients are reduced over the expert-data-parallel group and the dense ones over DP x CP.

A 4-expert, top-2 Llama-style MoE GPT with biases (shared expert, aux and z losses, gradient
clipping) through ``pretrain()`` equals the one-process run from the same start weights: the
loss and the gradient norm every iteration, each layer's logged balancing and z losses, and
every final parameter (experts gathered over ETP and EP) in fp32, at

- EP=2 x ETP=2 (each expert split as the dense layers; alltoall dispatcher) with the
  per-micro-batch balancing loss and aux-loss-free balancing (sigmoid scores, expert bias),
  saved in ``torch_dist``: resumed exactly at the same layout, and with the uninterrupted
  run's losses and parameters at one process (TP=CP=EP=1) (other layouts' torch_dist resumes
  with expert parallelism: test_dist_checkpoint_expert_parallel.py);
- EP=4 x ETP=1 (each expert whole on one rank; allgather dispatcher) with the global balancing
  loss and the distributed optimizer, saved in the torch format (``mp_rank_TT_EEE``, the dense
  part of ``distrib_optim.pt`` in EP rank = TP rank's directory): resumed exactly, and at
  one process after tools/checkpoint/convert.py;
- EP=2 x ETP=1 (alltoall dispatcher): the expert-data-parallel groups are the CP groups, so
  the experts' gradients are reduced over the CP ranks of a sequence.

With DP=1 the global balancing loss's counts are those of the whole step, so the one-process
reference needs no coefficient change (at DP=d it would be the coefficient over d)."""

from __future__ import annotations

import pytest

from megatron.config.cli import build_parser, parse_flags
from megatron.config.validate import validate
from tests.training import e2e
from tests.training.test_moe_expert_parallel_training import FLAGS as EP_FLAGS
from tests.training.test_moe_expert_tensor_parallel_training import _rank_major

ITERS = 3
# The expert-parallel test's model with biases, larger balancing losses, per-layer logging.
_CHANGED = {"--moe-aux-loss-coeff": "1e-1", "--moe-z-loss-coeff": "1e-2"}
FLAGS = [_CHANGED.get(prev, flag) for prev, flag in zip([None, *EP_FLAGS], EP_FLAGS)
         if flag != "--disable-bias-linear"] + ["--moe-per-layer-logging"]
TP_CP = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--context-parallel-size", "2"]
EP2_ETP2 = [*TP_CP, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall"]
EP2_ETP1 = [*TP_CP, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
            "--moe-token-dispatcher-type", "alltoall"]
EP4_ETP1 = [*TP_CP, "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
            "--moe-token-dispatcher-type", "allgather"]
GLOBAL = ["--moe-router-load-balancing-type", "global_aux_loss"]
BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05"]
DIST = ["--ckpt-format", "torch_dist"]
DISTOPT = ["--use-distributed-optimizer"]
LOSS_TOL = 1e-5


def _run(extra=(), init: bool = True) -> dict:
    return {"argv": [*FLAGS, *extra], "params": True, "single_process_init": init}


def _saving(path) -> list[str]:
    return ["--save", str(path), "--save-interval", "2"]


def _loading(path) -> list[str]:
    return ["--load", str(path), "--ckpt-step", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dist = tmp_path_factory.mktemp("ep2_etp2_tp2_cp2_torch_dist")
    legacy = tmp_path_factory.mktemp("ep4_etp1_tp2_cp2_torch")
    single, single_bias, single_global = (r[0] for r in e2e.pooled(1, [
        _run(init=False), _run(BIAS, init=False), _run(GLOBAL, init=False)]))
    names = ["ep2_etp2", "ep2_etp2_resumed", "ep4_etp1",
             "ep4_etp1_resumed", "ep2_etp1"]
    four = e2e.pooled(4, [
        _run([*EP2_ETP2, *BIAS, *DIST, *_saving(dist)]),
        _run([*EP2_ETP2, *BIAS, *DIST, *_loading(dist)], init=False),
        _run([*EP4_ETP1, *GLOBAL, *DISTOPT, *_saving(legacy)]),
        _run([*EP4_ETP1, *GLOBAL, *DISTOPT, *_loading(legacy)], init=False),
        _run(EP2_ETP1)])
    at_one_process, = (r[0] for r in e2e.pooled(1, [
        _run([*BIAS, *DIST, *_loading(dist)], init=False)]))
    return {"single": single, "single_bias": single_bias, "single_global": single_global,
            **dict(zip(names, four)), "ep2_etp2_at_one_process": [at_one_process],
            "legacy": legacy}


LAYOUTS = [("ep2_etp2", "single_bias"), ("ep4_etp1", "single_global"), ("ep2_etp1", "single")]


@pytest.mark.parametrize("layout,single", LAYOUTS)
def test_ep_tp_cp_equals_one_process(runs, layout, single):
    ref = runs[single]
    assert len(e2e.losses(ref)) == ITERS and not any(h["skipped"] for h in ref["history"])
    want_norms = [h["grad norm"] for h in ref["history"]]
    names = [n for n in ref["history"][0] if "load_balancing_loss" in n or "z_loss" in n]
    assert "moe/z_loss_layer_1" in names and \
        any(n.endswith("load_balancing_loss_layer_1") for n in names), names
    # Megatron's rank-major SwiGLU fc1 shards (the experts' too where ETP is 2).
    want_params = _rank_major(ref["params"], "etp1" if layout.endswith("etp1") else layout)
    for rank in runs[layout]:
        assert rank["error"] is None, rank["error"]
        assert e2e.max_abs_diff(e2e.losses(ref), e2e.losses(rank)) <= LOSS_TOL, layout
        norms = [h["grad norm"] for h in rank["history"]]
        assert all(n > 0 for n in want_norms) and \
            e2e.max_abs_diff(want_norms, norms) <= 1e-5, (want_norms, norms)
        for name in names:
            a, b = [h[name] for h in ref["history"]], [h[name] for h in rank["history"]]
            assert e2e.max_abs_diff(a, b) <= 1e-5, (name, a, b)
        assert e2e.max_param_diff(want_params, rank["params"]) <= 1e-5, layout
    # The run trained the experts and their fc2 biases (untouched weights prove nothing).
    name = "language_model.encoder.layers.1.mlp.local_experts.3.dense_4h_to_h.bias"
    assert float(ref["params"][name].abs().max()) > 0


def test_the_global_loss_and_expert_bias_change_the_run(runs):
    """The layouts are compared with runs that differ from the plain one: their equality
    shows the expert-bias counts span TP x DP x CP and the global counts TP x CP."""
    plain = e2e.losses(runs["single"])
    for name in ("single_bias", "single_global"):
        assert e2e.max_abs_diff(plain, e2e.losses(runs[name])) > 1e-4, name
    assert "global_load_balancing_loss" in runs["single_global"]["history"][0]


@pytest.mark.parametrize("straight,resumed,exact", [
    ("ep2_etp2", "ep2_etp2_resumed", True), ("ep4_etp1", "ep4_etp1_resumed", True),
    ("ep2_etp2", "ep2_etp2_at_one_process", False)])
def test_resumes_as_the_uninterrupted_run(runs, straight, resumed, exact):
    """torch_dist at the same layout, at one process (the experts' ETP chunks and EP blocks
    and the dense TP slices merged, the expert bias restored); the torch format
    with the distributed optimizer at the same layout."""
    tol = 1e-6 if exact else LOSS_TOL
    first = runs[straight][0]
    for second in runs[resumed]:
        assert second["error"] is None, second["error"]
        assert second["iteration"] == ITERS and len(second["history"]) == ITERS - 2
        assert e2e.max_abs_diff(e2e.losses(first)[2:], e2e.losses(second)) <= tol
        # One process's SwiGLU fc1 [gate; up] in TP=2's rank-major order (ETP=2's experts too).
        got = _rank_major(second["params"], straight) if resumed.endswith("one_process") \
            else second["params"]
        assert e2e.max_param_diff(first["params"], got) <= tol


def test_torch_format_directories_are_tp_and_ep_ranks(runs):
    """ETP=1, EP=4 over TP=2 x CP=2: every rank writes its experts' directory; its TP rank is
    its EP rank mod 2 (Megatron's rank order)."""
    iteration = runs["legacy"] / "iter_0000002"
    assert sorted(p.name for p in iteration.iterdir() if p.is_dir()) == \
        ["mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001", "mp_rank_01_003"]


def _validate(extra: list[str], world: int):
    return validate(parse_flags(build_parser(), [*FLAGS, *extra]), world_size=world)


@pytest.mark.parametrize("extra,world", [(EP2_ETP2, 4), (EP4_ETP1, 4), ([*EP2_ETP2, *DIST], 8)])
def test_combinations_validate(extra, world):
    par = _validate(extra, world).parallel
    assert (par.tensor_model_parallel_size, par.context_parallel_size) == (2, 2)


def test_fewer_expert_than_tensor_ranks_in_the_torch_format_stays_refused(tmp_path):
    flags = ["--tensor-model-parallel-size", "4", "--sequence-parallel",
             "--context-parallel-size", "2", "--expert-model-parallel-size", "2",
             "--expert-tensor-parallel-size", "1", "--save", str(tmp_path)]
    with pytest.raises(ValueError, match="--ckpt-format torch_dist"):
        _validate(flags, 8)


@pytest.mark.parametrize("world,tp,cp,ep,etp", [(4, 2, 2, 2, 2), (4, 2, 2, 4, 1),
                                                (4, 2, 2, 2, 1), (8, 2, 2, 2, 1),
                                                (8, 2, 2, 2, 2)])
def test_the_expert_grid_over_tensor_and_context_parallel_ranks(world, tp, cp, ep, etp):
    """Why the layouts compose (no process group): the expert grid has no CP dimension, so at
    ETP = TP its tensor groups are the dense TP groups (each expert split as the dense
    layers), and the torch-format writers (expert-DP rank 0 of each EP group) are ranks
    0 ... ETP x EP - 1, which hold every (TP rank, EP rank) pair once when EP >= TP."""
    from megatron.checkpointing.experts import dense_expert_rank
    from megatron.core.expert_layout import expert_rank_layout
    from megatron.core.parallel_state import rank_layout

    dense = rank_layout(world, tp, context_parallel_size=cp)
    experts = expert_rank_layout(world, etp, ep)
    if etp == tp:
        assert experts.expert_tensor == dense.tensor
    if (world, etp, ep) == (4, 1, 2):  # the training test's EP=2 x ETP=1 layout
        assert experts.expert_data == dense.context == [[0, 2], [1, 3]]
    writers = sorted(group[0] for group in experts.expert_data)
    assert writers == list(range(etp * ep))
    ep_rank = {r: i for group in experts.expert_model for i, r in enumerate(group)}
    tp_rank = {r: i for group in dense.tensor for i, r in enumerate(group)}
    directories = {(tp_rank[r], ep_rank[r]) for r in writers}
    assert len(directories) == len(writers)
    assert {t for t, _ in directories} == set(range(tp))  # every dense TP slice written
    # The DP x CP rank 0 of each TP rank writes the dense part of distrib_optim.pt: into the
    # directory the loader reads it from.
    for group in dense.data_with_context:
        first = group[0]
        assert first in writers
        assert ep_rank[first] == dense_expert_rank(tp_rank[first], tp, etp), group


def test_the_torch_format_save_converts_to_one_rank(runs, tmp_path):
    """tools/checkpoint/convert.py reads the EP=4 x ETP=1 x TP=2 x CP=2 torch-format save (the
    CP ranks wrote other EP ranks' directories) with its distributed optimizer state and writes
    it at one rank; the one-process run resumes with the uninterrupted run's losses."""
    from tools.checkpoint import convert

    target = tmp_path / "one_rank"
    assert convert.main(["--model-type", "GPT", "--load-dir",
                         str(runs["legacy"] / "iter_0000002"), "--save-dir", str(target),
                         "--target-tensor-parallel-size", "1",
                         "--target-expert-parallel-size", "1", "--keep-optimizer-state",
                         "--no-target-use-distributed-optimizer"]) == 0
    resumed, = e2e.pooled(1, [{"argv": [*FLAGS, *GLOBAL, "--load", str(target)]}])
    assert resumed[0]["error"] is None, resumed[0]["error"]
    straight = e2e.losses(runs["ep4_etp1"][0])
    assert e2e.max_abs_diff(straight[2:], e2e.losses(resumed[0])) <= LOSS_TOL, \
        (straight, e2e.losses(resumed[0]))
