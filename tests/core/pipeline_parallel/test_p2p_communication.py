"""Point-to-point exchanges between pipeline stages over real gloo ranks.

The hard case is two stages: the next and the previous rank are the same peer, so an activation
and a gradient travel between the same two ranks in one exchange and must not be swapped.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from tests.multiprocess import run_distributed

SHAPE = (3, 2, 4)


def _value(rank: int, what: str) -> torch.Tensor:
    # Activations are rank + 0.25, gradients -(rank + 0.5): a swap is visible.
    value = rank + 0.25 if what == "act" else -(rank + 0.5)
    return torch.full(SHAPE, value)


def _both_directions(rank, world_size):
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    group = parallel_state.get_pipeline_model_parallel_group()
    out = {}
    for batched in (True, False):
        p2p = P2PCommunicator(group, batch_p2p_comm=batched)
        from_prev, from_next = p2p.send_forward_backward_recv_forward_backward(
            _value(rank, "act"), _value(rank, "grad"), recv_prev=True, recv_next=True,
            tensor_shape=SHAPE)
        prev, nxt = (rank - 1) % world_size, (rank + 1) % world_size
        out[batched] = (torch.equal(from_prev, _value(prev, "act")),
                        torch.equal(from_next, _value(nxt, "grad")),
                        from_prev.requires_grad, from_next.requires_grad)
    # One direction at a time, in 1F1B's order, under no_grad (evaluation).
    p2p = P2PCommunicator(group)
    with torch.no_grad():
        if rank == 0:
            p2p.send_forward(_value(rank, "act"))
            received = p2p.recv_backward(SHAPE)
            out["one-way"] = torch.equal(received, _value(1, "grad"))
        elif rank == 1:
            received = p2p.recv_forward(SHAPE)
            out["one-way"] = torch.equal(received, _value(0, "act")) and \
                not received.requires_grad
            p2p.send_backward(_value(rank, "grad"))
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_exchange_in_both_directions_at_once(world_size):
    for rank, out in enumerate(run_distributed(world_size, _both_directions)):
        for batched in (True, False):
            assert out[batched] == (True, True, True, False), (rank, batched)
        if rank < 2:
            assert out["one-way"], rank


def _variable_shapes_and_dtypes(rank, world_size):
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    group = parallel_state.get_pipeline_model_parallel_group()
    out = {}
    p2p = P2PCommunicator(group, variable_seq_lengths=True)
    if rank == 0:
        p2p.send_forward(torch.arange(5 * 2 * 4, dtype=torch.float32).view(5, 2, 4))
    else:
        received = p2p.recv_forward(None)
        out["shape"] = tuple(received.shape)
        out["values"] = torch.equal(received.flatten(), torch.arange(40, dtype=torch.float32))
    half = P2PCommunicator(group, dtype=torch.bfloat16)
    if rank == 0:
        half.send_forward(torch.ones(SHAPE, dtype=torch.bfloat16))
        try:
            half.send_forward(torch.ones(SHAPE))
        except ValueError as err:
            out["refused"] = str(err)
    else:
        out["dtype"] = half.recv_forward(SHAPE).dtype
    parallel_state.destroy_model_parallel()
    return out


def test_variable_shapes_and_dtypes():
    sender, receiver = run_distributed(2, _variable_shapes_and_dtypes)
    assert receiver["shape"] == (5, 2, 4) and receiver["values"]
    assert receiver["dtype"] == torch.bfloat16
    assert "sends torch.float32" in sender["refused"] and "dtype=" in sender["refused"]


def test_a_single_stage_has_no_peer():
    p2p = P2PCommunicator(None)
    with pytest.raises(RuntimeError, match="more than one stage"):
        p2p.recv_forward(SHAPE)
