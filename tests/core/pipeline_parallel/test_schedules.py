"""Order of sends, receives and compute in the pipelined schedules (no process group).

Each rank's schedule runs alone against a fake communicator that records every exchange and
returns made-up tensors. The recorded order is checked against the order derived by hand from
Megatron-LM's algorithms, and all ranks' records are then replayed together: a simulated run in
which a send completes only when its receive is posted (as a large gloo or NCCL message does),
messages between two ranks match in posting order, and every message must reach the micro-batch
and virtual stage it was meant for. A schedule that would hang, or hand a gradient to a forward,
fails here.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import pytest
import torch

from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import Exchange, P2PCommunicator
from tests.core.pipeline_parallel import toy_stack

SHAPE = (toy_stack.SEQ, toy_stack.BATCH, toy_stack.HIDDEN)


class Recorder:
    """One rank's log: exchanges, compute events, and which tensor belongs to what."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple]]] = []  # (name, [(op, peer, direction, tag)])
        self.events: list[tuple] = []                    # ("F" | "B" | "sync", ...)
        self.produced: dict[int, tuple] = {}             # id(tensor) -> what it carries
        self.keep: list[torch.Tensor] = []               # keeps ids unique
        self.inputs: list[tuple[torch.Tensor, int, int]] = []  # (input, stage, micro-batch)
        self.consumed: dict[object, tuple] = {}          # receive tag -> who used it


class FakeCommunicator(P2PCommunicator):
    """Records instead of communicating; received gradients are filled with a unique value
    so the output's hook can tell which receive reached which backward."""

    _uid = itertools.count(1)

    def __init__(self, rank: int, size: int, recorder: Recorder) -> None:
        super().__init__(None)
        self.rank, self.size = rank, size
        self.next_rank, self.prev_rank = (rank + 1) % size, (rank - 1) % size
        self.recorder = recorder

    def communicate(self, exchange: Exchange, tensor_shape):
        rec, ops = self.recorder, []
        if exchange.send_next is not None:
            ops.append(("send", self.next_rank, "fwd", rec.produced[id(exchange.send_next)]))
        recv_prev = recv_next = None
        if exchange.recv_prev:
            recv_prev = torch.randn(tensor_shape, requires_grad=torch.is_grad_enabled())
            rec.keep.append(recv_prev)
            ops.append(("recv", self.prev_rank, "fwd", ("recv", id(recv_prev))))
        if exchange.send_prev is not None:
            ops.append(("send", self.prev_rank, "bwd", self._grad_tag(exchange.send_prev)))
        if exchange.recv_next:
            uid = next(self._uid)
            recv_next = torch.full(tensor_shape, float(uid))
            ops.append(("recv", self.next_rank, "bwd", ("recv", uid)))
        rec.calls.append((exchange.name, ops))
        return recv_prev, recv_next

    def _grad_tag(self, grad: torch.Tensor) -> tuple:
        for input_tensor, stage, micro_batch in self.recorder.inputs:
            if input_tensor.grad is grad:
                return ("grad", stage, micro_batch)
        raise AssertionError("a gradient was sent that is no stage input's gradient")


class RecordingChunk(toy_stack.Chunk):
    """A toy chunk whose ``no_sync`` logs when the schedule re-enables gradient sync."""

    def __init__(self, layers, virtual_stage: int, num_stages: int,
                 recorder: Recorder) -> None:
        super().__init__(layers, virtual_stage)
        self.is_last = virtual_stage == num_stages - 1
        self.recorder = recorder

    @contextlib.contextmanager
    def no_sync(self):
        yield
        self.recorder.events.append(("sync", self.virtual_stage))


def _forward_step(recorder: Recorder, data_iterator, model: RecordingChunk):
    micro_batch, (data, target) = next(data_iterator)
    stage = model.virtual_stage
    recorder.events.append(("F", stage, micro_batch))
    if model.input_tensor is not None:
        recorder.inputs.append((model.input_tensor, stage, micro_batch))
        recorder.consumed[("recv", id(model.input_tensor))] = ("act-in", stage, micro_batch)
    output = model(data)
    if output.requires_grad and not model.is_last:
        output.register_hook(functools.partial(_grad_arrived, recorder, stage, micro_batch))
    recorder.produced[id(output)] = ("act", stage, micro_batch)
    recorder.keep.append(output)
    return output, functools.partial(_loss, recorder, stage, micro_batch, target)


def _grad_arrived(recorder, stage, micro_batch, grad):
    recorder.events.append(("B", stage, micro_batch))
    recorder.consumed[("recv", int(grad.flatten()[0].item()))] = ("grad-in", stage, micro_batch)


def _loss(recorder, stage, micro_batch, target, output):
    loss = ((output - target) ** 2).mean()
    if loss.requires_grad:
        loss.register_hook(lambda g: recorder.events.append(("B", stage, micro_batch)))
    return loss, {"loss": loss.detach()}


