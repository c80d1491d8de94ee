"""Pipeline parallelism through ``pretrain()`` equals one process.

A GPT of 8 layers (hidden 64, GPT-2 vocabulary padded to 50304, seq 32, global batch 4 of
micro-batches of 1, fp32, dropout 0) trains for 6 iterations in every layout below and must give
the one-process loss at every iteration (on the last pipeline stage, which holds it) to 1e-5 and
the same final parameters (every stage's, TP-gathered, renumbered to global layers, merged) to
2e-5. Megatron seeds stage ``p`` with ``seed + 100 p``, so each stage starts from the one-process
run's initial weights (``single_process_init``): the same starting point, as Megatron's own
equivalence runs load one seed checkpoint.

Layouts: PP=2 (tied and untied embeddings), PP=4, PP=2 x VPP=2, PP=4 x VPP=2, TP=2 x PP=2 (with
the distributed optimizer, and with block recomputation), PP=2 x VPP=2 x DP=2 with the
distributed optimizer, PP=2 x DP=2 with PyTorch's DDP, TP=2 x PP=2 x DP=2 x VPP=2 with
overlapped bucketed grad reduction and uniform recomputation; bf16 at PP=2 (to bf16
tolerance). Plus: fp16 with an inf on one stage skips the step everywhere; exact
resume at PP=2 and PP=2 x VPP=2; evaluation and ``--skip-train``; a checkpoint of another
pipeline split is refused. ``pretrain_gpt.py`` under torchrun at PP=2 is the fault suite's
reference job (``tests/faults/test_signals.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.checkpointing import CheckpointError
from tests.training import e2e

ITERS = 6
LAYERS = ["--num-layers", "8"]
SHAPE = {"iters": ITERS, "seq": 32, "mbs": 1, "gbs": 4}
EVAL = ["--eval-interval", "3", "--eval-iters", "2"]
LOSS_TOL = 1e-5
PARAM_TOL = 2e-5
RESUME_TOL = 1e-6
GRAD_NORM_RTOL = 1e-3
# bf16 GEMMs are slow on CPUs without AVX512-BF16/AMX: a shorter run, bf16 tolerances (as
# test_parallel_equivalence.py: other reduction orders in a bf16 forward).
BF16_SHAPE = {"iters": 4, "seq": 16}
BF16_LOSS_TOL = 1e-3
UNTIED = ["--untie-embeddings-and-output-weights"]
EMBEDDING = "language_model.embedding.word_embeddings.weight"
HEAD_COPY = "word_embeddings.weight"


def _pp(pp: int, vpp_layers: int | None = None) -> list[str]:
    flags = ["--pipeline-model-parallel-size", str(pp)]
    if vpp_layers is not None:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(vpp_layers)]
    return flags


def _run(corpus, tp: int = 1, extra=(), init: bool = True, **shape) -> dict:
    argv = e2e.gpt_argv(corpus, tp=tp, **{**SHAPE, **shape}, extra=[*LAYERS, *extra])
    # A small DDP bucket gives several buckets, so overlap really reduces bucket by bucket.
    return {"argv": argv, "params": True, "single_process_init": init,
            "bucket_size": 20_000 if "--overlap-grad-reduce" in extra else None}


# name: (TP, extra flags); PP (and VPP) in the flags, DP = world / (TP x PP).
_TWO = {"pp2": (1, [*_pp(2), *EVAL]),
        "pp2_untied": (1, [*_pp(2), *UNTIED]),
        "pp2_vpp2": (1, [*_pp(2, 2), *EVAL])}
# Untied embeddings: pp2_untied (the same code at any PP). Plain TP=2 x PP=2: inside both
# tp2pp2_* runs (recomputation changes no value; the distributed optimizer only the update).
_FOUR = {"pp4": (1, [*_pp(4), *EVAL]),
         "pp4_vpp2": (1, _pp(4, 1)),
         "tp2pp2_distopt": (2, [*_pp(2), "--use-distributed-optimizer"]),
         "tp2pp2_recompute_block": (2, [*_pp(2), "--recompute-granularity", "full",
                                        "--recompute-method", "block",
                                        "--recompute-num-layers", "2"]),
         "pp2vpp2dp2_distopt": (1, [*_pp(2, 2), "--use-distributed-optimizer"]),
         # PyTorch's DDP arms its reduction in forward, which the schedules run under no_sync.
         "pp2dp2_torch_ddp": (1, [*_pp(2), "--DDP-impl", "torch"])}
# Eight ranks cost ~20 s a run on 2 cores: one run of TP x PP x DP, with overlap, VPP and
# recomputation (each changes a different part: grad reduction, schedule, forward replay). The
# distributed optimizer with PP and DP is pp2vpp2dp2_distopt's, with TP and PP tp2pp2_distopt's.
_EIGHT = {"tp2pp2dp2_vpp2_overlap_recompute": (2, [*_pp(2, 2), "--overlap-grad-reduce",
                                              "--recompute-granularity", "full",
                                              "--recompute-method", "uniform",
                                              "--recompute-num-layers", "1"])}


def _params_norm_flags(tb_root: Path, name: str) -> list[str]:
    """Log the params norm to TensorBoard at every iteration (read back from ``tb_root/name``)."""
    return ["--log-params-norm", "--tensorboard-dir", str(tb_root / name)]


@pytest.fixture(scope="module")
def tb_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline_tensorboard")


@pytest.fixture(scope="module")
def single(gpt2_corpus, tb_root):
    norm = _params_norm_flags(tb_root, "single")
    runs = {"tied": _run(gpt2_corpus, extra=[*EVAL, *norm], init=False),
            "untied": _run(gpt2_corpus, extra=UNTIED, init=False),
            # The single-process init replayed at PP=1 is the plain init (the helper is sound).
            "tied_replayed_init": _run(gpt2_corpus, extra=EVAL),
            "bf16": _run(gpt2_corpus, extra=["--bf16"], init=False, **BF16_SHAPE)}
    results = e2e.pooled(1, list(runs.values()))
    return {name: result[0] for name, result in zip(runs, results)}


def _pooled(corpus, world: int, layouts: dict, more_flags: dict | None = None) -> dict:
    more_flags = more_flags or {}
    runs = [_run(corpus, tp=tp, extra=[*extra, *more_flags.get(name, [])])
            for name, (tp, extra) in layouts.items()]
    return dict(zip(layouts, e2e.pooled(world, runs)))


@pytest.fixture(scope="module")
def four_ranks(gpt2_corpus, tb_root):
    return _pooled(gpt2_corpus, 4, _FOUR, {"pp4": _params_norm_flags(tb_root, "pp4")})


@pytest.fixture(scope="module")
def eight_ranks(gpt2_corpus):
    return _pooled(gpt2_corpus, 8, _EIGHT)


@pytest.fixture(scope="module")
def two_ranks(gpt2_corpus, tmp_path_factory):
    """The PP=2 layouts, bf16, fp16 with an inf on stage 0, resume, mismatched loads and
    --skip-train."""
    saves = {"pp2": str(tmp_path_factory.mktemp("pipeline_eval_pp2"))}
    # PP=2 also saves (at 3 and 6, after that iteration's evaluation) for --skip-train below.
    more = {"pp2": ["--save", saves["pp2"], "--save-interval", "3"]}
    runs = {name: _run(gpt2_corpus, tp=tp, extra=[*extra, *more.get(name, [])])
            for name, (tp, extra) in _TWO.items()}
    runs["pp2_bf16"] = _run(gpt2_corpus, extra=[*_pp(2), "--bf16"], **BF16_SHAPE)
    # Stage 0 (rank 0) alone gets an inf gradient at iteration 3: the loss stays finite.
    runs["pp2_fp16_inf"] = {"argv": e2e.gpt_argv(gpt2_corpus, **SHAPE, extra=[
        *LAYERS, *_pp(2), "--fp16", "--initial-loss-scale", "1024"]),
        "grad_inf_at": ([3], 0, 4)}
    for name, pipeline in (("pp2", _pp(2)), ("pp2_vpp2", _pp(2, 2))):
        save = saves[f"{name}_resume"] = str(tmp_path_factory.mktemp(f"pipeline_resume_{name}"))
        # Dropout on: every stage's RNG streams must come back too.
        common = dict(dropout=0.1, extra=[*pipeline, "--save", save, "--save-interval", "3"])
        runs[f"{name}_straight"] = _run(gpt2_corpus, **common)
        runs[f"{name}_resumed"] = _run(gpt2_corpus, dropout=0.1, extra=[
            *pipeline, "--load", save, "--ckpt-step", "3"])
    mismatched = {"pp1_loads_pp2": [], "pp2_loads_pp2_vpp2": _pp(2),
                  "pp2_vpp2_loads_pp2": _pp(2, 2)}
    for name, pipeline in mismatched.items():
        source = "pp2_vpp2" if name.endswith("vpp2") else "pp2"
        runs[name] = _run(gpt2_corpus, dropout=0.1, extra=[
            *pipeline, "--load", saves[f"{source}_resume"], "--ckpt-step", "3"])
    # Iteration 6 of PP=2 was saved after 2 evaluations of 2 batches: the evaluation here reads
    # the same validation batches as the run's final one.
    runs["pp2_skip_train"] = _run(gpt2_corpus, extra=[
        *_pp(2), "--load", saves["pp2"], "--skip-train", "--eval-iters", "2"])
    results = e2e.pooled(2, list(runs.values()), expect_error=(CheckpointError,))
    return {**dict(zip(runs, results)), "save_dirs": saves}


# ---------------------------------------------------------------------------------------------
def _last_stage(run_ranks: list[dict]) -> list[dict]:
    """The ranks that hold the loss (their history has it)."""
    out = [r for r in run_ranks if r["history"] and "lm loss" in r["history"][0]]
    assert out, "no rank reported a loss"
    return out


def _merged_params(run_ranks: list[dict]) -> dict:
    """One dict of the whole model from every stage's ranks; every rank's copy of a name must
    agree (TP and DP replicas), and the last stage's tied-embedding copy must equal stage 0's
    embedding (then dropped: the one-process model has none)."""
    merged: dict = {}
    for rank, result in enumerate(run_ranks):
        for name, value in result["params"].items():
            if name in merged:
                diff = float((merged[name] - value).abs().max())
                assert diff == 0.0, f"rank {rank}: replicas of {name} differ by {diff:.3g}"
            else:
                merged[name] = value
    if HEAD_COPY in merged:
        diff = float((merged.pop(HEAD_COPY) - merged[EMBEDDING]).abs().max())
        assert diff <= 1e-6, f"the last stage's copy of the tied embedding drifted by {diff:.3g}"
    return merged


def _assert_same_training(reference: dict, run_ranks: list[dict], what: str) -> None:
    ref = e2e.losses(reference)
    assert len(ref) == ITERS and not any(h["skipped"] for h in reference["history"])
    assert ref[-1] < ref[0] - 0.1, f"the reference run did not train: {ref}"
    for result in _last_stage(run_ranks):
        diff = e2e.max_abs_diff(ref, e2e.losses(result))
        assert diff <= LOSS_TOL, (f"{what}: loss differs from one process by {diff:.3g}\n"
                                  f"  reference {ref}\n  {what} {e2e.losses(result)}")
    ref_norms = [h["grad norm"] for h in reference["history"]]
    for rank, result in enumerate(run_ranks):
        # Every stage logs the one global norm (the tied embedding counted once). Relative: the
        # norm amplifies the 1e-6 parameter differences of TP's other reduction order (TP=2
        # without PP drifts the same 2e-4 by iteration 6; PP alone stays within 1e-6).
        norms = [h["grad norm"] for h in result["history"]]
        worst = max(abs(a - b) / a for a, b in zip(ref_norms, norms))
        assert worst <= GRAD_NORM_RTOL, (what, rank, ref_norms, norms)
    diff = e2e.max_param_diff(reference["params"], _merged_params(run_ranks))
    assert diff <= PARAM_TOL, f"{what}: final parameters differ by {diff:.3g}"


def _reference(single: dict, layout: str) -> dict:
    return single["untied" if "untied" in layout else "tied"]


def test_single_process_init_replays_the_plain_init(single):
    """The test helper that starts stages from the one-process weights changes nothing at
    PP=1 (the same losses and parameters, bit for bit)."""
    plain, replayed = single["tied"], single["tied_replayed_init"]
    assert e2e.losses(plain) == e2e.losses(replayed)
    assert e2e.max_param_diff(plain["params"], replayed["params"]) == 0.0


@pytest.mark.parametrize("layout", list(_TWO))
def test_two_stages_equal_single_process(single, two_ranks, layout):
    """PP=2 (tied, untied) and PP=2 x VPP=2 (interleaved)."""
    _assert_same_training(_reference(single, layout), two_ranks[layout], layout)


@pytest.mark.parametrize("layout", list(_FOUR))
def test_four_ranks_equal_single_process(single, four_ranks, layout):
    """PP=4, PP=4 x VPP=2, TP=2 x PP=2 (distributed optimizer, block recomputation of 2 of
    each stage's 4 layers), PP=2 x VPP=2 x DP=2 with the distributed optimizer (its shards span
    the model chunks), PP=2 x DP=2 with PyTorch's DDP."""
    _assert_same_training(_reference(single, layout), four_ranks[layout], layout)


