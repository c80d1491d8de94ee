"""The router's arithmetic against hand-written formulas on small tensors: scores and top-k
(softmax, pre-softmax, sigmoid with an expert bias that only chooses, scaling, group-limited),
the balancing losses and z-loss, capacity dropping and padding, the expert-bias update; the
auxiliary loss's gradient reaches the router with the schedule's scale; the grouped experts
equal the per-expert loop."""

from __future__ import annotations

import math

import torch

from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe import moe_utils as mu
from megatron.core.transformer.moe.experts import Experts
from megatron.core.transformer.moe.moe_layer import MoELayer

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0],
                       [0.1, 0.3, 0.2, 0.0],
                       [-2.0, 3.0, 1.0, 2.5]])


def test_softmax_topk_then_softmax():
    probs, rmap = mu.score_topk(LOGITS, 2)
    assert rmap.tolist() == [[True, True, False, False], [False, True, True, False],
                             [False, True, False, True]]
    e = math.exp
    assert math.isclose(probs[0, 0].item(), e(2) / (e(2) + e(1)), rel_tol=1e-6)
    assert math.isclose(probs[2, 3].item(), e(2.5) / (e(3) + e(2.5)), rel_tol=1e-6)
    assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_pre_softmax_and_scaling():
    probs, _ = mu.score_topk(LOGITS, 2, pre_softmax=True, scaling_factor=2.0)
    full = torch.softmax(LOGITS, -1)
    assert torch.allclose(probs[0, :2], 2 * full[0, :2])
    assert probs[0, 2:].abs().sum() == 0


def test_sigmoid_with_expert_bias_chooses_only():
    bias = torch.tensor([0.0, 0.0, 10.0, 0.0])  # expert 2 always chosen
    probs, rmap = mu.score_topk(LOGITS, 2, score_function="sigmoid", expert_bias=bias)
    assert rmap[:, 2].all()
    s = torch.sigmoid(LOGITS)
    # Row 0 picks experts 2 (bias) and 0; its gates are the unbiased scores, normalized.
    assert math.isclose(probs[0, 2].item(), (s[0, 2] / (s[0, 0] + s[0, 2])).item(), rel_tol=1e-6)


def test_group_limited_routing():
    # Groups {0,1} and {2,3}; group score = best expert (topk 2 // group_topk 2 = 1 each)...
    probs, rmap = mu.score_topk(LOGITS, 2, num_groups=2, group_topk=1, pre_softmax=True)
    # one group per token: row 0 -> group {0,1}; row 2 -> max(3, 1)=3 vs max(...)=2.5 -> {0,1}
    assert rmap.tolist()[0] == [True, True, False, False]
    assert rmap.tolist()[2] == [True, True, False, False]
    assert rmap.sum(-1).tolist() == [2, 2, 2]


def test_switch_balancing_loss_formula():
    scores = torch.softmax(LOGITS, -1)
    rmap, sc = mu.scores_for_aux_loss(LOGITS, 2, "softmax")
    counts = rmap.sum(0).float()
    loss = mu.switch_load_balancing_loss(sc, counts, 3, 2, 0.1)
    t, k, e = 3, 2, 4
    f = counts / (t * k)
    p = scores.mean(0)
    assert math.isclose(loss.item(), 0.1 * e * float((f * p).sum()), rel_tol=1e-6)


def test_z_loss_formula():
    want = 1e-3 * float(torch.logsumexp(LOGITS, -1).pow(2).mean())
    assert math.isclose(mu.z_loss(LOGITS, 1e-3).item(), want, rel_tol=1e-6)


def test_capacity_dropping_and_padding():
    probs = torch.tensor([[0.6, 0.4, 0, 0], [0.7, 0.3, 0, 0], [0.9, 0, 0.1, 0],
                          [0.2, 0, 0, 0.8]])
    rmap = probs > 0
    # capacity = ceil(4 * 2 / 4 * 0.5) = 1 token per expert
    kept, kmap = mu.drop_over_capacity(probs, rmap, 2, 0.5, "probs")
    assert kmap[:, 0].tolist() == [False, False, True, False]  # the highest gate, 0.9
    assert kmap.sum(0).tolist() == [1, 1, 1, 1]
    _, pmap = mu.drop_over_capacity(probs, rmap, 2, 0.5, "position")
    assert pmap.sum(0).tolist() == [1, 1, 1, 1]
    assert not (pmap & ~rmap).any()  # routed tokens only (every expert has one)
    # Among routed tokens, those Megatron's top-k over the 0/1 map keeps (not always the
    # earliest: torch.topk's choice among ties).
    chosen = torch.topk(rmap.int(), k=1, dim=0, sorted=False)[1]
    assert torch.equal(pmap, torch.zeros_like(rmap).scatter(0, chosen, True))
    _, pos_padded = mu.drop_over_capacity(probs, rmap, 2, 1.0, "position",
                                          pad_to_capacity=True)
    assert pos_padded.sum(0).tolist() == [2, 2, 2, 2]
    assert (pos_padded | ~rmap)[:, 1:].all()  # an expert with <= 2 routed tokens keeps all
    padded_probs, padded = mu.drop_over_capacity(probs, rmap, 2, 1.0, "probs",
                                                 pad_to_capacity=True)
    assert padded.sum(0).tolist() == [2, 2, 2, 2]  # every expert exactly its capacity
    assert torch.equal(padded_probs, probs * padded)


