"""comm's one rule for process groups: ``None`` is this rank alone, never the whole world.

torch.distributed reads ``group=None`` as the world; the library reads it as "no parallelism"
(a TP group of None, a DP group of None). Before the rule a ``None`` passed down to comm reached
torch and reduced over every rank; now it never leaves comm, and the world is asked for by name
(``comm.world_group()``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron.core import comm
from tests.multiprocess import run_distributed

# What comm calls in torch; each is wrapped to record the group it was given.
_TORCH_CALLS = ("all_reduce", "all_gather", "broadcast", "broadcast_object_list",
                "all_gather_object", "barrier", "send", "recv")
_COMM_ALIASES = ("_all_gather_single", "_reduce_scatter_single")


@contextlib.contextmanager
def _recording():
    """Every torch collective comm issues, as ``(name, group)``, while still running it."""
    calls: list[tuple[str, object]] = []

    def wrap(name, original):
        def recorded(*args, **kwargs):
            calls.append((name, kwargs.get("group")))
            return original(*args, **kwargs)
        return recorded

    with contextlib.ExitStack() as stack:
        for name in _TORCH_CALLS:
            stack.enter_context(mock.patch.object(dist, name, wrap(name, getattr(dist, name))))
        for name in _COMM_ALIASES:
            stack.enter_context(mock.patch.object(comm, name, wrap(name, getattr(comm, name))))
        yield calls


def _none_alone_world_everyone(rank, world_size):
    # The calls reaching torch.distributed are counted: the collective checks' own descriptor
    # all-gathers would be among them (tests below check those). Pooled workers outlive the
    # test: the setting is put back.
    saved = os.environ.get("MEGATRON_CHECK_COLLECTIVES")
    os.environ["MEGATRON_CHECK_COLLECTIVES"] = "0"
    try:
        return _count_calls(rank)
    finally:
        if saved is None:
            os.environ.pop("MEGATRON_CHECK_COLLECTIVES")
        else:
            os.environ["MEGATRON_CHECK_COLLECTIVES"] = saved


def _count_calls(rank):
    mine = float(rank + 1)
    with _recording() as calls:
        alone = {"size": comm.world_size(None), "rank": comm.rank(None),
                 "global": comm.global_rank(None, 0)}
        t = torch.tensor([mine])
        alone["handle"] = comm.all_reduce(t, None)
        for op in ("max", "avg", "min"):
            comm.all_reduce(t, None, op=op)
        alone["reduced"] = t.item()
        out = torch.zeros(1)
        comm.all_gather_into(out, torch.tensor([mine]), None)
        alone["gathered_into"] = out.item()
        alone["gathered"] = [x.item() for x in comm.all_gather_list(torch.tensor([mine]), None)]
        out = torch.zeros(1)
        comm.reduce_scatter_into(out, torch.tensor([mine]), None)
        alone["scattered"] = out.item()
        t = torch.tensor([mine])
        comm.broadcast(t, 0, None)
        alone["broadcast"] = t.item()
        alone["object"] = comm.broadcast_object(rank, 0, None)
        alone["objects"] = comm.all_gather_object(rank, None)
        comm.barrier(None)
        refused = []
        for fn in (comm.send, comm.recv):
            with pytest.raises(ValueError, match="this rank alone"):
                fn(torch.zeros(1), 1 - rank, None)
            refused.append(fn.__name__)
        alone["refused"] = refused
        alone_calls = list(calls)

        everyone = comm.world_group()
        t = torch.tensor([mine])
        comm.all_reduce(t, everyone)
        world = {"size": comm.world_size(everyone), "rank": comm.rank(everyone),
                 "reduced": t.item(), "objects": comm.all_gather_object(rank, everyone),
                 "object": comm.broadcast_object(f"from {rank}", 1, everyone)}
        comm.barrier(everyone)
        world_calls = calls[len(alone_calls):]
    return alone, alone_calls, world, [(n, g is None) for n, g in world_calls]


def test_none_is_this_rank_alone_and_the_world_is_named():
    results = run_distributed(2, _none_alone_world_everyone)
    for rank, (alone, alone_calls, world, world_calls) in enumerate(results):
        mine = float(rank + 1)
        assert alone_calls == [], f"rank {rank}: group None reached torch: {alone_calls}"
        assert alone == {"size": 1, "rank": 0, "global": rank, "handle": None,
                         "reduced": mine, "gathered_into": mine, "gathered": [mine],
                         "scattered": mine, "broadcast": mine, "object": rank,
                         "objects": [rank], "refused": ["send", "recv"]}
        assert world == {"size": 2, "rank": rank, "reduced": 3.0, "objects": [0, 1],
                         "object": "from 1"}
        names = [n for n, _ in world_calls]
        assert names[0] == "all_reduce" and "barrier" in names, names
        assert not any(is_none for _, is_none in world_calls), world_calls


def test_without_torch_distributed_the_world_is_this_rank():
    if dist.is_initialized():
        pytest.skip("this pytest process joined a process group (the pooled ranks are separate)")
    assert comm.world_group() is None
    t = torch.tensor([5.0])
    comm.all_reduce(t, comm.world_group(), op="avg")
    comm.barrier(comm.world_group())
    assert t.item() == 5.0 and comm.world_size(comm.world_group()) == 1


@pytest.mark.parametrize("name", ["all_reduce", "all_gather_into", "all_gather_list",
                                  "reduce_scatter_into", "broadcast", "broadcast_object",
                                  "all_gather_object", "barrier", "send", "recv", "world_size",
                                  "rank", "global_rank"])
def test_every_group_is_given_explicitly(name):
    """No default: a call that forgets its group fails at once instead of meaning something."""
    parameter = inspect.signature(getattr(comm, name)).parameters["group"]
    assert parameter.default is inspect.Parameter.empty, name


def _break_nccl_rules(rank, world_size):
    """Three collectives NCCL would refuse or corrupt, which gloo may let through."""
    world = comm.world_group()
    errors = []
    for call in (lambda: comm.all_reduce(torch.zeros(2 + rank), world),  # shapes differ
                 lambda: comm.broadcast(torch.zeros(2, dtype=torch.float64 if rank else
                                                    torch.float32), 0, world),  # dtypes differ
                 lambda: comm.all_reduce(torch.zeros(4, 4).t(), world),  # not contiguous
                 lambda: comm.all_reduce(torch.zeros(2, device="meta"), world)):  # wrong device
        try:
            call()
            errors.append(None)
        except comm.CollectiveCheckError as exc:
            errors.append(str(exc))
    return errors


def test_collectives_check_what_nccl_requires_and_name_the_caller():
    """Under MEGATRON_CHECK_COLLECTIVES=1 (the suite's setting) a gloo run fails where an NCCL
    run would, on every rank, naming this file and line."""
    assert comm.checking_collectives()
    for rank, errors in enumerate(run_distributed(2, _break_nccl_rules)):
        shapes, dtypes, layout, device = errors
        assert "test_comm.py:" in shapes and "rank 0: torch.float32 (2,)" in shapes \
            and "rank 1: torch.float32 (3,)" in shapes, shapes
        assert "rank 1: torch.float64 (2,)" in dtypes, dtypes
        assert "non-contiguous" in layout, layout
        assert "tensor on meta, but the compute device is cpu" in device, device
