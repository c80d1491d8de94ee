"""Training with expert parallelism through ``pretrain()``: a 4-expert, top-2 Llama-style MoE
GPT (shared expert, aux and z losses, gradient clipping) at EP=2 (the dense layers data
parallel over both ranks, each expert on one rank) and at EP=2 x DP=2 with the distributed
optimizer (expert state sharded over the expert-data-parallel group) equals the one-process
run from the same start weights: the loss every iteration to 1e-5, the gradient norm, and
every final parameter (the experts gathered over the expert-parallel group) in fp32; the
logged parameter norm counts each expert once."""

from __future__ import annotations

import pytest

from megatron.config.cli import build_parser, parse_flags
from megatron.config.validate import validate
from tests.training import e2e

ITERS = 3
SEQ = 16
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(ITERS),
         "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
         "--lr-warmup-iters", "1", "--clip-grad", "0.5", "--weight-decay", "0.01",
         "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
         "--make-vocab-size-divisible-by", "16", "--use-cpu-initialization",
         "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
         "--distributed-backend", "gloo",
         "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "48",
         "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-experts", "4",
         "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2", "--moe-aux-loss-coeff",
         "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-shared-expert-intermediate-size", "16"]
LOSS_TOL = 1e-5


def _run(extra=(), init: bool = True) -> dict:
    return {"argv": [*FLAGS, *extra], "params": True, "single_process_init": init}


def _tensorboard(path) -> list[str]:
    return ["--log-params-norm", "--tensorboard-dir", str(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ep_tensorboard")
    save = tmp_path_factory.mktemp("ep_checkpoint")
    single, = (r[0] for r in e2e.pooled(1, [_run(_tensorboard(logs / "single"), init=False)]))
    ep2_ag, ep2_a2a, resumed = e2e.pooled(2, [
        _run(["--expert-model-parallel-size", "2", *_tensorboard(logs / "ep2"),
              "--save", str(save), "--save-interval", "2"]),
        _run(["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
        _run(["--expert-model-parallel-size", "2", "--load", str(save), "--ckpt-step", "2"],
             init=False)])
    ep2_dp2, = e2e.pooled(4, [
        _run(["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
              "--moe-token-dispatcher-type", "alltoall"])])
    return {"single": single, "ep2_allgather": ep2_ag, "ep2_alltoall": ep2_a2a,
            "ep2_dp2_distopt": ep2_dp2, "logs": logs, "save": save, "resumed": resumed}


@pytest.mark.parametrize("layout", ["ep2_allgather", "ep2_alltoall", "ep2_dp2_distopt"])
def test_expert_parallel_equals_one_process(runs, layout):
    ref = runs["single"]
    assert len(e2e.losses(ref)) == ITERS and not any(h["skipped"] for h in ref["history"])
    for rank in runs[layout]:
        assert e2e.max_abs_diff(e2e.losses(ref), e2e.losses(rank)) <= LOSS_TOL, layout
        norms = [h["grad norm"] for h in rank["history"]]
        want = [h["grad norm"] for h in ref["history"]]
        assert all(n > 0 for n in want) and e2e.max_abs_diff(want, norms) <= 1e-5, (want, norms)
        assert set(rank["params"]) == set(ref["params"])
        assert e2e.max_param_diff(ref["params"], rank["params"]) <= 1e-5, layout
    # The run changed the experts (a comparison of untouched weights would prove nothing).
    name = next(n for n in ref["params"] if ".local_experts.3." in n)
    assert name in runs[layout][0]["params"]


def test_params_norm_counts_every_expert_once(runs):
    want = e2e.read_scalars(runs["logs"] / "single")["params-norm"]
    got = e2e.read_scalars(runs["logs"] / "ep2")["params-norm"]
    assert sorted(want) == sorted(got) == list(range(1, ITERS + 1))
    assert max(abs(want[i] - got[i]) for i in want) <= 1e-5, (want, got)


def test_checkpoint_has_one_directory_per_expert_rank(runs):
    import torch

    iteration = runs["save"] / "iter_0000002"
    assert sorted(p.name for p in iteration.iterdir() if p.is_dir()) == \
        ["mp_rank_00_000", "mp_rank_00_001"]
    for ep_rank in (0, 1):
        sd = torch.load(iteration / f"mp_rank_00_{ep_rank:03d}" / "model_optim_rng.pt",
                        weights_only=False)
        assert sd["args"].expert_model_parallel_size == 2
        keys = [k for k in e2e_flat_keys(sd["model"]) if ".local_experts." in k]
        # Local indices 0 and 1 on each rank (global = ep_rank * 2 + i).
        assert {k.split(".local_experts.")[1].split(".")[0] for k in keys} == {"0", "1"}
        weight = next(k for k in keys if k.endswith("layers.0.mlp.local_experts.1."
                                                    "dense_4h_to_h.weight"))
        assert weight  # a key the layout documents


def test_the_converter_reads_every_expert_of_an_expert_parallel_checkpoint(runs):
    """Its loader merges the mp_rank_00_EEE shards of the last save: every expert under its
    global index, equal to the run's final parameter."""
    import torch

    from tools.checkpoint.loader_megatron import MegatronCheckpoint

    source = MegatronCheckpoint(runs["save"], "GPT")
    try:
        assert source.ep == 2 and source.iteration == ITERS
        layer = source.layer(1)
    finally:
        source.close()
    params = runs["ep2_allgather"][0]["params"]
    for expert in range(4):
        suffix = f"layers.1.mlp.local_experts.{expert}.dense_4h_to_h.weight"
        trained, = (v for k, v in params.items() if k.endswith(suffix))
        assert torch.equal(layer["language_model.encoder." + suffix], trained), expert


def e2e_flat_keys(tree, prefix=""):
    """Every leaf key of a nested checkpoint state dict, dotted."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from e2e_flat_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_expert_parallel_resumes_exactly(runs):
    for straight, resumed in zip(runs["ep2_allgather"], runs["resumed"]):
        assert resumed["iteration"] == ITERS and len(resumed["history"]) == ITERS - 2
        assert e2e.max_abs_diff(e2e.losses(straight)[2:], e2e.losses(resumed)) <= 1e-6
        assert e2e.max_param_diff(straight["params"], resumed["params"]) <= 1e-6


def _validate(extra: list[str], world: int):
    return validate(parse_flags(build_parser(), [*FLAGS, *extra]), world_size=world)


@pytest.mark.parametrize("extra,world,named", [
    (["--DDP-impl", "torch"], 2, "--DDP-impl local"),
    (["--num-experts", "3", "--moe-router-topk", "2"], 2, "--num-experts (3)"),
])
def test_unbuilt_expert_parallel_combinations_are_refused(extra, world, named):
    with pytest.raises(ValueError) as err:
        _validate(["--expert-model-parallel-size", "2", *extra], world)
    assert named in str(err.value)
