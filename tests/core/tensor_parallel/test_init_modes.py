"""Initialization of the TP-split weights, as Megatron's: the whole-weight CPU draw
(``--use-cpu-initialization``: the same full weight at every TP size), the per-rank draw of the
shard alone from the model-parallel RNG stream (Megatron's GPU default: 1/TP of the work, no
full weight made), and no draw at all when a checkpoint load overwrites every weight."""

from __future__ import annotations

import os
import types

import torch

from megatron.core import device
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import ColumnParallelLinear, init_method_normal
from megatron.core.tensor_parallel.random import get_rng_tracker, model_parallel_manual_seed
from tests.multiprocess import run_distributed


def _column(group, **kwargs):
    return ColumnParallelLinear(8, 16, tp_group=group, init_method=init_method_normal(1.0),
                                bias=False, params_dtype=torch.float64, **kwargs)


def _checks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    model_parallel_manual_seed(123, rank)
    torch.manual_seed(7)
    whole = _column(None).weight.detach()
    torch.manual_seed(7)
    cpu = _column(group).weight.detach()
    assert torch.equal(cpu, whole.chunk(world_size, 0)[rank])  # TP-invariant

    torch.manual_seed(7)
    before = torch.get_rng_state()
    tracker_state = get_rng_tracker().get_states()
    shard = _column(group, use_cpu_initialization=False).weight.detach()
    assert torch.equal(torch.get_rng_state(), before)  # no full draw from the default one
    get_rng_tracker().set_states(tracker_state)
    want = torch.empty(8, 8, dtype=torch.float64, device=device.get_device())
    with get_rng_tracker().fork():
        want.normal_(0.0, 1.0)
    assert shard.shape == (16 // world_size, 8) and torch.equal(shard, want)
    shards = [torch.empty_like(shard) for _ in range(world_size)]
    torch.distributed.all_gather(shards, shard, group=group)
    assert not torch.equal(shards[0], shards[1])  # a stream per TP rank

    before = torch.get_rng_state()
    tracker_state = get_rng_tracker().get_states()
    _column(group, perform_initialization=False)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(get_rng_tracker().get_states().values(),
                                                 tracker_state.values()))
    ps.destroy_model_parallel()
    return True


def test_cpu_draw_per_rank_draw_and_no_draw():
    assert run_distributed(2, _checks) == [True, True]


def test_a_checkpoint_to_load_skips_the_draw(tmp_path):
    from megatron.checkpointing.names import TRACKER_FILENAME
    from megatron.config.core_configs import _checkpoint_to_load

    cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(load=str(tmp_path)))
    assert not _checkpoint_to_load(cfg)  # --load of an empty directory: a fresh start
    (tmp_path / TRACKER_FILENAME).write_text("10")
    assert _checkpoint_to_load(cfg)
    cfg.checkpoint.load = None
    assert not _checkpoint_to_load(cfg)
    assert os.path.isdir(tmp_path)