@pytest.mark.parametrize("layout", list(_EIGHT))
def test_eight_ranks_equal_single_process(single, eight_ranks, layout):
    """TP=2 x PP=2 x DP=2 x VPP=2 with overlapped bucketed reduction and uniform recomputation
    of every layer of each chunk."""
    _assert_same_training(_reference(single, layout), eight_ranks[layout], layout)


@pytest.mark.parametrize("layout", ["pp2", "pp2_vpp2", "pp4"])
def test_evaluation_equals_single_process(single, two_ranks, four_ranks, layout):
    """Validation losses (at iterations 3, 6 and the end) come from the last stage and equal
    one process's; the other stages report none, as Megatron prints them from the last rank."""
    ref = [d["lm loss"] for d in single["tied"]["evals"]]
    assert len(ref) == 3
    run_ranks = (four_ranks if layout == "pp4" else two_ranks)[layout]
    last = _last_stage(run_ranks)
    for result in run_ranks:
        if result in last:
            got = [d["lm loss"] for d in result["evals"]]
            assert e2e.max_abs_diff(ref, got) <= LOSS_TOL, (layout, ref, got)
        else:
            assert all(d == {} for d in result["evals"]) and len(result["evals"]) == 3


def test_params_norm_counts_the_tied_embedding_once(single, four_ranks, tb_root):
    """The logged params norm at PP=4 (the last stage holds a copy of the embedding, the
    middle stages none) is the one-process norm at every iteration."""
    def norms(name: str):
        return e2e.read_scalars(tb_root / name)["params-norm"]

    ref, got = norms("single"), norms("pp4")
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1))
    for step in ref:
        assert abs(ref[step] - got[step]) <= 1e-5 * ref[step], (step, ref[step], got[step])


