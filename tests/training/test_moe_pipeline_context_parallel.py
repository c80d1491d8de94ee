"""A 4-layer, 4-expert, top-2 Llama-style MoE GPT (shared expert, aux and z losses, gradient
clipping) through ``pretrain()`` under pipeline and context parallelism equals the one-process
run from the same start weights (the loss every iteration to 1e-5, the gradient norm, every
final parameter in fp32, the experts gathered over the expert-parallel group):

- EP=2 x PP=2 (the expert grid's pipeline groups are the dense grid's), with the alltoall
  dispatcher (resuming exactly from its checkpoint, one directory per PP and EP rank), and with
  virtual pipeline stages, the allgather dispatcher and the distributed optimizer;
- CP=2 x PP=2 at EP=1 (the router's token counts summed over TP x CP, the aux loss's gradient
  scaled by CP as Megatron's schedules scale it), EP=2 x CP=2, and CP=2 x DP=2 with the
  sequence-level aux loss and aux-loss-free balancing (sigmoid scores; the expert-bias counts
  summed over DP x CP);
- the global balancing loss (``global_aux_loss``: token counts summed over TP x DP x CP and
  averaged over the micro-batches of the step) at CP=2 x PP=2, at CP=2 x DP=2 with aux-loss-free
  balancing, and at EP=2 (dense DP=4). Each DP rank's loss is its share of the global one and
  its gradient is averaged over DP, as in Megatron: DP=d with micro-batch 1 equals one process
  with micro-batch d and the coefficient over d (the logged loss, over its coefficient, equal).

Each layout also logs the same per-layer load-balancing and z losses as the one process."""

from __future__ import annotations

import pytest

from megatron.config.cli import build_parser, parse_flags
from megatron.config.validate import validate
from tests.training import e2e
from tests.training.test_moe_expert_parallel_training import FLAGS as EP_FLAGS

ITERS = 3
SEQ = 16
# The expert-parallel test's model with four layers (two per stage) and larger balancing losses.
_CHANGED = {"--num-layers": "4", "--moe-aux-loss-coeff": "1e-1", "--moe-z-loss-coeff": "1e-2"}
FLAGS = [_CHANGED.get(prev, flag) for prev, flag in zip([None, *EP_FLAGS], EP_FLAGS)] + \
    ["--moe-per-layer-logging"]
