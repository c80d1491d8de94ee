"""Point-to-point communication between adjacent pipeline stages.

Activations ``[s, b, h]`` travel forward (to the next stage), their gradients backward (to the
previous one). Receive buffers are allocated from a shape known ahead: (seq, micro-batch, hidden)
as Megatron-LM does, or, with ``variable_seq_lengths``, from a 3-integer shape message sent just
before the tensor.

Ordering rule (why no backend deadlocks or mixes up messages): one exchange may move up to four
tensors. Two messages between the same pair of ranks are matched in the order they were posted,
on NCCL and on gloo alike; with two stages the next and the previous rank are the same peer, so
an activation and a gradient can share the pair. Every exchange therefore posts the
forward-direction messages (send to next, receive from previous) before the backward-direction
ones (send to previous, receive from next) on every rank: both ends list a pair's messages in
the same order. Batched (``batch_isend_irecv``, Megatron's default and the schedules') posts
them as one group; the unbatched path (``batch_p2p_comm=False``) posts them one by one with
Megatron's even/odd order, so that on a backend whose single sends block until matched, each
pair has one rank sending while the other receives (gloo's never block; with an odd number of
stages the interleaved schedule's wrap-around pair is two even ranks, so use the batched path
there on NCCL).

Legend: s = sequence length (divided by TP with sequence parallelism), b = micro-batch size,
h = hidden size.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core import comm, device
from megatron.core.timers import Timers, timed

Shape = tuple[int, ...]


@dataclasses.dataclass
class Exchange:
    """What one call moves: tensors to send, and which receives to post."""

    send_next: torch.Tensor | None = None
    send_prev: torch.Tensor | None = None
    recv_prev: bool = False
    recv_next: bool = False
    name: str = ""
    """Megatron's name for the call, also its timer's (``forward-send-backward-recv``...)."""

    def empty(self) -> bool:
        return (self.send_next is None and self.send_prev is None
                and not self.recv_prev and not self.recv_next)


class P2PCommunicator:
    """Send/receive between this rank and its neighbours in one pipeline group.

    Args:
        pp_group: the pipeline-parallel group (its ranks in stage order). Neighbours wrap around:
            the interleaved schedule sends from the last stage to the first.
        dtype: dtype of received tensors, the activations' (fp32, or the 16-bit one with
            mixed precision; Megatron's ``pipeline_dtype``).
        variable_seq_lengths: exchange each tensor's shape before it, for models whose
            sequence length changes between micro-batches.
        batch_p2p_comm: post each exchange's operations as one batch (Megatron's default);
            False posts them one by one in even/odd order.
        timers: records the level-2 ``forward-recv``, ``forward-send``... timers.
    """

    def __init__(self, pp_group: comm.ProcessGroup | None, *,
                 dtype: torch.dtype = torch.float32, variable_seq_lengths: bool = False,
                 batch_p2p_comm: bool = True, timers: Timers | None = None) -> None:
        self.pp_group = pp_group
        self.dtype = dtype
        self.variable_seq_lengths = variable_seq_lengths
        self.batch_p2p_comm = batch_p2p_comm
        self.timers = timers
        self.size = comm.world_size(pp_group)
        self.rank = comm.rank(pp_group)
        if self.size > 1:
            self.next_rank = comm.global_rank(pp_group, (self.rank + 1) % self.size)
            self.prev_rank = comm.global_rank(pp_group, (self.rank - 1) % self.size)

    # Megatron-LM's p2p_communication functions ------------------------------------------------
    def recv_forward(self, tensor_shape: Shape) -> torch.Tensor:
        """Activation from the previous stage (gradients flow back into it)."""
        return self._call(Exchange(recv_prev=True, name="forward-recv"), tensor_shape)[0]

    def recv_backward(self, tensor_shape: Shape) -> torch.Tensor:
        """Gradient of this stage's output, from the next stage."""
        return self._call(Exchange(recv_next=True, name="backward-recv"), tensor_shape)[1]

    def send_forward(self, output_tensor: torch.Tensor) -> None:
        self._call(Exchange(send_next=output_tensor, name="forward-send"), None)

    def send_backward(self, input_tensor_grad: torch.Tensor) -> None:
        self._call(Exchange(send_prev=input_tensor_grad, name="backward-send"), None)

    def send_forward_recv_backward(self, output_tensor: torch.Tensor,
                                   tensor_shape: Shape) -> torch.Tensor:
        return self._call(Exchange(send_next=output_tensor, recv_next=True,
                                   name="forward-send-backward-recv"), tensor_shape)[1]

    def send_backward_recv_forward(self, input_tensor_grad: torch.Tensor,
                                   tensor_shape: Shape) -> torch.Tensor:
        return self._call(Exchange(send_prev=input_tensor_grad, recv_prev=True,
                                   name="backward-send-forward-recv"), tensor_shape)[0]

    def send_forward_recv_forward(self, output_tensor: torch.Tensor | None, recv_prev: bool,
                                  tensor_shape: Shape) -> torch.Tensor | None:
        return self._call(Exchange(send_next=output_tensor, recv_prev=recv_prev,
                                   name="forward-send-forward-recv"), tensor_shape)[0]

    def send_backward_recv_backward(self, input_tensor_grad: torch.Tensor | None,
                                    recv_next: bool, tensor_shape: Shape) -> torch.Tensor | None:
        return self._call(Exchange(send_prev=input_tensor_grad, recv_next=recv_next,
                                   name="backward-send-backward-recv"), tensor_shape)[1]

    def send_forward_backward_recv_forward_backward(
            self, output_tensor: torch.Tensor | None, input_tensor_grad: torch.Tensor | None,
            recv_prev: bool, recv_next: bool,
            tensor_shape: Shape) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._call(Exchange(output_tensor, input_tensor_grad, recv_prev, recv_next,
                                   name="forward-backward-send-forward-backward-recv"),
                          tensor_shape)

    # The one primitive -----------------------------------------------------------------------
    def _call(self, exchange: Exchange,
              tensor_shape: Shape | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if exchange.empty():
            return None, None  # nothing moves: no timer entry either, as Megatron's
        with timed(self.timers, exchange.name, 2):
            return self.communicate(exchange, tensor_shape)

    def communicate(self, exchange: Exchange,
                    tensor_shape: Shape | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one exchange with the neighbours; returns (from previous, from next).

        Received activations require grad when autograd is on (the stage's backward fills their
        ``.grad``, which is what travels back).
        """
        if self.size == 1:
            raise RuntimeError("point-to-point communication needs a pipeline group of more "
                               "than one stage")
        for sent in (exchange.send_next, exchange.send_prev):
            if sent is not None and sent.dtype != self.dtype:
                # The receiver allocates self.dtype: the bytes would be misread.
                raise ValueError(f"a pipeline stage sends {sent.dtype} but the stages exchange "
                                 f"{self.dtype}: pass the activations' dtype to the schedule "
                                 "(dtype=, Megatron's pipeline_dtype)")
        shape_prev = shape_next = tensor_shape
        if self.variable_seq_lengths:
            shape_prev, shape_next = self._exchange_shapes(exchange)
        recv_prev = self._buffer(shape_prev, torch.is_grad_enabled()) if exchange.recv_prev \
            else None
        recv_next = self._buffer(shape_next, False) if exchange.recv_next else None
        self._post_and_wait(exchange, recv_prev, recv_next)
        return recv_prev, recv_next

    def _buffer(self, shape: Shape | None, requires_grad: bool,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        if shape is None:
            raise ValueError("a receive needs the tensor's shape (seq, micro-batch, hidden)")
        return torch.empty(tuple(shape), dtype=dtype or self.dtype, device=device.get_device(),
                           requires_grad=requires_grad)

    def _exchange_shapes(self, exchange: Exchange) -> tuple[Shape | None, Shape | None]:
        """Megatron's ``_communicate_shapes``: every sent tensor is announced by its shape."""
        def shape_of(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            return torch.tensor(tensor.shape, dtype=torch.int64, device=device.get_device())

        shapes = Exchange(shape_of(exchange.send_next), shape_of(exchange.send_prev),
                          exchange.recv_prev, exchange.recv_next)
        prev = self._buffer((3,), False, torch.int64) if exchange.recv_prev else None
        nxt = self._buffer((3,), False, torch.int64) if exchange.recv_next else None
        self._post_and_wait(shapes, prev, nxt)
        return (None if prev is None else tuple(prev.tolist()),
                None if nxt is None else tuple(nxt.tolist()))

    def _operations(self, exchange: Exchange, recv_prev: torch.Tensor | None,
                    recv_next: torch.Tensor | None) -> list[tuple[str, torch.Tensor, int]]:
        """The exchange's operations, forward direction first (see the module docstring)."""
        forward = []
        if exchange.send_next is not None:
            forward.append(("send", _contiguous(exchange.send_next), self.next_rank))
        if recv_prev is not None:
            forward.append(("recv", recv_prev, self.prev_rank))
        backward = []
        if exchange.send_prev is not None:
            backward.append(("send", _contiguous(exchange.send_prev), self.prev_rank))
        if recv_next is not None:
            backward.append(("recv", recv_next, self.next_rank))
        if not self.batch_p2p_comm and self.rank % 2 == 1:
            # Odd ranks receive first in each direction while their even neighbours send.
            forward.reverse()
            backward.reverse()
        return forward + backward

    def _post_and_wait(self, exchange: Exchange, recv_prev: torch.Tensor | None,
                       recv_next: torch.Tensor | None) -> None:
        ops = self._operations(exchange, recv_prev, recv_next)
        if self.batch_p2p_comm:
            handles = comm.batch_isend_irecv(ops, self.pp_group)
        else:
            handles = [(comm.isend if kind == "send" else comm.irecv)(tensor, peer, self.pp_group)
                       for kind, tensor, peer in ops]
        comm.wait(handles, "pipeline send/recv", self.pp_group)
        if self.batch_p2p_comm:
            # NCCL's batched operations run on their own stream: make the received data visible
            # to the compute stream before it is used (a no-op on the CPU), as Megatron does.
            device.synchronize()


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    # A send reads raw memory: a strided view would send the wrong elements.
    return tensor.detach().contiguous()
