"""The per-step work of the tensor-parallel layers at TP = 2, beyond their values (which
``test_tensor_parallel.py`` checks against one process):

* the all-reduces of a row-parallel layer's partial sums (forward) and of a column-parallel
  layer's input gradient (backward) run in place, on no copy of ``[s, b, h]``;
* without sequence parallelism the column-parallel layer's input-gradient all-reduce is started
  asynchronously before the weight-gradient GEMM and waited for after it (Megatron's async
  ``allreduce_dgrad``);
* with sequence parallelism the embedding output is this rank's own ``[s/p, b, h]`` storage
  (not a view of the whole sequence), reduce-scattered in one collective when there are word
  embeddings alone.
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
    # An activation, not a leaf: a leaf's AccumulateGrad copies a gradient it cannot steal,
    # and gloo's work object may still hold the all-reduced input gradient when it arrives.
    activation = x * 1.0
    with _Recorder(events):
        hidden, _ = column(activation)
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
    _check_sequence_parallel_embedding(group, rank, world_size)
    ps.destroy_model_parallel()
    return True


def _check_sequence_parallel_embedding(group, rank, tp):
    from megatron.core.models.embedding import Embedding
    from megatron.core.transformer.config import TransformerConfig

    s, b, h = 8, 2, 16
    ids = torch.randint(0, 32, (b, s), generator=torch.Generator().manual_seed(5)).to(
        device.get_device())
    positions = torch.arange(s, device=device.get_device()).expand(b, s)
    for rope in (False, True):
        kwargs = dict(num_layers=1, hidden_size=h, num_attention_heads=2, padded_vocab_size=32,
                      max_position_embeddings=s, hidden_dropout=0.0, params_dtype=torch.float64,
                      position_embedding_type="rope" if rope else "learned_absolute")
        torch.manual_seed(1)
        whole = Embedding(TransformerConfig(**kwargs), None)(ids, positions)  # [s, b, h]
        torch.manual_seed(1)
        emb = Embedding(TransformerConfig(**kwargs, sequence_parallel=True), group)
        calls: list = []
        real = (comm.all_reduce, comm.reduce_scatter_into)
        comm.all_reduce = lambda *a, **k: (calls.append("all_reduce"), real[0](*a, **k))[1]
        comm.reduce_scatter_into = lambda *a, **k: (calls.append("reduce_scatter"),
                                                    real[1](*a, **k))[1]
        try:
            out = emb(ids, positions)  # [s/p, b, h]
        finally:
            comm.all_reduce, comm.reduce_scatter_into = real
        rows = s // tp
        torch.testing.assert_close(out, whole[rank * rows:(rank + 1) * rows], rtol=0, atol=0)
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
        assert calls == (["reduce_scatter"] if rope else ["all_reduce"]), (rope, calls)


def test_tp_layers_reduce_in_place_and_overlap_the_input_gradient():
    assert run_distributed(2, _checks) == [True, True]