LOSS_TOL = 1e-5
EP2 = ["--expert-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]
GLOBAL = ["--moe-router-load-balancing-type", "global_aux_loss"]
GLOBAL_BIAS = [*GLOBAL, "--moe-router-score-function", "sigmoid",
               "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]


def _one_process_of_dp(dp: int, extra=()) -> list[str]:
    """The one-process flags equal to DP=dp at micro-batch 1 with the global balancing loss."""
    coeff = float(FLAGS[FLAGS.index("--moe-aux-loss-coeff") + 1]) / dp
    return [*extra, "--micro-batch-size", str(dp), "--moe-aux-loss-coeff", repr(coeff)]


BIAS_SEQ = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "0.05", "--moe-router-load-balancing-type",
            "seq_aux_loss"]


def _run(extra=(), init: bool = True) -> dict:
    return {"argv": [*FLAGS, *extra], "params": True, "single_process_init": init}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save = tmp_path_factory.mktemp("ep2_pp2_checkpoint")
    single, single_bias_seq, single_global, single_global_bias_dp2, single_global_dp4 = (
        r[0] for r in e2e.pooled(1, [
            _run(init=False), _run(BIAS_SEQ, init=False), _run(GLOBAL, init=False),
            _run(_one_process_of_dp(2, GLOBAL_BIAS), init=False),
            _run(_one_process_of_dp(4, GLOBAL), init=False)]))
    (ep2_pp2, resumed, ep2_vpp, cp2_pp2, ep2_cp2, cp2_dp2_bias_seq, cp2_pp2_global,
     cp2_dp2_global_bias, ep2_dp4_global) = e2e.pooled(4, [
        _run([*EP2, *PP2, "--moe-token-dispatcher-type", "alltoall", "--save", str(save),
              "--save-interval", "2"]),
        _run([*EP2, *PP2, "--moe-token-dispatcher-type", "alltoall", "--load", str(save),
              "--ckpt-step", "2"], init=False),
        _run([*EP2, *PP2, "--num-layers-per-virtual-pipeline-stage", "1",
              "--use-distributed-optimizer"]),
        _run([*CP2, *PP2]),
        _run([*EP2, *CP2, "--moe-token-dispatcher-type", "alltoall"]),
        _run([*CP2, *BIAS_SEQ]),
        _run([*CP2, *PP2, *GLOBAL]),
        _run([*CP2, *GLOBAL_BIAS, "--use-distributed-optimizer"]),
        _run([*EP2, *GLOBAL, "--moe-token-dispatcher-type", "alltoall"])])
    return {"single": single, "single_bias_seq": single_bias_seq, "ep2_pp2": ep2_pp2,
            "ep2_pp2_vpp2_distopt": ep2_vpp, "cp2_pp2": cp2_pp2, "ep2_cp2": ep2_cp2,
            "cp2_dp2_bias_seq": cp2_dp2_bias_seq, "resumed": resumed, "save": save,
            "single_global": single_global, "single_global_bias_dp2": single_global_bias_dp2,
            "single_global_dp4": single_global_dp4, "cp2_pp2_global": cp2_pp2_global,
            "cp2_dp2_global_bias": cp2_dp2_global_bias, "ep2_dp4_global": ep2_dp4_global}


LAYOUTS = [("ep2_pp2", "single"), ("ep2_pp2_vpp2_distopt", "single"), ("cp2_pp2", "single"),
           ("ep2_cp2", "single"), ("cp2_dp2_bias_seq", "single_bias_seq"),
           ("cp2_pp2_global", "single_global"), ("cp2_dp2_global_bias", "single_global_bias_dp2"),
           ("ep2_dp4_global", "single_global_dp4")]


@pytest.mark.parametrize("layout,single", LAYOUTS)
def test_layout_equals_one_process(runs, layout, single):
    ref = runs[single]
    assert len(e2e.losses(ref)) == ITERS and not any(h["skipped"] for h in ref["history"])
    for rank in runs[layout]:
        if rank["history"] and "lm loss" in rank["history"][0]:  # the last pipeline stage
            assert e2e.max_abs_diff(e2e.losses(ref), e2e.losses(rank)) <= LOSS_TOL, layout
        norms = [h["grad norm"] for h in rank["history"]]
        want = [h["grad norm"] for h in ref["history"]]
        assert all(n > 0 for n in want) and e2e.max_abs_diff(want, norms) <= 1e-5, (want, norms)
    params = {}
    for rank in runs[layout]:  # each pipeline stage holds its own layers
        params.update(rank["params"])
    assert set(params) == set(ref["params"])
    assert e2e.max_param_diff(ref["params"], params) <= 1e-5, layout
    for rank in runs[layout]:  # replicas agree
        assert e2e.max_param_diff({n: ref["params"][n] for n in rank["params"]},
                                  rank["params"]) <= 1e-5


@pytest.mark.parametrize("layout,single", LAYOUTS)
def test_aux_losses_logged_as_one_process(runs, layout, single):
    want = runs[single]["history"]
    names = [n for n in want[0] if "load_balancing_loss" in n or "z_loss" in n]
    assert any(n.endswith("load_balancing_loss_layer_3") for n in names) and \
        "moe/z_loss_layer_0" in names, names
    got = runs[layout][-1]["history"]
    for name in names:
        a, b = [h[name] for h in want], [h[name] for h in got]
        assert e2e.max_abs_diff(a, b) <= 1e-5, (name, a, b)


def test_global_balancing_loss_counts_span_the_data_parallel_ranks(runs):
    """The references differ from each other and from the plain run: the global loss, its
    coefficient and the expert bias each change the training, so the layouts' equality above
    shows the counts and the bias updates really span TP x DP x CP."""
    plain, glob = e2e.losses(runs["single"]), e2e.losses(runs["single_global"])
    assert e2e.max_abs_diff(plain, glob) > 1e-4
    name = "global_load_balancing_loss"
    assert name in runs["single_global"]["history"][0]
    for ref in ("single_global_bias_dp2", "single_global_dp4"):
        assert 0.5 < runs[ref]["history"][0][name] < 2.0  # about 1 near balance (over coeff)


def test_expert_bias_changes_the_run(runs):
    # The bias-and-sequence-loss layout compares against a run that differs from the plain one.
    assert e2e.max_abs_diff(e2e.losses(runs["single"]), e2e.losses(runs["single_bias_seq"])) \
        > 1e-4


def test_expert_and_pipeline_parallel_checkpoint_resumes_exactly(runs):
    iteration = runs["save"] / "iter_0000002"
    # Megatron-LM's mp_rank_TT_PPP_EEE: one directory per (PP, EP) rank.
    assert sorted(p.name for p in iteration.iterdir() if p.is_dir()) == \
        ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]
    for straight, resumed in zip(runs["ep2_pp2"], runs["resumed"]):
        assert resumed["iteration"] == ITERS and len(resumed["history"]) == ITERS - 2
        if "lm loss" in straight["history"][0]:
            assert e2e.max_abs_diff(e2e.losses(straight)[2:], e2e.losses(resumed)) <= 1e-6
        assert e2e.max_param_diff(straight["params"], resumed["params"]) <= 1e-6


def _validate(extra: list[str], world: int):
    return validate(parse_flags(build_parser(), [*FLAGS, *extra]), world_size=world)


@pytest.mark.parametrize("extra,world", [([*EP2, *PP2], 4), ([*EP2, *CP2], 4), (CP2, 2),
                                         ([*EP2, *PP2, *CP2], 8)])
def test_combinations_validate(extra, world):
    par = _validate(extra, world).parallel
    sizes = (par.expert_model_parallel_size, par.pipeline_model_parallel_size,
             par.context_parallel_size)
    assert sizes == tuple(2 if flag in extra else 1 for flag in (EP2[0], PP2[0], CP2[0]))
