"""Local DDP: DP=2/4 equal DP=1 at the same global batch; bucketed overlap equals no overlap."""

from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed.grad_buffer import compute_layout
from tests.core.distributed import tiny_model
from tests.multiprocess import run_distributed

STEPS = 4


def _check_dp_equals_single(rank, world_size):
    parallel_state.initialize_model_parallel()
    dp = parallel_state.get_data_parallel_group()
    single = parallel_state.get_model_parallel_group()  # a group of one rank at TP=PP=1
    out = {}
    ref, ref_opt = tiny_model.build(single, single)
    ref_losses, _ = tiny_model.train(ref, ref_opt, STEPS, single, micro_batches=2 * world_size)
    variants = {"plain": {}, "overlap": dict(overlap=True, bucket_size=100),
                "fp32-accumulate-overlap": dict(overlap=True, bucket_size=1, accumulate=True),
                "no-contiguous-buffers": dict(contiguous=False)}
    for name, kwargs in variants.items():
        ddp, opt = tiny_model.build(dp, single, **kwargs)
        check = None
        if kwargs.get("overlap"):
            assert len(next(iter(ddp.grad_buffers.values())).buckets) > 1
            check = _check_overlap_launches_during_backward
        losses, _ = tiny_model.train(ddp, opt, STEPS, dp, after_backward=check)
        out[name] = (max(abs(a - b) for a, b in zip(losses, ref_losses)),
                     tiny_model.max_param_diff(ddp.module, ref.module))
    out["ref_losses"] = ref_losses
    return out


def _check_overlap_launches_during_backward(last_micro_batch, ddp):
    # Inside no_sync nothing may be launched; after the last backward every bucket must already
    # be in flight, before finalize_model_grads (else the "overlap" is a synchronous reduction).
    buckets = [b for buf in ddp.grad_buffers.values() for b in buf.buckets]
    if last_micro_batch:
        assert all(b.started for b in buckets)
    else:
        assert not ddp.grad_sync_started()


@pytest.mark.parametrize("world_size", [2, 4])
def test_dp_equals_single_process(world_size):
    results = run_distributed(world_size, _check_dp_equals_single)
    for rank_result in results:
        losses = rank_result.pop("ref_losses")
        assert losses[-1] < losses[0]  # it trains
        for name, (loss_diff, param_diff) in rank_result.items():
            assert loss_diff < 1e-5, (name, loss_diff)
            assert param_diff < 1e-5, (name, param_diff)


def _check_fp16_without_contiguous_buffers(rank, world_size):
    # The non-contiguous path reduces param.grad (fp16 here) through a flattened copy, dividing
    # before the sum; it must take the same steps as the buffer path (same fp16 grads summed).
    parallel_state.initialize_model_parallel()
    dp = parallel_state.get_data_parallel_group()
    single = parallel_state.get_model_parallel_group()
    precision = dict(fp16=True, initial_loss_scale=1024.0)
    out = []
    for contiguous in (True, False):
        ddp, opt = tiny_model.build(dp, single, dtype=torch.float16, precision=precision,
                                    contiguous=contiguous)
        losses, results = tiny_model.train(ddp, opt, STEPS, dp)
        out.append((losses, [r[0] for r in results], ddp.module))
    (ref_losses, ref_ok, ref_model), (losses, ok, model) = out
    return (max(abs(a - b) for a, b in zip(losses, ref_losses)),
            tiny_model.max_param_diff(model, ref_model), ref_ok, ok)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp16_without_contiguous_buffers_equals_buffers(world_size):
    for loss_diff, param_diff, ref_ok, ok in run_distributed(world_size,
                                                             _check_fp16_without_contiguous_buffers):
        assert ok == ref_ok and all(ok)  # no overflow at this scale: every step taken
        assert loss_diff < 1e-3 and param_diff < 1e-3, (loss_diff, param_diff)


def _check_torch_ddp(rank, world_size):
    parallel_state.initialize_model_parallel()
    dp = parallel_state.get_data_parallel_group()
    single = parallel_state.get_model_parallel_group()
    ref, ref_opt = tiny_model.build(single, single)
    ref_losses, _ = tiny_model.train(ref, ref_opt, STEPS, single, micro_batches=2 * world_size)
    wrapped, opt = tiny_model.build(dp, single, ddp_impl="torch")
    losses, _ = tiny_model.train(wrapped, opt, STEPS, dp)
    return max(abs(a - b) for a, b in zip(losses, ref_losses))


def test_torch_ddp_impl_equals_single_process():
    assert max(run_distributed(2, _check_torch_ddp)) < 1e-5


def test_layout_is_reverse_order_and_padded():
    ranges, bounds, numel = compute_layout([5, 3, 7], None, 4)
    assert [(r.start, r.end) for r in ranges] == [(10, 15), (7, 10), (0, 7)]
    assert bounds == [(0, 16)] and numel == 16
    ranges, bounds, numel = compute_layout([5, 3, 7], 8, 4)
    assert bounds == [(0, 12), (12, 20)] and numel == 20
    assert ranges[0].bucket == 1 and ranges[2].bucket == 0