def _run_rank(rank: int, pp: int, vpp: int, m: int, forward_only: bool) -> Recorder:
    recorder = Recorder()
    layers = toy_stack.whole_stack(pp * vpp)
    chunks = [RecordingChunk(c.layers, c.virtual_stage, pp * vpp, recorder)
              for c in toy_stack.chunks_of_rank(layers, pp, rank, vpp)]
    batches = list(enumerate(toy_stack.micro_batches(m)))
    schedule = schedules.forward_backward_pipelining_with_interleaving if vpp > 1 \
        else schedules.forward_backward_pipelining_without_interleaving
    losses = schedule(forward_step_func=functools.partial(_forward_step, recorder),
                      data_iterator=[iter(batches) for _ in chunks], model=chunks,
                      num_microbatches=m, seq_length=SHAPE[0], micro_batch_size=SHAPE[1],
                      forward_only=forward_only,
                      p2p_communicator=FakeCommunicator(rank, pp, recorder))
    assert len(losses) == (m if rank == pp - 1 else 0)
    return recorder


def _compute_order(recorder: Recorder) -> list[tuple]:
    return [e for e in recorder.events if e[0] == "F"]


# Hand-derived orders ---------------------------------------------------------------------------
def expected_1f1b_calls(pp: int, rank: int, m: int, forward_only: bool) -> list[str]:
    """Megatron's 1F1B, written out: warm-up min(p - r - 1, m) forwards, steady 1F1B, cool-down;
    first stage never receives activations, last never sends them."""
    first, last = rank == 0, rank == pp - 1
    warmup = min(pp - rank - 1, m)
    calls = []
    for _ in range(warmup):
        calls += ([] if first else ["forward-recv"]) + ([] if last else ["forward-send"])
    remaining = m - warmup
    if remaining and not first:
        calls.append("forward-recv")
    for i in range(remaining):
        final = i == remaining - 1
        if forward_only:
            calls += [] if last else ["forward-send"]
            calls += [] if final or first else ["forward-recv"]
            continue
        calls += [] if last else ["forward-send-backward-recv"]
        if not first:
            calls.append("backward-send" if final else "backward-send-forward-recv")
    if not forward_only:
        for _ in range(warmup):
            calls += ["backward-recv"] + ([] if first else ["backward-send"])
    return calls