def test_expert_bias_update():
    bias = mu.updated_expert_bias(torch.tensor([4.0, 1.0, 2.0, 1.0]), torch.zeros(4), 0.1)
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.0, 0.1]))


def _config(**kw) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
                swiglu=True, add_bias_linear=False, num_moe_experts=4, moe_ffn_hidden_size=12,
                moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, gradient_accumulation_fusion=False)
    base.update(kw)
    return TransformerConfig(**base)


def test_aux_loss_gradient_is_scaled_as_the_schedule_says():
    torch.manual_seed(0)
    layer = MoELayer(_config(), 1, None).train()
    x = torch.randn(5, 2, 8)

    def router_grad(scale: float, zero_main: bool) -> torch.Tensor:
        layer.zero_grad()
        mu.set_aux_loss_scale(scale)
        out, _ = layer(x)
        (out.sum() * (0.0 if zero_main else 1.0)).backward()
        return layer.router.weight.grad.clone()

    aux_only = router_grad(1.0, zero_main=True)
    assert aux_only.abs().max() > 0  # the aux and z losses alone move the router
    torch.testing.assert_close(router_grad(0.25, zero_main=True), aux_only * 0.25)
    mu.set_aux_loss_scale(1.0)


def test_grouped_equals_loop():
    torch.manual_seed(0)
    loop = Experts(_config(), 4, None)
    grouped = Experts(_config(moe_grouped_gemm=True), 4, None)
    grouped.load_state_dict(loop.state_dict())
    tokens = torch.randn(10, 8)
    counts = [3, 0, 5, 2]
    torch.testing.assert_close(grouped(tokens, counts), loop(tokens, counts))


def test_expert_bias_step_after_the_backward():
    """finalize_model_grads moves the bias by the step's token counts and starts them again;
    the bias changes which experts are chosen, never the gates' values."""
    from megatron.core.distributed.finalize_model_grads import _update_router_state

    torch.manual_seed(0)
    layer = MoELayer(_config(moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True,
                             moe_router_bias_update_rate=0.5), 1, None).train()
    x = torch.randn(6, 2, 8)
    _, rmap = layer.router(x)
    counts = rmap.sum(0).float()
    torch.testing.assert_close(layer.router.local_tokens_per_expert, counts)
    _update_router_state([layer])
    torch.testing.assert_close(layer.router.expert_bias,
                               torch.sign(counts.mean() - counts) * 0.5)
    assert layer.router.local_tokens_per_expert.abs().sum() == 0
    assert "router.expert_bias" in layer.state_dict()


def test_global_and_sequence_aux_losses():
    """global_aux_loss uses the token counts averaged over the global batch's micro-batches
    (reset after the step); seq_aux_loss is the mean over sequences of each one's loss."""
    from megatron.core.distributed.finalize_model_grads import _update_router_state
    from megatron.core.transformer.moe import metrics

    torch.manual_seed(0)
    layer = MoELayer(_config(moe_router_load_balancing_type="global_aux_loss"), 1, None).train()
    xs = [torch.randn(6, 2, 8) for _ in range(2)]
    metrics.clear()
    for x in xs:
        layer(x)
    router = layer.router
    assert float(router.ga_steps) == 2
    logits = [router.gating(x).reshape(-1, 4) for x in xs]
    maps = [mu.scores_for_aux_loss(lg, 2, "softmax") for lg in logits]
    mean_counts = sum(m.sum(0).float() for m, _ in maps) / 2
    want = sum(mu.switch_load_balancing_loss(sc, mean_counts if i else maps[0][0].sum(0).float(),
                                             12, 2, 1.0) for i, (_, sc) in enumerate(maps))
    got = metrics.reduce_per_layer(1)["global_load_balancing_loss"][0]
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    _update_router_state([layer])
    assert float(router.ga_steps) == 0
    metrics.clear()

    seq = MoELayer(_config(moe_router_load_balancing_type="seq_aux_loss"), 1, None).train()
    x = torch.randn(6, 2, 8)
    seq(x)
    lg = seq.router.gating(x)  # [s, b, E]
    per_seq = []
    for b in range(2):
        rmap, sc = mu.scores_for_aux_loss(lg[:, b], 2, "softmax")
        per_seq.append(mu.switch_load_balancing_loss(sc, rmap.sum(0).float(), 6, 2, 1.0))
    got = metrics.reduce_per_layer(1)["seq_load_balancing_loss"][0]
    torch.testing.assert_close(got, (sum(per_seq) / 2).detach(), rtol=1e-5, atol=1e-6)
    metrics.clear()
