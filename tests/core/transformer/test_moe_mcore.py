"""Megatron-Core 0.19.2's own MoE model (``../shared/data/mcore/moe_alltoall_shared``: 4
experts, top-2 softmax, aux loss 1e-2, z-loss 1e-3, a shared expert, SequentialMLP) loaded
into ours under Megatron-LM's legacy names gives its logits, loss, per-layer load-balancing and
z losses, router probabilities and routing map."""

from __future__ import annotations

import pathlib

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe import metrics

FIXTURE = pathlib.Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "mcore" / \
    "moe_alltoall_shared"
pytestmark = pytest.mark.skipif(not (FIXTURE / "state_dict.pt").exists(),
                                reason="the Megatron-Core fixtures are not on this machine")

_RENAMES = (
    ("embedding.word_embeddings.", "language_model.embedding.word_embeddings."),
    ("decoder.final_layernorm.", "language_model.encoder.final_layernorm."),
    ("output_layer.", "language_model.output_layer."),
    ("decoder.layers.", "language_model.encoder.layers."),
    (".self_attention.linear_qkv.", ".self_attention.query_key_value."),
    (".self_attention.linear_proj.", ".self_attention.dense."),
    (".pre_mlp_layernorm.", ".post_attention_layernorm."),
    (".mlp.experts.local_experts.", ".mlp.local_experts."),
    (".linear_fc1.", ".dense_h_to_4h."),
    (".linear_fc2.", ".dense_4h_to_h."),
)


def mcore_to_legacy(state: dict) -> dict:
    """Megatron-Core's GPTModel keys -> Megatron-LM's legacy ones (TP=1; the QKV rows and the
    SwiGLU [gate; up] rows are laid out alike in both)."""
    out = {}
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        for old, new in _RENAMES:
            key = key.replace(old, new)
        out[key] = value
    return out


def _model() -> GPTModel:
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        num_query_groups=2, padded_vocab_size=128, max_position_embeddings=32,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
        attention_dropout=0.0, num_moe_experts=4, moe_ffn_hidden_size=96,
        moe_shared_expert_intermediate_size=64, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall")
    model = GPTModel(config, None, parallel_output=False)
    state = torch.load(FIXTURE / "state_dict.pt", weights_only=True)
    model.load_state_dict(mcore_to_legacy(state))
    return model


@pytest.fixture(scope="module")
def ref():
    return torch.load(FIXTURE / "outputs.pt", weights_only=True)


def test_eval_logits_and_loss(ref):
    model = _model().eval()
    with torch.no_grad():
        logits = model(ref["input_ids"], ref["position_ids"])
        loss = model(ref["input_ids"], ref["position_ids"], labels=ref["labels"])
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref["loss_per_token"], atol=1e-5, rtol=1e-5)
    assert abs(loss.mean().item() - ref["loss_mean"].item()) < 1e-5


def test_train_mode_routing_and_aux_losses(ref):
    model = _model().train()
    routed = {}
    hooks = [layer.mlp.router.register_forward_hook(
        lambda mod, inp, out, i=i: routed.__setitem__(i, out))
        for i, layer in enumerate(model.language_model.encoder.layers)]
    metrics.clear()
    logits = model(ref["input_ids"], ref["position_ids"])
    for h in hooks:
        h.remove()
    torch.testing.assert_close(logits.detach(), ref["logits_train_mode"], atol=1e-5, rtol=1e-5)
    for i in range(2):
        want = ref["router_outputs_train"][f"decoder.layers.{i}.mlp.router"]
        probs, routing_map = routed[i]
        torch.testing.assert_close(probs.detach(), want["probs"], atol=1e-6, rtol=1e-5)
        assert torch.equal(routing_map, want["routing_map"])
    per_layer = metrics.reduce_per_layer(num_microbatches=1)
    metrics.clear()
    aux = ref["moe_aux"]
    torch.testing.assert_close(per_layer["load_balancing_loss"],
                               aux["load_balancing_loss_per_layer_unscaled"], atol=1e-5, rtol=0)
    torch.testing.assert_close(per_layer["z_loss"], aux["z_loss_per_layer_unscaled"],
                               atol=1e-5, rtol=0)
