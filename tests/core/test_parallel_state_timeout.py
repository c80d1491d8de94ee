"""Every model-parallel group honours the collective timeout.

torch's ``new_group`` does not inherit the world group's timeout: before the fix a collective on
any group of ``initialize_model_parallel`` waited torch's default 30 minutes for a stuck peer,
whatever ``--distributed-timeout-minutes`` said.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron.core import comm
from megatron.core import parallel_state as ps
from tests.multiprocess import run_distributed

TIMEOUT_MINUTES = 0.02  # 1.2 s
# Hang detection only: the timed-out collectives take about a second each.
BOUND_S = 60.0

# On two ranks: every group kind that spans both ranks in one of these layouts.
LAYOUTS = {"tp2": ((2, 1), ("tensor", "model")),
           "pp2": ((1, 2), ("pipeline", "model", "embedding")),
           "dp2": ((1, 1), ("data",))}


def _wait_for_absent_peer(rank, world_size, sizes, kinds):
    """Rank 0 all-reduces on each group while rank 1, alive with its groups, stays out (it
    waits on the world group); returns the seconds each took to fail and the error."""
    ps.initialize_model_parallel(*sizes, distributed_timeout_minutes=TIMEOUT_MINUTES)
    if rank != 0:
        comm.barrier(comm.world_group())
        return None
    getters = {"tensor": ps.get_tensor_model_parallel_group,
               "pipeline": ps.get_pipeline_model_parallel_group,
               "data": ps.get_data_parallel_group, "model": ps.get_model_parallel_group,
               "embedding": ps.get_embedding_group}
    out = {}
    for kind in kinds:
        group = getters[kind]()
        assert comm.world_size(group) == 2, kind
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(1), group)
            out[kind] = (time.monotonic() - start, "returned")
        except RuntimeError as err:
            out[kind] = (time.monotonic() - start, str(err))
    comm.barrier(comm.world_group())
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_group_times_out(layout):
    sizes, kinds = LAYOUTS[layout]
    # The pool's own limit is the hang detector for the code before the fix.
    results = run_distributed(2, _wait_for_absent_peer, sizes, kinds, timeout=BOUND_S * 2)
    for kind, (seconds, error) in results[0].items():
        assert error != "returned", kind
        assert "timed out" in error.lower() or "timeout" in error.lower(), (kind, error)
        assert seconds < BOUND_S, f"{kind} group waited {seconds:.0f} s"


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="--distributed-timeout-minutes"):
        ps._group_timeout(0)
