"""1F1B and interleaved schedules over real gloo stages equal one process (fp32).

A stack of Linear + tanh layers is split over PP = 2 and 4 ranks, with 1 or 2 chunks per rank;
every micro-batch's loss, every gradient and the forward-only losses must equal the whole stack
run on one process by the no-pipelining schedule; with DP = 2 and the local DDP's overlapping
reduction too.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.timers import Timers
from tests.core.pipeline_parallel import toy_stack
from tests.multiprocess import run_distributed

TOLERANCE = 1e-6
HIDDEN_SQUARED = toy_stack.HIDDEN * toy_stack.HIDDEN  # a bucket per layer weight: several

# (chunks per rank, micro-batches) per pipeline size: m < p, m = p (the interleaved schedule's
# all-warm-up case) and m > p.
CASES = {2: [(1, 1), (1, 2), (1, 5), (2, 2), (2, 6)],
         4: [(1, 2), (1, 6), (2, 4), (2, 8)]}


def _loss_scale(loss: torch.Tensor) -> torch.Tensor:
    return loss * 8.0  # the fp16 loss scale's place: applied once, on the last stage


def _reference(num_layers: int, batches: list, forward_only: bool):
    layers = toy_stack.whole_stack(num_layers)
    whole = toy_stack.Chunk(layers, virtual_stage=0)
    losses = schedules.forward_backward_no_pipelining(
        forward_step_func=toy_stack.forward_step, data_iterator=iter(batches), model=[whole],
        num_microbatches=len(batches), forward_only=forward_only, grad_scale_func=_loss_scale)
    return [d["loss"].item() for d in losses], [l.weight.grad for l in layers]


def _pipelined(pp_size: int, num_chunks: int, num_layers: int, batches: list,
               forward_only: bool, timers: Timers | None = None):
    rank = parallel_state.get_pipeline_model_parallel_rank()
    layers = toy_stack.whole_stack(num_layers)
    chunks = toy_stack.chunks_of_rank(layers, pp_size, rank, num_chunks)
    schedule = schedules.get_forward_backward_func()
    losses = schedule(
        forward_step_func=toy_stack.forward_step,
        data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=len(batches), seq_length=toy_stack.SEQ,
        micro_batch_size=toy_stack.BATCH, forward_only=forward_only, timers=timers,
        grad_scale_func=_loss_scale)
    return [d["loss"].item() for d in losses], layers, chunks, schedule.__name__


def _max_diff(a: list, b: list) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def _check_cases(rank, world_size):
    out = []
    for num_chunks, m in CASES[world_size]:
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=world_size,
            virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None)
        num_layers = world_size * num_chunks * 2
        batches = toy_stack.micro_batches(m)
        ref_losses, ref_grads = _reference(num_layers, batches, forward_only=False)
        timers = Timers(log_level=2)
        losses, layers, chunks, schedule = _pipelined(world_size, num_chunks, num_layers,
                                                      batches, False, timers)
        mine = {id(p) for c in chunks for p in c.parameters()}
        grad_diff = max((l.weight.grad - g).abs().max().item()
                        for l, g in zip(layers, ref_grads) if id(l.weight) in mine)
        others_untouched = all(l.weight.grad is None for l in layers if id(l.weight) not in mine)
        fwd_ref, _ = _reference(num_layers, batches, forward_only=True)
        fwd_losses, _, _, _ = _pipelined(world_size, num_chunks, num_layers, batches, True)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        out.append({
            "case": (world_size, num_chunks, m), "last": last, "schedule": schedule,
            "n_losses": len(losses), "loss_diff": _max_diff(losses, ref_losses) if last else 0.0,
            "grad_diff": grad_diff, "others_untouched": others_untouched,
            "fwd_n": len(fwd_losses), "fwd_diff": _max_diff(fwd_losses, fwd_ref) if last else 0.0,
            "timers": sorted(name for name in timers.names() if timers(name).elapsed(False) > 0),
        })
        parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_pipelined_schedules_equal_one_process(world_size):
    results = run_distributed(world_size, _check_cases)
    for rank, cases in enumerate(results):
        for case in cases:
            what = f"rank {rank} case (pp, chunks, m) = {case['case']}"
            m, interleaved = case["case"][2], case["case"][1] > 1
            assert case["schedule"] == ("forward_backward_pipelining_with_interleaving"
                                        if interleaved else
                                        "forward_backward_pipelining_without_interleaving"), what
            assert case["n_losses"] == (m if case["last"] else 0), what
            assert case["fwd_n"] == (m if case["last"] else 0), what
            assert case["loss_diff"] <= TOLERANCE, what
            assert case["fwd_diff"] <= TOLERANCE, what
            assert case["grad_diff"] <= TOLERANCE, what
            assert case["others_untouched"], what
            assert {"forward-compute", "backward-compute", "batch-generator"} <= \
                set(case["timers"]), what
    # Every stage waited in some receive or send, under Megatron's timer names.
    timer_names = {n for cases in results for c in cases for n in c["timers"]}
    assert {"forward-recv", "forward-send", "backward-recv", "backward-send",
            "forward-send-backward-recv", "backward-send-forward-recv"} <= timer_names


def _check_with_data_parallel(rank, world_size):
    """PP = 2 x DP = 2 with the local DDP (overlapping, small buckets): each chunk's reduction
    starts during its last backward, and the averaged gradients equal one process running all
    the micro-batches."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.distributed.config import DistributedDataParallelConfig
    from megatron.core.distributed.ddp import DistributedDataParallel

    out = []
    for num_chunks in (1, 2):
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None)
        dp_rank = parallel_state.get_data_parallel_rank()
        num_layers, m = 2 * num_chunks * 2, 4
        batches = toy_stack.micro_batches(2 * m)
        _, ref_grads = _reference(num_layers, batches, forward_only=False)
        layers = toy_stack.whole_stack(num_layers)
        chunks = toy_stack.chunks_of_rank(
            layers, 2, parallel_state.get_pipeline_model_parallel_rank(), num_chunks)
        config = DistributedDataParallelConfig(overlap_grad_reduce=True)
        wrapped = [DistributedDataParallel(c, config,
                                           dp_group=parallel_state.get_data_parallel_group(),
                                           bucket_size=HIDDEN_SQUARED) for c in chunks]
        mine = batches[dp_rank * m:(dp_rank + 1) * m]
        schedules.get_forward_backward_func()(
            forward_step_func=toy_stack.forward_step,
            data_iterator=[iter(mine) for _ in chunks], model=wrapped, num_microbatches=m,
            seq_length=toy_stack.SEQ, micro_batch_size=toy_stack.BATCH,
            grad_scale_func=_loss_scale)
        started = [w.grad_sync_started() for w in wrapped]
        finalize_model_grads(wrapped)
        owned = {id(p) for c in chunks for p in c.parameters()}
        # The reference is the mean over 2m micro-batches; DP averages two means over m.
        diff = max((l.weight.main_grad - g).abs().max().item()
                   for l, g in zip(layers, ref_grads) if id(l.weight) in owned)
        out.append((num_chunks, started, diff))
        parallel_state.destroy_model_parallel()
    return out


def test_pipelined_with_data_parallel_overlap():
    for rank, cases in enumerate(run_distributed(4, _check_with_data_parallel)):
        for num_chunks, started, diff in cases:
            assert all(started), (rank, num_chunks)
            assert diff <= TOLERANCE, (rank, num_chunks, diff)
