"""The per-step work of the tensor-parallel layers at TP = 2, beyond their values (which
``test_tensor_parallel.py`` checks against one process):

* the all-reduces of a row-parallel layer's partial sums (forward) and of a column-parallel
  layer's input gradient (backward) run in place, on no copy of ``[s, b, h]``;
* without sequence parallelism the column-parallel layer's input-gradient all-reduce is started
  asynchronously before the weight-gradient GEMM and waited for after it (Megatron's async
  ``allreduce_dgrad``).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import comm, device
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           VocabParallelEmbedding, init_method_normal,
                                           reduce_from_tensor_model_parallel_region)
from tests.multiprocess import run_distributed


class _Recorder(TorchDispatchMode):
    """Names of the ATen ops run, in order."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.events.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _copies(events) -> int:
    return sum(e in ("clone", "copy_") for e in events)


def _checks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    dev = device.get_device()
    init = init_method_normal(0.1)
    x = torch.randn(4, 2, 8, device=dev, dtype=torch.float64, requires_grad=True)
    column = ColumnParallelLinear(8, 16, tp_group=group, init_method=init,
                                  params_dtype=torch.float64)
    row = RowParallelLinear(16, 8, tp_group=group, init_method=init, input_is_parallel=True,
                            params_dtype=torch.float64)
    embedding = VocabParallelEmbedding(32, 8, tp_group=group, init_method=init,
                                       params_dtype=torch.float64)
    events: list = []
    with _Recorder(events):
        hidden, _ = column(x)
        out, _ = row(hidden)
        out = out + embedding(torch.arange(8, device=dev).view(4, 2))
        out.sum().backward()
    assert _copies(events) == 0, events

    # The input-gradient all-reduce overlaps the weight-gradient GEMM.
    calls: list = []
    real_all_reduce, real_wait = comm.all_reduce, comm.wait

    def all_reduce(tensor, group_, op="sum", async_op=False):
        calls.append(("all_reduce", async_op))
        return real_all_reduce(tensor, group_, op, async_op)

    def wait(handles, op, group_):
        calls.append(("wait", op))
        return real_wait(handles, op, group_)

    comm.all_reduce, comm.wait = all_reduce, wait
    try:
        hidden, _ = column(x)
        grad = torch.ones_like(hidden)
        with _Recorder(calls):
            hidden.backward(grad)
    finally:
        comm.all_reduce, comm.wait = real_all_reduce, real_wait
    order = [c for c in calls if isinstance(c, tuple) or c in ("mm", "matmul", "addmm")]
    start, end = order.index(("all_reduce", True)), order.index(("wait", "all_reduce"))
    assert "mm" in order[start + 1:end], order  # the weight gradient, while it reduces
    # The public g keeps its input (it may be read elsewhere); the layers' own pass in_place.
    y = torch.ones(3, device=dev)
    reduce_from_tensor_model_parallel_region(y, group)
    assert torch.equal(y, torch.ones(3, device=dev))
    ps.destroy_model_parallel()
    return True


def test_tp_layers_reduce_in_place_and_overlap_the_input_gradient():
    assert run_distributed(2, _checks) == [True, True]
