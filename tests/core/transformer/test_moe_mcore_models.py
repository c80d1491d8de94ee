"""Megatron-Core 0.19.2's own MoE models (``tests/fixtures/mcore_moe``: OLMoE-shaped,
DeepSeek-V3's router, capacity dropping by gate and by position with padding, the allgather
dispatcher with a gated shared expert) loaded into ours under Megatron-LM's legacy names give
its logits, per-token loss, per-layer balancing and z losses, router probabilities and routing
maps, and the gradients of its training loss with the aux and z losses; and its
expert-parallel runs (EP=2 with each dispatcher on 2 ranks, EP=2 x TP=2 with
ETP 1 and 2 on 4 ranks, which equal its one-rank run) are what ours gives at those layouts
from its ``torch_dist`` checkpoint, each rank's gradients included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe import metrics
from megatron.core.transformer.moe import moe_utils as mu
from tests.core.transformer.test_moe_mcore import mcore_to_legacy
from tests.multiprocess import run_distributed

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mcore_moe"
MODELS = ["olmoe", "dsv3_router", "capacity_probs", "capacity_position_pad",
          "sqrtsoftplus_global_aux", "sinkhorn",
          "allgather_shared_gate", "ep_base"]
TOL = 1e-5

# Megatron-Core's TransformerConfig fields that are not model settings here (precision and
# parallel layout live elsewhere; the activation is the swiglu flag).
_NOT_OURS = {"activation_func", "gated_linear_unit", "bf16", "fp16", "params_dtype",
             "tensor_model_parallel_size", "expert_model_parallel_size",
             "expert_tensor_parallel_size"}


def our_config(name: str, **overrides) -> TransformerConfig:
    """The fixture's Megatron-Core ``TransformerConfig`` (``config.json``) as ours."""
    recorded = json.loads((FIXTURES / name / "config.json").read_text())
    theirs, model = recorded["TransformerConfig"], recorded["GPTModel"]
    assert theirs["activation_func"] == "torch.nn.functional.silu" and \
        theirs["gated_linear_unit"], "the fixtures' experts are SwiGLU"
    kw = {k: v for k, v in theirs.items() if k not in _NOT_OURS}
    kw.update(swiglu=True, padded_vocab_size=model["vocab_size"],
              max_position_embeddings=model["max_sequence_length"],
              position_embedding_type=model["position_embedding_type"],
              rotary_base=model["rotary_base"], add_position_embedding=False,
              untie_embeddings_and_output_weights=not model["share_embeddings_and_output_weights"],
              bias_gelu_fusion=False, gradient_accumulation_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _state(name: str) -> dict:
    rel = json.loads((FIXTURES / name / "config.json").read_text())["state_dict"]
    return torch.load(FIXTURES / rel, weights_only=True)


def _model(name: str):
    from megatron.core.models.gpt import GPTModel
    torch.manual_seed(99)  # other weights than Megatron-Core's: the load must replace them
    model = GPTModel(our_config(name), None, parallel_output=False)
    model.load_state_dict(mcore_to_legacy(_state(name)))
    return model


def _routers(model) -> dict:
    return {f"decoder.layers.{i}.mlp.router": layer.mlp.router
            for i, layer in enumerate(model.language_model.encoder.layers)
            if hasattr(layer.mlp, "router")}


@pytest.mark.parametrize("name", MODELS)
def test_eval_logits_and_loss(name):
    ref = torch.load(FIXTURES / name / "outputs.pt", weights_only=True)
    model = _model(name).eval()
    with torch.no_grad():
        logits = model(ref["input_ids"], ref["position_ids"], ref["attention_mask"])
        loss = model(ref["input_ids"], ref["position_ids"], ref["attention_mask"],
                     labels=ref["labels"])
    torch.testing.assert_close(logits, ref["logits"], atol=TOL, rtol=TOL)
    torch.testing.assert_close(loss, ref["loss_per_token"], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("name", MODELS)
def test_train_mode_routing_and_aux_losses(name):
    ref = torch.load(FIXTURES / name / "outputs.pt", weights_only=True)
    model = _model(name).train()
    routed = {}
    routers = _routers(model)
    assert set(routers) == set(ref["router_outputs_train"])
    hooks = [r.register_forward_hook(lambda mod, inp, out, n=n: routed.__setitem__(n, out))
             for n, r in routers.items()]
    metrics.clear()
    logits = model(ref["input_ids"], ref["position_ids"], ref["attention_mask"])
    for h in hooks:
        h.remove()
    torch.testing.assert_close(logits.detach(), ref.get("logits_train_mode", ref["logits"]),
                               atol=TOL, rtol=TOL)
    for n, want in ref["router_outputs_train"].items():
        probs, routing_map = routed[n]
        torch.testing.assert_close(probs.detach(), want["probs"], atol=1e-6, rtol=1e-5)
        assert torch.equal(routing_map, want["routing_map"]), n
    per_layer = metrics.reduce_per_layer(num_microbatches=1)
    metrics.clear()
    expected = {k.removesuffix("_per_layer_unscaled"): v for k, v in ref["moe_aux"].items()}
    assert set(per_layer) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(per_layer[k], v, atol=TOL, rtol=0, msg=k)


@pytest.mark.parametrize("name", MODELS)
def test_gradients_with_aux_and_z_losses(name):
    """The gradients of the train-mode mean token loss, the balancing and z losses joining
    the backward at Megatron's default scale (1): the routers' (and shared-expert gates') in
    full, every other parameter's norm and sum; then the expert-bias update."""
    ref = torch.load(FIXTURES / name / "outputs.pt", weights_only=True)
    model = _model(name).train()
    mu.set_aux_loss_scale(1.0)
    metrics.clear()
    logits = model(ref["input_ids"], ref["position_ids"], ref["attention_mask"])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             ref["labels"].reshape(-1))
    loss.backward()
    metrics.clear()
    torch.testing.assert_close(loss.detach(), ref["train_loss_mean"], atol=TOL, rtol=TOL)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    norms, sums = mcore_to_legacy(ref["grad_norm"]), mcore_to_legacy(ref["grad_sum"])
    assert set(grads) == set(norms)
    for n, g in grads.items():
        torch.testing.assert_close(g.norm(), torch.tensor(norms[n]), atol=1e-8, rtol=1e-5,
                                   msg=n)
        torch.testing.assert_close(g.sum(), torch.tensor(sums[n]), atol=1e-6, rtol=1e-4, msg=n)
    full = mcore_to_legacy(ref["grads_full"])
    assert full and all(".router." in n or "gate_weight" in n for n in full)
    for n, g in full.items():
        torch.testing.assert_close(grads[n], g, atol=1e-8, rtol=1e-5, msg=n)
    # Aux-loss-free balancing: the step's token counts and the bias step Megatron's
    # finalize_model_grads takes from them.
    assert bool(ref["expert_bias_update"]) == (name == "dsv3_router")
    routers = _routers(model)
    for n, want in ref["expert_bias_update"].items():
        router = routers[n]
        assert torch.equal(router.local_tokens_per_expert, want["tokens_per_expert"]), n
        router.update_expert_bias(router.local_tokens_per_expert.clone())
        torch.testing.assert_close(router.expert_bias, want["updated"], atol=1e-7, rtol=0)


LAYOUTS = {"ep2_alltoall": (2, 1, 1, "alltoall"), "ep2_allgather": (2, 1, 1, "allgather"),
           "ep2_tp2_etp1": (4, 2, 1, "alltoall"), "ep2_tp2_etp2": (4, 2, 2, "alltoall")}


def _expert_parallel_run(rank, world, tp, etp, dispatcher, checkpoint=None):
    """``ep_base`` at EP=2 x TP=``tp`` from a ``torch_dist`` checkpoint (Megatron-Core's of the
    fixture by default): gathered eval logits, per-token loss, train-mode logits, per-layer
    aux losses, the train-mode mean loss and this rank's gradients of it (norm, sum)."""
    from megatron.checkpointing.dist.model import Layout, load_weights
    from megatron.core import parallel_state as ps
    from megatron.core.models.builder import build_model_stage
    from megatron.core.models.gpt import GPTModel
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=etp)
    config = our_config("ep_base", moe_token_dispatcher_type=dispatcher,
                        sequence_parallel=tp > 1)
    torch.manual_seed(99)
    model = build_model_stage(GPTModel, config, parallel_output=False)
    load_weights([model], checkpoint or FIXTURES / "ep_base" / "torch_dist",
                 Layout.from_parallel_state(config.num_layers, config.num_moe_experts), True,
                 # a training checkpoint holds the optimizer state too
                 strictness="raise_all" if checkpoint is None else "assume_ok_unexpected")
    ref = torch.load(FIXTURES / "ep_base" / "outputs.pt", weights_only=True)
    args = (ref["input_ids"], ref["position_ids"], ref["attention_mask"])
    model.eval()
    with torch.no_grad():
        logits = model(*args)
        loss = model(*args, labels=ref["labels"])
    metrics.clear()
    model.train()
    mu.set_aux_loss_scale(1.0)
    train_logits = model(*args)
    loss_mean = torch.nn.functional.cross_entropy(
        train_logits.float().reshape(-1, train_logits.shape[-1]), ref["labels"].reshape(-1))
    loss_mean.backward()
    train_logits = train_logits.detach()
    # This rank's shards' gradients, unreduced (Megatron-Core's record them so).
    grads = {n: (p.grad.norm(), p.grad.sum()) for n, p in model.named_parameters()
             if p.grad is not None}
    names = sorted(k.removesuffix("_per_layer_unscaled") for k in ref["moe_aux"])
    per_layer = metrics.reduce_per_layer(
        1, names, config.num_layers, tp_group=ps.get_tensor_model_parallel_group(),
        dp_group=ps.get_data_parallel_group())
    metrics.clear()
    return logits, loss, train_logits, per_layer, loss_mean.detach(), grads


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_equals_megatron_core(layout):
    world, tp, etp, dispatcher = LAYOUTS[layout]
    theirs = torch.load(FIXTURES / "ep_base" / f"{layout}.pt", weights_only=True)
    # Megatron-Core's own layout equals its one-rank run (recorded by the generator) ...
    assert max(theirs["max_abs_diff_vs_ep1"].values()) < TOL
    # ... and ours at that layout equals it.
    results = run_distributed(world, _expert_parallel_run, tp, etp, dispatcher)
    for rank, (logits, loss, train_logits, per_layer, loss_mean, grads) in enumerate(results):
        torch.testing.assert_close(logits, theirs["logits"], atol=TOL, rtol=TOL)
        torch.testing.assert_close(loss, theirs["loss_per_token"], atol=TOL, rtol=TOL)
        torch.testing.assert_close(
            train_logits, theirs.get("logits_train_mode", theirs["logits"]), atol=TOL, rtol=TOL)
        for k, v in theirs["moe_aux"].items():
            torch.testing.assert_close(per_layer[k.removesuffix("_per_layer_unscaled")], v,
                                       atol=TOL, rtol=0, msg=k)
        # The backward of the train loss with the aux and z losses, rank by rank (the same
        # rank grid: each rank holds the same shards as Megatron-Core's rank).
        torch.testing.assert_close(loss_mean, theirs["train_loss_mean"], atol=TOL, rtol=TOL)
        norms = mcore_to_legacy(theirs["grad_norm_by_rank"][rank])
        sums = mcore_to_legacy(theirs["grad_sum_by_rank"][rank])
        assert set(grads) == set(norms), set(grads) ^ set(norms)
        for n, (norm, total) in grads.items():
            torch.testing.assert_close(norm, torch.tensor(norms[n]), atol=1e-8, rtol=1e-5,
                                       msg=n)
            torch.testing.assert_close(total, torch.tensor(sums[n]), atol=1e-6, rtol=1e-4,
                                       msg=n)