def test_bf16_two_stages_equal_single_process(single, two_ranks):
    """bf16 at PP=2 (bf16 activations and gradients between the stages) gives the bf16 loss
    of one process."""
    ref = e2e.losses(single["bf16"])
    assert len(ref) == BF16_SHAPE["iters"]
    for result in _last_stage(two_ranks["pp2_bf16"]):
        diff = e2e.max_abs_diff(ref, e2e.losses(result))
        assert diff <= BF16_LOSS_TOL, (ref, e2e.losses(result))


def test_skip_train_evaluates_on_the_last_stage(single, two_ranks):
    """``--skip-train`` at PP=2 from the PP=2 run's last checkpoint: no step, the checkpoint's
    iteration, and the final validation loss of the one-process run, from the last stage only."""
    ranks = two_ranks["pp2_skip_train"]
    for result in ranks:
        assert result["error"] is None and result["history"] == []
        assert result["iteration"] == ITERS and len(result["evals"]) == 1
    assert ranks[0]["evals"] == [{}]
    ref = single["tied"]["evals"][-1]["lm loss"]
    assert abs(ranks[1]["evals"][0]["lm loss"] - ref) <= LOSS_TOL, (ranks[1]["evals"], ref)


def test_fp16_inf_on_one_stage_skips_the_step_on_every_stage(two_ranks):
    """An inf gradient on stage 0 alone (stage 1's are finite) skips iteration 3 on both stages
    (found-inf is reduced over the model-parallel group)."""
    ranks = two_ranks["pp2_fp16_inf"]
    for rank, result in enumerate(ranks):
        skipped = [int(h["skipped"]) for h in result["history"]]
        assert skipped == [0, 0, 1, 0, 0, 0], (rank, skipped)
    losses = e2e.losses(_last_stage(ranks)[0])
    assert all(v == v and abs(v) < 20 for v in losses), losses


