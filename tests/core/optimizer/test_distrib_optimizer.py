"""The distributed optimizer equals the ordinary one; its sharded state round-trips, re-shards."""

from __future__ import annotations

import os

import pytest
import torch

from megatron.core import comm, parallel_state
from tests.core.distributed import tiny_model
from tests.multiprocess import run_distributed

STEPS = 3


def _groups():
    parallel_state.initialize_model_parallel()
    return parallel_state.get_data_parallel_group(), parallel_state.get_model_parallel_group()


def _spans_border(opt) -> bool:
    return any(p.param_start > 0 or p.param_end < p.model_param.numel() for p in opt.pieces)


def _check_equivalence(rank, world_size):
    dp, mp = _groups()
    out = {}
    for name, dtype, kwargs in [("fp32", torch.float32, {}),
                                ("bf16", torch.bfloat16, {}),
                                ("fp32-buckets", torch.float32,
                                 dict(overlap=True, bucket_size=100)),
                                ("sgd", torch.float32, dict(optimizer="sgd"))]:
        plain_kwargs = {k: v for k, v in kwargs.items() if k == "optimizer"}
        ref, ref_opt = tiny_model.build(dp, mp, dtype=dtype, **plain_kwargs)
        ref_losses, _ = tiny_model.train(ref, ref_opt, STEPS, dp)
        ddp, opt = tiny_model.build(dp, mp, dtype=dtype, distopt=True, **kwargs)
        losses, results = tiny_model.train(ddp, opt, STEPS, dp)
        owned = sum(p.main.numel() for p in opt.pieces)
        out[name] = dict(loss=max(abs(a - b) for a, b in zip(losses, ref_losses)),
                         param=tiny_model.max_param_diff(ddp.module, ref.module),
                         border=_spans_border(opt), owned=owned,
                         norm=results[-1][1])
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_optimizer_equals_ordinary(world_size):
    results = run_distributed(world_size, _check_equivalence)
    total = sum(p.numel() for p in tiny_model.TinyLM().parameters())
    for name in results[0]:
        assert any(r[name]["border"] for r in results), f"{name}: no param spans a shard border"
        # Each rank owns one 1/d share of the (padded) buffer.
        assert sum(r[name]["owned"] for r in results) == total, name
        assert len({r[name]["norm"] for r in results}) == 1, "ranks disagree on the grad norm"
        for r in results:
            tol = 2e-3 if name == "bf16" else 1e-5  # measured: exactly equal
            assert r[name]["loss"] < tol and r[name]["param"] < tol, (name, r[name])


def _save(rank, world_size, directory):
    dp, mp = _groups()
    ddp, opt = tiny_model.build(dp, mp, distopt=True)
    tiny_model.train(ddp, opt, STEPS, dp)
    state = opt.save_parameter_state(os.path.join(directory, "distrib_optim.pt"))
    if rank == 0:
        assert set(state[0][torch.float32]) == {"param", "exp_avg", "exp_avg_sq"}
        torch.save({"model": ddp.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(directory, "model_optim_rng.pt"))
    comm.barrier(comm.world_group())
    # Round trip at this DP size: a freshly initialized copy continues identically.
    copy, copy_opt = _load_into(directory, dp, mp, seed=1)
    expected, _ = tiny_model.train(ddp, opt, 2, dp, first_step=STEPS)
    got, _ = tiny_model.train(copy, copy_opt, 2, dp, first_step=STEPS)
    return expected, got, tiny_model.max_param_diff(ddp.module, copy.module)


def _load_into(directory, dp, mp, seed, **kwargs):
    ddp, opt = tiny_model.build(dp, mp, distopt=True, seed=seed, **kwargs)
    ckpt = torch.load(os.path.join(directory, "model_optim_rng.pt"), weights_only=True)
    ddp.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    opt.load_parameter_state(os.path.join(directory, "distrib_optim.pt"))
    return ddp, opt


def _load_elsewhere(rank, world_size, directory, continue_steps):
    dp, mp = _groups()
    out = []
    for kwargs in ({}, dict(overlap=True, bucket_size=100)):
        ddp, opt = _load_into(directory, dp, mp, seed=2, **kwargs)
        # Same global batch: more micro-batches per rank at the smaller DP size.
        losses, _ = tiny_model.train(ddp, opt, continue_steps, dp, first_step=STEPS,
                                     micro_batches=2 * 4 // world_size)
        out.append(losses)
    return out


def test_checkpoint_round_trip_and_reshard(tmp_path):
    results = run_distributed(4, _save, str(tmp_path))
    for expected, got, param_diff in results:
        assert max(abs(a - b) for a, b in zip(expected, got)) < 1e-6
        assert param_diff < 1e-6
    expected = results[0][0]
    for losses_per_layout in run_distributed(2, _load_elsewhere, str(tmp_path), 2):
        for losses in losses_per_layout:
            assert max(abs(a - b) for a, b in zip(expected, losses)) < 1e-5, (expected, losses)


def _load_wrong_model(rank, world_size, directory):
    dp, mp = _groups()
    ddp, opt = tiny_model.build(dp, mp, distopt=True, dtype=torch.bfloat16, accumulate=False)
    try:
        opt.load_parameter_state(os.path.join(directory, "distrib_optim.pt"))
    except ValueError as err:
        return str(err)
    return None


def test_load_of_mismatched_state_is_refused(tmp_path):
    run_distributed(2, _save, str(tmp_path))
    for message in run_distributed(2, _load_wrong_model, str(tmp_path)):
        assert message is not None and "grad dtype" in message
