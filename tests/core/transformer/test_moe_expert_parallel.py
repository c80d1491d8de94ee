"""Expert parallelism at the layer: an MoE layer whose 4 experts are spread over 2 ranks
(EP=2), with the allgather and with the alltoall dispatcher, gives every rank the output and
the input, router and gate gradients of the one-rank layer (EP=1) on that rank's tokens, and
each expert the gradient summed over both ranks' tokens; with capacity dropping too. At
EP=2 x TP=2 (sequence parallel, 4 ranks) with each expert split over ETP=2 ranks or whole
(ETP=1), with biases, the same holds over the ETP x EP group's tokens (each rank's ETP slice
of the gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe import metrics
from megatron.core.transformer.moe.moe_layer import ExpertGroups, MoELayer
from tests.multiprocess import run_distributed


def _config(dispatcher: str, capacity: float | None) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, swiglu=True,
        add_bias_linear=False, num_moe_experts=4, moe_ffn_hidden_size=12,
        moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_token_dispatcher_type=dispatcher,
        moe_expert_capacity_factor=capacity, moe_shared_expert_intermediate_size=8,
        moe_shared_expert_gate=True, gradient_accumulation_fusion=False,
        params_dtype=torch.float64)


def _run(layer: MoELayer, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * weight).sum().backward()
    return out.detach(), x.grad


def _ep_equals_one_rank(rank: int, world: int, dispatcher: str,
                        capacity: float | None) -> int:
    group = dist.group.WORLD
    cfg = _config(dispatcher, capacity)
    torch.manual_seed(0)
    ref = MoELayer(cfg, 1, None).double().train()
    groups = ExpertGroups(ep=group, etp=None, tp_ep=group)
    ep = MoELayer(cfg, 1, None, expert_groups=groups).double().train()
    offset, local = ep.local_expert_offset, len(ep.local_experts)
    state = {k: v for k, v in ref.state_dict().items() if ".local_experts." not in k
             and not k.startswith("local_experts.")}
    for i in range(local):
        for k, v in ref.local_experts[offset + i].state_dict().items():
            state[f"local_experts.{i}.{k}"] = v
    ep.load_state_dict(state)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, 2, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(6, 2, 8, generator=gen, dtype=torch.float64)
    metrics.clear()
    out_ref, gx_ref = _run(ref, x, weight)
    out_ep, gx_ep = _run(ep, x, weight)
    metrics.clear()
    torch.testing.assert_close(out_ep, out_ref)
    torch.testing.assert_close(gx_ep, gx_ref)
    for name in ("router.weight", "shared_experts.gate_weight",
                 "shared_experts.dense_h_to_4h.weight"):
        torch.testing.assert_close(ep.get_parameter(name).grad, ref.get_parameter(name).grad)
    summed = {}  # every expert's one-rank gradient summed over the ranks' tokens
    for name, p in ref.local_experts.named_parameters():
        summed[name] = p.grad.clone()
        dist.all_reduce(summed[name], group=group)
    for i in range(local):
        for name, p in ep.local_experts[i].named_parameters():
            torch.testing.assert_close(p.grad, summed[f"{offset + i}.{name}"])
    return local


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_ep2_equals_one_rank(dispatcher, capacity):
    assert run_distributed(2, _ep_equals_one_rank, dispatcher, capacity) == [2, 2]


def _etp_config(dispatcher: str) -> TransformerConfig:
    # No shared expert and no balancing losses: each token's output is then the one-rank
    # layer's on that token, whatever the other ranks hold.
    return TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, swiglu=True,
        add_bias_linear=True, num_moe_experts=4, moe_ffn_hidden_size=12,
        moe_token_dispatcher_type=dispatcher, sequence_parallel=True,
        gradient_accumulation_fusion=False, params_dtype=torch.float64)


def _ep_etp_equals_one_rank(rank: int, world: int, dispatcher: str, etp: int) -> bool:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.utils import split_master_weight

    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=etp)
    try:
        cfg = _etp_config(dispatcher)
        tp_group, etp_group = ps.get_tensor_model_parallel_group(), \
            ps.get_expert_tensor_parallel_group()
        torch.manual_seed(0)
        ref = MoELayer(cfg, 1, None).double().train()
        torch.manual_seed(0)  # the same experts, split over ETP (the init is TP-invariant)
        split = MoELayer(cfg, 1, None, expert_groups=ExpertGroups(None, etp_group, etp_group))
        groups = ExpertGroups(ep=ps.get_expert_model_parallel_group(), etp=etp_group,
                              tp_ep=ps.get_expert_tensor_and_model_parallel_group())
        layer = MoELayer(cfg, 1, tp_group, expert_groups=groups).double().train()
        offset, local = layer.local_expert_offset, len(layer.local_experts)
        state = {k: v for k, v in ref.state_dict().items() if k.startswith("router.")}
        for i in range(local):
            for k, v in split.local_experts[offset + i].state_dict().items():
                state[f"local_experts.{i}.{k}"] = v
        layer.load_state_dict(state)
        with torch.no_grad():  # a non-zero fc2 bias, the same on every rank
            for i in range(4):
                ref.local_experts[i].dense_4h_to_h.bias.fill_(0.1 * (i + 1))
            for i in range(local):
                layer.local_experts[i].dense_4h_to_h.bias.fill_(0.1 * (offset + i + 1))
        gen = torch.Generator().manual_seed(100 + rank)  # this rank's own rows
        x = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64)
        weight = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64)
        metrics.clear()
        out_ref, gx_ref = _run(ref, x, weight)
        out, gx = _run(layer, x, weight)
        metrics.clear()
        torch.testing.assert_close(out, out_ref)
        torch.testing.assert_close(gx, gx_ref)
        for name, p in layer.router.named_parameters():
            torch.testing.assert_close(p.grad, ref.router.get_parameter(name).grad)
        # Each expert's gradient: the one-rank layer's summed over the ETP x EP group's
        # tokens, this rank's ETP slice of it.
        summed = {}
        for name, p in ref.local_experts.named_parameters():
            summed[name] = p.grad.clone()
            dist.all_reduce(summed[name], group=ps.get_expert_tensor_and_model_parallel_group())
        for i in range(local):
            for name, p in layer.local_experts[i].named_parameters():
                want = summed[f"{offset + i}.{name}"]
                if getattr(p, "tensor_model_parallel", False) and etp > 1:
                    want = split_master_weight(want, p.partition_dim, etp,
                                               dist.get_rank(etp_group), p.partition_stride)
                torch.testing.assert_close(p.grad, want, msg=f"expert {offset + i} {name}")
        return True
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("etp", [1, 2])
def test_ep2_tp2_equals_one_rank(dispatcher, etp):
    """EP=2 x TP=2 (sequence parallel) on 4 ranks, each expert split over ETP=2 ranks or
    whole (ETP=1), with fc1 and fc2 biases."""
    assert run_distributed(4, _ep_etp_equals_one_rank, dispatcher, etp) == [True] * 4