@pytest.mark.parametrize("layout", ["pp2", "pp2_vpp2"])
def test_resume_is_exact(two_ranks, layout):
    """Saved at iteration 3 (``mp_rank_00_00P`` shards, ``model0``/``model1`` with virtual
    stages), resumed: iterations 4-6 give the straight run's losses (dropout on)."""
    straight, resumed = two_ranks[f"{layout}_straight"], two_ranks[f"{layout}_resumed"]
    for s, r in zip(_last_stage(straight), _last_stage(resumed)):
        assert r["iteration"] == ITERS and len(r["history"]) == ITERS - 3
        diff = e2e.max_abs_diff(e2e.losses(s)[3:], e2e.losses(r))
        assert diff <= RESUME_TOL, (layout, e2e.losses(s), e2e.losses(r))
    for s, r in zip(straight, resumed):
        assert e2e.max_param_diff(s["params"], r["params"]) <= RESUME_TOL


def test_checkpoint_layout_on_disk(two_ranks):
    """Megatron's names: one ``mp_rank_TT_PPP`` directory per stage; ``model0``/``model1``
    entries with virtual stages, each chunk with its stage-local layer numbers."""
    from megatron.checkpointing import load_checkpoint_file

    for name, keys in (("pp2", ["model"]), ("pp2_vpp2", ["model0", "model1"])):
        iteration_dir = Path(two_ranks["save_dirs"][f"{name}_resume"]) / "iter_0000003"
        shards = sorted(p.name for p in iteration_dir.iterdir() if p.is_dir())
        assert shards == ["mp_rank_00_000", "mp_rank_00_001"], shards
        for shard in shards:
            sd = load_checkpoint_file(iteration_dir / shard / "model_optim_rng.pt")
            assert [k for k in sd if k.startswith("model")] == keys, (name, list(sd))
            encoder = sd[keys[-1]]["language_model"]["encoder"]
            layers = sorted({int(k.split(".")[1]) for k in encoder if k.startswith("layers.")})
            assert layers == list(range(8 // (2 * len(keys)))), (name, shard, layers)


@pytest.mark.parametrize("name,flags", [
    ("pp1_loads_pp2", ["--pipeline-model-parallel-size: checkpoint 2, flags 1"]),
    ("pp2_loads_pp2_vpp2", ["--num-layers-per-virtual-pipeline-stage: checkpoint 2, flags not "
                            "set"]),
    ("pp2_vpp2_loads_pp2", ["--num-layers-per-virtual-pipeline-stage: checkpoint not set, "
                            "flags 2"])])
def test_other_pipeline_split_is_refused(two_ranks, name, flags):
    """A checkpoint of another PP size or virtual split is refused, naming the flags and the
    converter."""
    for result in two_ranks[name]:
        assert result["error"] is not None and result["error"].startswith("CheckpointError")
        for text in [*flags, "tools/checkpoint/convert.py"]:
            assert text in result["error"], (text, result["error"])