def expected_interleaved_forwards(pp: int, rank: int, vpp: int, m: int) -> list[tuple]:
    """Forward k runs chunk (k mod p·v) // p on micro-batch (k // p·v)·p + k mod p."""
    order = []
    for k in range(m * vpp):
        chunk = (k % (pp * vpp)) // pp
        order.append(("F", chunk * pp + rank, (k // (pp * vpp)) * pp + k % pp))
    return order


def megatron_interleaved_warmup(pp: int, rank: int, vpp: int, m: int) -> int:
    if m == pp:
        return m * vpp
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, m * vpp)


# The replay ------------------------------------------------------------------------------------
def replay(recorders: list[Recorder]) -> None:
    """Run every rank's recorded exchanges together; a send completes only when the matching
    receive is posted and the other way round. Fails on a hang, on a message of the wrong kind,
    or on a tensor handed to the wrong stage or micro-batch."""
    pp = len(recorders)
    queues: dict[tuple[int, int, str], list] = {}  # (src, dst, op) -> [(direction, tag)]
    position = [0] * pp
    waits: dict[int, list] = {}  # rank -> [(counterpart queue, length it must reach)]

    def post(rank: int) -> None:
        waits[rank] = []
        for op, peer, direction, tag in recorders[rank].calls[position[rank]][1]:
            pair = (rank, peer) if op == "send" else (peer, rank)
            mine = queues.setdefault((*pair, op), [])
            mine.append((direction, tag))
            waits[rank].append(((*pair, "recv" if op == "send" else "send"), len(mine)))

    for rank in range(pp):
        if recorders[rank].calls:
            post(rank)
    while True:
        active = [r for r in range(pp) if position[r] < len(recorders[r].calls)]
        if not active:
            break
        done = [r for r in active
                if all(len(queues.get(key, [])) >= n for key, n in waits[r])]
        if not done:
            stuck = {r: recorders[r].calls[position[r]][0] for r in active}
            raise AssertionError(f"deadlock: ranks wait in {stuck}")
        for rank in done:
            position[rank] += 1
            if position[rank] < len(recorders[rank].calls):
                post(rank)
    for src, dst in itertools.product(range(pp), repeat=2):
        sends, recvs = queues.get((src, dst, "send"), []), queues.get((src, dst, "recv"), [])
        assert len(sends) == len(recvs), f"{src}->{dst}: {len(sends)} sends, {len(recvs)} recvs"
        for (d_send, sent), (d_recv, received) in zip(sends, recvs):
            assert d_send == d_recv, f"{src}->{dst}: a {d_send} message received as {d_recv}"
            used = recorders[dst].consumed.get(received)
            kind, stage, micro_batch = sent
            want = ("act-in", stage + 1, micro_batch) if kind == "act" \
                else ("grad-in", stage - 1, micro_batch)
            assert used == want, f"{src}->{dst}: {sent} reached {used}"


def check_grad_sync(recorder: Recorder, stages: list[int]) -> None:
    """Each chunk's gradient sync is re-enabled once, between its last two backwards."""
    events = recorder.events
    for stage in stages:
        backwards = [i for i, e in enumerate(events) if e[0] == "B" and e[1] == stage]
        sync = [i for i, e in enumerate(events) if e == ("sync", stage)]
        assert len(sync) == 1, (stage, events)
        assert sync[0] < backwards[-1], (stage, events)
        assert len(backwards) < 2 or backwards[-2] < sync[0], (stage, events)


ONE_F_ONE_B = [(2, 1), (2, 2), (2, 5), (3, 2), (3, 7), (4, 3), (4, 8)]
INTERLEAVED = [(2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (3, 2, 6), (4, 2, 4), (4, 2, 8),
               (4, 3, 12)]


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("pp,m", ONE_F_ONE_B)
def test_1f1b_order_matches_megatron_and_replays(pp, m, forward_only):
    recorders = [_run_rank(rank, pp, 1, m, forward_only) for rank in range(pp)]
    for rank, rec in enumerate(recorders):
        assert [name for name, _ in rec.calls] == \
            expected_1f1b_calls(pp, rank, m, forward_only), f"rank {rank}"
        assert _compute_order(rec) == [("F", rank, i) for i in range(m)]
    replay(recorders)


@pytest.mark.parametrize("pp,m", [(2, 5), (4, 3), (4, 8)])
def test_1f1b_warmup_count_and_grad_sync(pp, m):
    for rank in range(pp):
        rec = _run_rank(rank, pp, 1, m, False)
        first_backward = next(i for i, e in enumerate(rec.events) if e[0] == "B")
        forwards_before = sum(e[0] == "F" for e in rec.events[:first_backward])
        # The warm-up, then the steady state's first forward (if any is left).
        warmup = min(pp - rank - 1, m)
        assert forwards_before == warmup + (1 if m > warmup else 0), f"rank {rank}"
        assert [e for e in rec.events if e[0] == "B"] == [("B", rank, i) for i in range(m)]
        check_grad_sync(rec, [rank])


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("pp,vpp,m", INTERLEAVED)
def test_interleaved_order_matches_megatron_and_replays(pp, vpp, m, forward_only):
    recorders = [_run_rank(rank, pp, vpp, m, forward_only) for rank in range(pp)]
    for rank, rec in enumerate(recorders):
        assert _compute_order(rec) == expected_interleaved_forwards(pp, rank, vpp, m)
        warmup = m * vpp if forward_only else megatron_interleaved_warmup(pp, rank, vpp, m)
        assert schedules.interleaved_warmup_microbatches(pp, rank, vpp, m, forward_only) == \
            warmup
        if not forward_only:
            first_backward = next(i for i, e in enumerate(rec.events) if e[0] == "B")
            forwards_before = sum(e[0] == "F" for e in rec.events[:first_backward])
            assert forwards_before == min(warmup + 1, m * vpp), f"rank {rank}"
            check_grad_sync(rec, [c * pp + rank for c in range(vpp)])
    replay(recorders)


def test_interleaved_two_stages_by_hand():
    """PP = 2, two chunks, m = 4, written out from Megatron's algorithm: rank 0 warms up with
    (2-0-1)·2 + 1·2 = 4 forwards, rank 1 with 2; virtual stages 0, 2 on rank 0 and 1, 3 on 1."""
    recorders = [_run_rank(rank, 2, 2, 4, False) for rank in range(2)]
    names = {r: [name for name, _ in recorders[r].calls] for r in range(2)}
    assert names[0] == ["forward-send-forward-recv"] * 3 + \
        ["forward-backward-send-forward-backward-recv"] * 5 + \
        ["backward-send-backward-recv"] * 3  # the last backward (stage 0) sends nothing
    assert names[1] == ["forward-recv"] + ["forward-send-forward-recv"] + \
        ["forward-backward-send-forward-backward-recv"] * 7 + \
        ["backward-send-backward-recv"] * 2
    replay(recorders)


def test_interleaved_needs_microbatches_divisible_by_stages():
    with pytest.raises(ValueError, match=r"micro-batches \(3\).*--pipeline-model-parallel-size"):
        _run_rank(0, 2, 2, 3, False)


def test_replay_catches_mismatched_order():
    """The replay is a real check: swapping two of a rank's exchanges hangs or misroutes."""
    recorders = [_run_rank(rank, 2, 1, 3, False) for rank in range(2)]
    calls = recorders[1].calls
    calls[0], calls[1] = calls[1], calls[0]
    with pytest.raises(AssertionError):
        replay(recorders)
