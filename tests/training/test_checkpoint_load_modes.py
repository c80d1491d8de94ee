"""What a ``--load`` restores under each flag, through ``pretrain()`` (issues 5 and 6).

* ``--finetune``, ``--no-load-optim``, ``--no-load-rng``, ``--ckpt-step``: what each load brings
  back is read inside the ranks right after ``load_checkpoint`` (weights, Adam moments, RNG
  streams, scheduler) and compared with the same probe taken when the checkpoint was saved; the
  losses afterwards are compared with an uninterrupted run.
* bf16 (plain and distributed optimizer) + ``--no-load-optim``: the fp32 main params must be the
  loaded weights, so the loaded weights survive the first step.
* The distributed optimizer saved at DP=2 continues at DP=1 and DP=4 with the losses of the
  uninterrupted DP=2 run (fp32 and bf16); loading its state without the distributed optimizer
  is refused with a message naming the flag.
* fp16: 3 + save + resume + 3 + save + resume + 3 carries the loss scale, the growth tracker and
  the hysteresis tracker (infs injected so that each of them decides a later scale).
* A save fsyncs the shard directories after renaming the shard files and before writing the
  tracker, and the save root after the tracker.
* ``--DDP-impl torch`` at DP=2 gives the single-process losses (it shares this module's worlds).

The DP=1 vs 2 vs 4 runs use dropout 0 (each layout draws its dropout masks differently); the
load-mode runs use dropout 0.1, so a resume is only exact when the RNG streams come back.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.training.checkpointing import CheckpointError
from tests.training import e2e
from tests.training.e2e import read_scalars

SHAPE = {"iters": 8, "seq": 32, "mbs": 1, "gbs": 4}
# The load-mode runs use dropout, so the RNG streams matter (and advance) as they train.
DROPOUT_SHAPE = {**SHAPE, "dropout": 0.1}
# bf16 GEMMs are slow on CPUs without AVX512-BF16/AMX: shorter sequences; a higher LR, so that
# the loaded weights are far from the initial ones.
BF16_SHAPE = {"iters": 8, "seq": 16, "mbs": 1, "gbs": 4, "lr": 1e-2}
BF16_SAVED_AT = 5  # loss 10.8 -> ~9.6 by then
LOSS_TOL = 1e-5       # DP=1 vs 2 vs 4 (test_parallel_equivalence measures <= 1.7e-6)
BF16_LOSS_TOL = 1e-3  # bf16 at another DP size (measured there <= 1.1e-4)
RESUME_TOL = 1e-6     # the same layout resumed


# ---------------------------------------------------------------------------------------------
# Inside the ranks: probes around load_checkpoint / save_checkpoint, fsync order
# ---------------------------------------------------------------------------------------------

def _rng_digest() -> str:
    from megatron.core.tensor_parallel.random import get_rng_tracker

    h = hashlib.sha1(torch.get_rng_state().numpy().tobytes())
    h.update(np.random.get_state()[1].tobytes())
    h.update(repr(random.getstate()).encode())
    for name, state in sorted(get_rng_tracker().get_states().items()):
        h.update(name.encode() + state.numpy().tobytes())
    return h.hexdigest()


def _main_param_gap(optimizer) -> float:
    """Largest |fp32 main param - model param| (0 for fp32 training: they are the same)."""
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params

    if isinstance(optimizer, DistributedOptimizer):
        pairs = [(p.main, p.model_param.detach().view(-1)[p.param_start:p.param_end])
                 for p in optimizer.pieces]
    elif isinstance(optimizer, Float16OptimizerWithFloat16Params):
        pairs = [(m, p) for mains, halves in zip(optimizer.fp32_from_float16_groups,
                                                 optimizer.float16_groups)
                 for m, p in zip(mains, halves)]
    else:
        return 0.0
    return max((float((m - p.float()).abs().max()) for m, p in pairs), default=0.0)


def _probe(model, optimizer, scheduler) -> dict:
    params = [p.detach().double() for chunk in model for p in chunk.parameters()]
    moments = [s["exp_avg"].double() for s in optimizer.optimizer.state.values()
               if "exp_avg" in s]
    return {"weights": float(sum(p.sum() + p.abs().sum() for p in params)),
            "moments": float(sum(m.abs().sum() for m in moments)) if moments else 0.0,
            "rng": _rng_digest(), "main_gap": _main_param_gap(optimizer),
            "scheduler_steps": scheduler.num_steps,
            "loss_scale": float(optimizer.get_loss_scale())}


def probed_runs(rank: int, world_size: int, runs: list[dict],
                expect_error: tuple[type, ...] = ()) -> list[dict]:
    """``e2e.run_pretrains`` with probes: each result gains ``loads`` (the probe right after
    every load_checkpoint, with its return value), ``saves`` ({iteration: probe just before
    saving}) and ``events`` (checkpoint writes and directory fsyncs, in order)."""
    from megatron.checkpointing import files as checkpointing
    from megatron.training import loop
    from megatron.training import pretrain as pretrain_module

    log: dict = {}
    original_load, original_save = pretrain_module.load_checkpoint, loop.save_checkpoint
    original_write, original_fsync = checkpointing._atomic_write, checkpointing._fsync_dir

    def load(model, optimizer, scheduler, cfg, *args, **kwargs):
        out = original_load(model, optimizer, scheduler, cfg, *args, **kwargs)
        log["loads"].append({"returned": list(out), **_probe(model, optimizer, scheduler)})
        return out

    def save(iteration, model, optimizer, scheduler, *args, **kwargs):
        log["saves"][iteration] = _probe(model, optimizer, scheduler)
        return original_save(iteration, model, optimizer, scheduler, *args, **kwargs)

    def atomic_write(write, path):
        original_write(write, path)
        log["events"].append(("write", str(path)))

    def fsync_dir(path):
        original_fsync(path)
        log["events"].append(("fsync", str(path)))

    pretrain_module.load_checkpoint, loop.save_checkpoint = load, save
    checkpointing._atomic_write, checkpointing._fsync_dir = atomic_write, fsync_dir
    out = []
    try:
        for run in runs:
            log.update(loads=[], saves={}, events=[])
            result = e2e.run_pretrains(rank, world_size, [run], expect_error)[0]
            out.append({**result, "loads": log["loads"], "saves": log["saves"],
                        "events": log["events"]})
    finally:
        pretrain_module.load_checkpoint, loop.save_checkpoint = original_load, original_save
        checkpointing._atomic_write, checkpointing._fsync_dir = original_write, original_fsync
    return out


def _pooled(world_size: int, runs: dict[str, dict], expect_error=()) -> dict[str, list[dict]]:
    from tests.multiprocess import run_distributed

    per_rank = run_distributed(world_size, probed_runs, list(runs.values()), expect_error,
                               timeout=600.0)
    return {name: [per_rank[r][i] for r in range(world_size)] for i, name in enumerate(runs)}


# ---------------------------------------------------------------------------------------------
# The runs: DP=2 first (it writes the checkpoints DP=1 and DP=4 load), then DP=1, then DP=4
# ---------------------------------------------------------------------------------------------

FP16 = {"iters": 9, "seq": 16, "mbs": 1, "gbs": 2, "lr": 3e-3}
SCALE, WINDOW = 1024.0, 3
# --hysteresis 2, window 3; infs (rank 1) at iterations 1, 5 and 7:
#   1 inf: hysteresis 2 -> 1 | 2, 3 clean | save (scale 1024, growth 2, hysteresis 1)
#   4 clean: 3rd clean step -> scale 2048, hysteresis 2   <- needs the saved growth tracker
#   5 inf: hysteresis 1 | 6 clean | save (scale 2048, growth 1, hysteresis 1)
#   7 inf: hysteresis 0 -> scale 1024                      <- needs the saved hysteresis tracker
FP16_INF_AT = (1, 5, 7)
FP16_SCALES = {1: 1024.0, 2: 1024.0, 3: 1024.0, 4: 2048.0, 5: 2048.0, 6: 2048.0, 7: 1024.0,
               8: 1024.0, 9: 1024.0}


def _fp16_argv(corpus, tb, extra=()):
    return e2e.gpt_argv(corpus, **FP16, extra=[
        "--fp16", "--initial-loss-scale", SCALE, "--hysteresis", "2", "--loss-scale-window",
        WINDOW, "--tensorboard-dir", tb, "--tensorboard-log-interval", "1", *extra])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("load_modes")
    names = ("distopt", "bf16_distopt", "fp16", "single", "bf16", "tb_straight", "tb_a", "tb_b",
             "tb_c", "no_rng")
    return {name: base / name for name in names}


@pytest.fixture(scope="module")
def two(gpt2_corpus, dirs):
    c, d = gpt2_corpus, dirs
    distopt, bf16_distopt = ["--use-distributed-optimizer"], ["--bf16",
                                                              "--use-distributed-optimizer"]
    one_micro_batch = 1  # FP16: global batch 2 over DP=2
    runs = {
        "distopt_straight": {"argv": e2e.gpt_argv(c, **SHAPE, extra=distopt)},
        "distopt_save": {"argv": e2e.gpt_argv(c, **SHAPE, extra=[
            *distopt, "--save", d["distopt"], "--save-interval", "1000",
            "--exit-interval", "4"])},
        "bf16_distopt_straight": {"argv": e2e.gpt_argv(c, **BF16_SHAPE, extra=bf16_distopt)},
        "bf16_distopt_save": {"argv": e2e.gpt_argv(c, **BF16_SHAPE, extra=[
            *bf16_distopt, "--save", d["bf16_distopt"], "--save-interval", "1000",
            "--exit-interval", BF16_SAVED_AT])},
        "bf16_distopt_no_load_optim": {"argv": e2e.gpt_argv(c, **BF16_SHAPE, extra=[
            *bf16_distopt, "--load", d["bf16_distopt"], "--no-load-optim"])},
        "torch_ddp": {"argv": e2e.gpt_argv(c, **SHAPE, extra=["--DDP-impl", "torch"])},
        "fp16_straight": {"argv": _fp16_argv(c, d["tb_straight"]),
                          "inf_at": (FP16_INF_AT, 1, one_micro_batch)},
        "fp16_a": {"argv": _fp16_argv(c, d["tb_a"], [
            "--save", d["fp16"], "--save-interval", "1000", "--exit-interval", "3"]),
            "inf_at": ((1,), 1, one_micro_batch)},
        "fp16_b": {"argv": _fp16_argv(c, d["tb_b"], [
            "--load", d["fp16"], "--save", d["fp16"], "--save-interval", "1000",
            "--exit-interval", "6"]), "inf_at": ((2,), 1, one_micro_batch)},  # global 5
        "fp16_c": {"argv": _fp16_argv(c, d["tb_c"], ["--load", d["fp16"]]),
                   "inf_at": ((1,), 1, one_micro_batch)},  # global 7
    }
    return _pooled(2, runs)


@pytest.fixture(scope="module")
def single(gpt2_corpus, dirs, two):
    c, d = gpt2_corpus, dirs
    load = ["--load", d["single"]]
    bf16_load = ["--bf16", "--load", d["bf16"]]
    runs = {
        "reference": {"argv": e2e.gpt_argv(c, **SHAPE)},  # dropout 0, for --DDP-impl torch
        "straight": {"argv": e2e.gpt_argv(c, **DROPOUT_SHAPE)},
        "save": {"argv": e2e.gpt_argv(c, **DROPOUT_SHAPE, extra=[
            "--save", d["single"], "--save-interval", "2", "--exit-interval", "4"])},
        "full": {"argv": e2e.gpt_argv(c, **DROPOUT_SHAPE, extra=load)},
        "finetune": {"argv": e2e.gpt_argv(c, **DROPOUT_SHAPE, extra=[*load, "--finetune"])},
        "no_load_optim": {"argv": e2e.gpt_argv(c, **DROPOUT_SHAPE, extra=[
            *load, "--no-load-optim"])},
        "no_load_rng": {"argv": e2e.gpt_argv(c, **DROPOUT_SHAPE, extra=[
            *load, "--no-load-rng"])},
        "ckpt_step": {"argv": e2e.gpt_argv(c, **DROPOUT_SHAPE, extra=[
            *load, "--ckpt-step", "2"])},
        "bf16_straight": {"argv": e2e.gpt_argv(c, **BF16_SHAPE, extra=["--bf16"])},
        "bf16_save": {"argv": e2e.gpt_argv(c, **BF16_SHAPE, extra=[
            "--bf16", "--save", d["bf16"], "--save-interval", "1000",
            "--exit-interval", BF16_SAVED_AT])},
        "bf16_no_load_optim": {"argv": e2e.gpt_argv(c, **BF16_SHAPE, extra=[
            *bf16_load, "--no-load-optim"])},
        "bf16_finetune": {"argv": e2e.gpt_argv(c, **BF16_SHAPE, extra=[
            *bf16_load, "--finetune"])},
        "dp1_distopt": {"argv": e2e.gpt_argv(c, **SHAPE, extra=[
            "--use-distributed-optimizer", "--load", d["distopt"]])},
        "dp1_bf16_distopt": {"argv": e2e.gpt_argv(c, **BF16_SHAPE, extra=[
            "--bf16", "--use-distributed-optimizer", "--load", d["bf16_distopt"]])},
        "distopt_into_plain": {"argv": e2e.gpt_argv(c, **SHAPE, extra=["--load", d["distopt"]])},
        "no_rng_save": {"argv": e2e.gpt_argv(c, **SHAPE, extra=[
            "--no-save-rng", "--save", d["no_rng"], "--save-interval", "1000",
            "--exit-interval", "2"])},
        "no_rng_load": {"argv": e2e.gpt_argv(c, **SHAPE, extra=["--load", d["no_rng"]])},
        "no_rng_load_without": {"argv": e2e.gpt_argv(c, **SHAPE, extra=[
            "--load", d["no_rng"], "--no-load-rng"])},
    }
    return {name: ranks[0] for name, ranks in
            _pooled(1, runs, expect_error=(CheckpointError,)).items()}


@pytest.fixture(scope="module")
def four(gpt2_corpus, dirs, two):
    c, d = gpt2_corpus, dirs
    runs = {
        "dp4_distopt": {"argv": e2e.gpt_argv(c, **SHAPE, extra=[
            "--use-distributed-optimizer", "--load", d["distopt"]])},
        "dp4_bf16_distopt": {"argv": e2e.gpt_argv(c, **BF16_SHAPE, extra=[
            "--bf16", "--use-distributed-optimizer", "--load", d["bf16_distopt"]])},
    }
    return _pooled(4, runs)


def _no_error(*results):
    for result in results:
        assert result["error"] is None, result["error"]


# ---------------------------------------------------------------------------------------------
# --finetune, --no-load-optim, --no-load-rng, --ckpt-step
# ---------------------------------------------------------------------------------------------

def test_full_load_restores_everything(single):
    """The control for the probes below: a plain --load brings back all of it."""
    saved, full = single["save"]["saves"][4], single["full"]
    _no_error(full)
    (probe,) = full["loads"]
    assert probe["returned"] == [4, 4 * SHAPE["gbs"], 0]
    for key in ("weights", "moments", "rng", "scheduler_steps"):
        assert probe[key] == saved[key], key
    assert saved["moments"] > 0
    diff = e2e.max_abs_diff(e2e.losses(full), e2e.losses(single["straight"])[4:])
    assert diff <= RESUME_TOL


def test_finetune_loads_weights_only_and_restarts_at_iteration_0(single):
    saved, run = single["save"]["saves"][4], single["finetune"]
    _no_error(run)
    (probe,) = run["loads"]
    assert probe["returned"] == [0, 0, 0]       # iteration and consumed samples reset
    assert probe["weights"] == saved["weights"]  # the weights are loaded
    assert probe["moments"] == 0.0               # the optimizer state is not
    assert probe["scheduler_steps"] == 0         # nor the LR schedule
    assert probe["rng"] != saved["rng"]          # nor the RNG streams
    assert run["iteration"] == SHAPE["iters"] and len(run["history"]) == SHAPE["iters"]
    # The first batch again, with 4 iterations' worth of training already in the weights.
    straight = e2e.losses(single["straight"])
    assert e2e.losses(run)[0] < straight[0] - 0.05, (e2e.losses(run), straight)


def test_no_load_optim_keeps_iteration_weights_and_rng(single):
    saved, run = single["save"]["saves"][4], single["no_load_optim"]
    _no_error(run)
    (probe,) = run["loads"]
    assert probe["returned"] == [4, 4 * SHAPE["gbs"], 0]
    assert probe["weights"] == saved["weights"] and probe["rng"] == saved["rng"]
    assert probe["moments"] == 0.0 and probe["scheduler_steps"] == 0
    straight = e2e.losses(single["straight"])[4:]
    losses = e2e.losses(run)
    assert len(losses) == 4
    assert abs(losses[0] - straight[0]) <= RESUME_TOL  # same weights, same batch
    assert abs(losses[1] - straight[1]) > 1e-4         # fresh Adam, restarted LR warm-up


def test_no_load_rng_keeps_everything_but_the_rng(single):
    saved, run = single["save"]["saves"][4], single["no_load_rng"]
    _no_error(run)
    (probe,) = run["loads"]
    assert probe["returned"] == [4, 4 * SHAPE["gbs"], 0]
    assert probe["weights"] == saved["weights"] and probe["moments"] == saved["moments"]
    assert probe["scheduler_steps"] == saved["scheduler_steps"]
    assert probe["rng"] != saved["rng"]
    # Same weights and batch, other dropout masks: close to the straight run, not equal.
    losses, straight = e2e.losses(run), e2e.losses(single["straight"])[4:]
    assert len(losses) == 4 and run["iteration"] == SHAPE["iters"]
    assert 1e-5 < abs(losses[0] - straight[0]) < 0.1, (losses, straight)


def test_ckpt_step_loads_that_iteration_not_the_latest(single):
    saves, run = single["save"]["saves"], single["ckpt_step"]
    assert sorted(saves) == [2, 4]
    _no_error(run)
    (probe,) = run["loads"]
    assert probe["returned"] == [2, 2 * SHAPE["gbs"], 0]
    assert probe["weights"] == saves[2]["weights"] != saves[4]["weights"]
    assert probe["moments"] == saves[2]["moments"]
    diff = e2e.max_abs_diff(e2e.losses(run), e2e.losses(single["straight"])[2:])
    assert diff <= RESUME_TOL and len(e2e.losses(run)) == SHAPE["iters"] - 2


@pytest.mark.parametrize("name", ["bf16_no_load_optim", "bf16_finetune"])
def test_bf16_main_params_are_the_loaded_weights(single, name):
    """bf16 + --no-load-optim / --finetune: the optimizer was built (fp32 main params copied
    from the initial weights) before the load; reload_model_params must refresh them, or the
    first step writes the initial weights back (the loss jumps back to ~10.8)."""
    run, saved = single[name], single["bf16_save"]["saves"][BF16_SAVED_AT]
    _no_error(run)
    (probe,) = run["loads"]
    assert probe["weights"] == saved["weights"]
    assert probe["main_gap"] == 0.0, f"fp32 main params differ from the loaded weights by " \
                                     f"{probe['main_gap']}"
    straight = e2e.losses(single["bf16_straight"])
    losses = e2e.losses(run)
    assert all(v < straight[0] - 0.3 for v in losses), (losses, straight)
    if name == "bf16_no_load_optim":
        assert abs(losses[0] - straight[BF16_SAVED_AT]) <= BF16_LOSS_TOL
        # Fresh Adam moments (--no-load-optim) take their own path from the loaded weights;
        # the initial weights written back would put the loss near straight[0] (~1.2 higher).
        assert e2e.max_abs_diff(losses, straight[BF16_SAVED_AT:]) < 0.5, (losses, straight)


def test_bf16_distributed_optimizer_main_shards_are_the_loaded_weights(two):
    ranks = two["bf16_distopt_no_load_optim"]
    straight = e2e.losses(two["bf16_distopt_straight"][0])
    for rank, run in enumerate(ranks):
        _no_error(run)
        (probe,) = run["loads"]
        assert probe["main_gap"] == 0.0, (rank, probe["main_gap"])
        losses = e2e.losses(run)
        assert abs(losses[0] - straight[BF16_SAVED_AT]) <= BF16_LOSS_TOL
        # Fresh Adam moments (--no-load-optim) take their own path from the loaded weights;
        # the initial weights written back would put the loss near straight[0] (~1.2 higher).
        assert e2e.max_abs_diff(losses, straight[BF16_SAVED_AT:]) < 0.5, (losses, straight)


# ---------------------------------------------------------------------------------------------
# Distributed optimizer: re-sharding at another DP size
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp", [1, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_distributed_optimizer_continues_at_another_dp_size(two, single, four, dp, precision):
    """Saved at DP=2 (iteration 4 of 8, bf16: 5 of 8), loaded at DP=1 / DP=4: the remaining
    iterations give the losses of the uninterrupted DP=2 run."""
    prefix = "" if precision == "fp32" else "bf16_"
    straight = e2e.losses(two[f"{prefix}distopt_straight"][0])
    saved_at = 4 if precision == "fp32" else BF16_SAVED_AT
    tol = LOSS_TOL if precision == "fp32" else BF16_LOSS_TOL
    ranks = [single[f"dp1_{prefix}distopt"]] if dp == 1 else four[f"dp4_{prefix}distopt"]
    for rank, run in enumerate(ranks):
        _no_error(run)
        assert run["loads"][0]["returned"][0] == saved_at
        diff = e2e.max_abs_diff(e2e.losses(run), straight[saved_at:])
        assert diff <= tol, (f"DP={dp} {precision}, rank {rank}: losses differ by {diff:.3g}\n"
                             f"  DP=2 {straight[saved_at:]}\n  DP={dp} {e2e.losses(run)}")


def test_distributed_optimizer_state_into_plain_optimizer_is_refused(single):
    error = single["distopt_into_plain"]["error"]
    assert error is not None and error.startswith("CheckpointError")
    assert "--use-distributed-optimizer" in error and "--no-load-optim" in error
    assert "model_optim_rng.pt" in error
    # ... and names the converter that turns it into the plain optimizer's layout.
    assert ("tools/checkpoint/convert.py --keep-optimizer-state "
            "--no-target-use-distributed-optimizer") in error


def test_checkpoint_without_rng_state_needs_no_load_rng(single):
    # Megatron-LM refuses too, rather than silently training on from freshly seeded streams.
    _no_error(single["no_rng_save"], single["no_rng_load_without"])
    error = single["no_rng_load"]["error"]
    assert error is not None and error.startswith("CheckpointError")
    assert "no RNG state" in error and "--no-load-rng" in error


# ---------------------------------------------------------------------------------------------
# fp16 loss scaler across resumes
# ---------------------------------------------------------------------------------------------

def test_fp16_loss_scaler_state_survives_two_resumes(two, dirs):
    straight = read_scalars(dirs["tb_straight"])["loss-scale"]
    chained = {}
    for tb in ("tb_a", "tb_b", "tb_c"):
        chained.update(read_scalars(dirs[tb])["loss-scale"])
    assert straight == FP16_SCALES
    assert chained == FP16_SCALES, f"resumed scales {chained}"
    for rank in range(2):
        full = two["fp16_straight"][rank]
        parts = [two[f"fp16_{p}"][rank] for p in "abc"]
        _no_error(full, *parts)
        skipped = [i for i, h in enumerate(sum((p["history"] for p in parts), []), start=1)
                   if h["skipped"]]
        assert skipped == list(FP16_INF_AT)
        halves = sum((e2e.losses(p) for p in parts), [])
        assert e2e.max_abs_diff(e2e.losses(full), halves) <= RESUME_TOL
    # The saved scaler states are the ones the schedule above predicts.
    for part, iteration, scale in (("a", 3, 1024.0), ("b", 6, 2048.0)):
        assert two[f"fp16_{part}"][0]["saves"][iteration]["loss_scale"] == scale


# ---------------------------------------------------------------------------------------------
# Durable saves: directory fsyncs around the tracker
# ---------------------------------------------------------------------------------------------

def test_save_fsyncs_shard_dirs_before_the_tracker_and_the_root_after(single, dirs):
    root = dirs["single"]
    events = single["save"]["events"]
    tracker = str(root / "latest_checkpointed_iteration.txt")
    for iteration in (2, 4):
        shard = root / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
        written = events.index(("write", str(shard)))
        tracker_at = next(i for i, e in enumerate(events) if e == ("write", tracker)
                          and i > written)
        synced = [e[1] for e in events[written:tracker_at] if e[0] == "fsync"]
        for directory in (shard.parent, shard.parent.parent, root):
            assert str(directory) in synced, (iteration, directory, events)
        assert events[tracker_at + 1] == ("fsync", str(root)), events


def test_fsync_dir_syncs_a_directory_and_is_skipped_without_o_directory(tmp_path, monkeypatch):
    import os

    from megatron.checkpointing import files as checkpointing

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    checkpointing._fsync_dir(tmp_path)
    assert len(synced) == 1
    monkeypatch.delattr(os, "O_DIRECTORY", raising=False)  # e.g. Windows
    checkpointing._fsync_dir(tmp_path)
    assert len(synced) == 1


# ---------------------------------------------------------------------------------------------
# --DDP-impl torch
# ---------------------------------------------------------------------------------------------

def test_torch_ddp_impl_equals_single_process(two, single):
    """PyTorch's DDP at DP=2 through pretrain(): the single-process loss at every iteration."""
    reference = e2e.losses(single["reference"])
    assert reference[-1] < reference[0] - 0.1
    for rank, run in enumerate(two["torch_ddp"]):
        _no_error(run)
        diff = e2e.max_abs_diff(reference, e2e.losses(run))
        assert diff <= LOSS_TOL, f"rank {rank}: {diff:.3g}\n  {reference}\n  {e2e.losses(run)}"

