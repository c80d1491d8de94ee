"""fp16 loss scaling (dynamic and constant) and the global grad-norm clipping with TP duplicates."""

from __future__ import annotations

import math

import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import DynamicGradScaler, OptimizerConfig, get_megatron_optimizer
from tests.core.distributed import tiny_model
from tests.multiprocess import run_distributed


def test_dynamic_scaler_rules():
    scaler = DynamicGradScaler(initial_scale=2.0 ** 10, min_scale=256.0, growth_interval=3,
                               hysteresis=2)
    history = []
    for found_inf in [True, True, True, False, False, False, True, True, True, True]:
        scaler.update(found_inf)
        history.append(scaler.scale.item())
    assert history == [1024, 512, 256, 256, 256, 512, 512, 256, 256, 256]
    copy = DynamicGradScaler(initial_scale=1.0, min_scale=1.0)
    copy.load_state_dict(scaler.state_dict())
    assert copy.state_dict()["scale"].item() == 256 and copy.state_dict()["hysteresis_tracker"] < 0


def _inject_inf_on_rank_1(steps):
    def hook(step, ddp):
        if step in steps and torch.distributed.get_rank() == 1:
            buffer = next(iter(ddp.grad_buffers.values()))
            # Only this rank's own shard is read by the distributed optimizer.
            buffer.buckets[0].shard()[3] = float("inf")
    return hook


def _params(ddp):
    return [p.detach().clone() for p in ddp.module.parameters()]


def _check_loss_scaling(rank, world_size):
    out = {}
    # TP=2: the two ranks form a model-parallel group; DP=1. Then DP=2 with the distributed
    # optimizer. Either way the inf is seen on rank 1 only, after the DP reduction.
    for name, tp, distopt in [("tp2", 2, False), ("dp2-distopt", 1, True)]:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        dp = parallel_state.get_data_parallel_group()
        mp = parallel_state.get_model_parallel_group()
        precision = dict(fp16=True, initial_loss_scale=2.0 ** 10, min_loss_scale=1.0,
                         loss_scale_window=3, hysteresis=2)
        ddp, opt = tiny_model.build(dp, mp, dtype=torch.float16, distopt=distopt,
                                    precision=precision, lr=1e-3)
        scales, changed, ok = [], [], []
        for step in range(6):
            before = _params(ddp)
            _, results = tiny_model.train(ddp, opt, 1, dp, first_step=step,
                                          before_step=_inject_inf_on_rank_1({0, 1}))
            ok.append(results[0][0])
            scales.append(opt.get_loss_scale().item())
            changed.append(any((a != b).any().item() for a, b in zip(before, _params(ddp))))
        out[name] = dict(ok=ok, scales=scales, changed=changed,
                         state=opt.state_dict()["grad_scaler"])
        parallel_state.destroy_model_parallel()
    # Constant scale: an inf still skips the step, the scale never moves.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    dp, mp = parallel_state.get_data_parallel_group(), parallel_state.get_model_parallel_group()
    ddp, opt = tiny_model.build(dp, mp, dtype=torch.float16,
                                precision=dict(fp16=True, loss_scale=128.0))
    _, results = tiny_model.train(ddp, opt, 3, dp, before_step=_inject_inf_on_rank_1({1}))
    out["constant"] = dict(ok=[r[0] for r in results], scale=opt.get_loss_scale().item())
    return out


def test_dynamic_loss_scaling_skips_on_all_ranks():
    for result in run_distributed(2, _check_loss_scaling):
        for name in ("tp2", "dp2-distopt"):
            r = result[name]
            assert r["ok"] == [False, False, True, True, True, True], (name, r)
            assert r["changed"] == r["ok"], (name, r)
            # hysteresis 2: the 1st overflow keeps 2^10, the 2nd halves; 3 clean steps double.
            assert r["scales"] == [1024, 512, 512, 512, 1024, 1024], (name, r)
            assert r["state"]["growth_tracker"] == 1 and r["state"]["hysteresis_tracker"] == 2
        assert result["constant"] == dict(ok=[True, False, True], scale=128.0)


class _FakeTPModel(torch.nn.Module):
    """A TP-split weight, a replicated LayerNorm weight and a `shared` duplicate."""

    def __init__(self, tp_rank):
        super().__init__()
        self.split = torch.nn.Parameter(torch.zeros(3, 4))
        self.split.tensor_model_parallel, self.split.partition_dim = True, 0
        self.norm = torch.nn.Parameter(torch.zeros(5))
        self.norm.tensor_model_parallel = False
        self.dup = torch.nn.Parameter(torch.zeros(2, 3))
        self.dup.tensor_model_parallel, self.dup.shared = False, True
        self.tp_rank = tp_rank

    @staticmethod
    def grads(tp_rank):
        gen = torch.Generator().manual_seed(7 + tp_rank)
        split = torch.randn(3, 4, generator=gen)
        gen = torch.Generator().manual_seed(99)  # replicated grads are equal on TP ranks
        return split, torch.randn(5, generator=gen), torch.randn(2, 3, generator=gen)

    def forward(self):
        split, norm, dup = self.grads(self.tp_rank)
        return (self.split * split).sum() + (self.norm * norm).sum() + (self.dup * dup).sum()


def _check_clip(rank, world_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp, mp = parallel_state.get_data_parallel_group(), parallel_state.get_model_parallel_group()
    out = []
    for distopt in (False, True):
        model = _FakeTPModel(tp_rank)
        ddp = DistributedDataParallel(
            model, DistributedDataParallelConfig(use_distributed_optimizer=distopt), dp_group=dp)
        opt = get_megatron_optimizer(
            OptimizerConfig(lr=1.0, clip_grad=0.5, optimizer="sgd", sgd_momentum=0.0,
                            weight_decay=0.0, use_distributed_optimizer=distopt,
                            log_num_zeros_in_grad=True),
            [ddp], dp_group=dp, mp_group=mp)
        ddp.zero_grad_buffer()
        ddp().backward()
        ddp.finish_grad_sync()
        ok, norm, zeros = opt.step()
        # SGD with lr 1: the update is minus the clipped gradient.
        out.append((norm, zeros, -model.split.detach().clone(), -model.norm.detach().clone()))
    return out


def test_grad_norm_counts_tp_duplicates_once():
    results = run_distributed(4, _check_clip)
    splits = [_FakeTPModel.grads(tp)[0] for tp in (0, 1)]
    _, norm_grad, _ = _FakeTPModel.grads(0)
    full = torch.cat([splits[0].flatten(), splits[1].flatten(), norm_grad])
    expected = full.norm().item()
    for rank, per_variant in enumerate(results):
        for norm, zeros, split_update, norm_update in per_variant:
            assert math.isclose(norm, expected, rel_tol=1e-5), (norm, expected)
            assert zeros == 0
            coeff = 0.5 / (expected + 1e-6)
            torch.testing.assert_close(split_update, splits[rank % 2] * coeff)
            torch.testing.assert_close(norm_update, norm_grad * coeff)
