"""BERT against hand-written references, in one process: the transformer layer in
both arrangements of the paper's figure 7 (pre-LN, and Megatron's
``--apply-residual-connection-post-layernorm``, which over a stack is exactly original BERT's
``LN(x + f(x))``), the whole model (embeddings with token types, padding mask, final LN, LM head
with its own bias on the tied embedding, pooler, binary head, the masked-LM loss), and
Megatron-LM's checkpoint keys with their TP/PP layout rules."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.checkpointing import BERT_LAYOUT, PipelineStages, flatten_model_state
from megatron.core.models.bert import BertModel, bert_extended_attention_mask
from megatron.core.models.builder import pipeline_stage_layers
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layer import TransformerLayer

H, HEADS, V, S, B = 16, 4, 64, 8, 3
CONFIG = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS,
                           padded_vocab_size=V, max_position_embeddings=S, num_tokentypes=2,
                           hidden_dropout=0.0, attention_dropout=0.0, bias_gelu_fusion=False,
                           params_dtype=torch.float64)


def _megatron_keys(layers: int, binary_head: bool) -> list[str]:
    """Megatron-LM 23.06's BERT checkpoint keys (docs/FORMATS.md 2d), in its order."""
    keys = ["language_model.embedding.word_embeddings.weight",
            "language_model.embedding.position_embeddings.weight"]
    if binary_head:
        keys.append("language_model.embedding.tokentype_embeddings.weight")
    for n in range(layers):
        for module in ("input_layernorm", "self_attention.query_key_value",
                       "self_attention.dense", "post_attention_layernorm", "mlp.dense_h_to_4h",
                       "mlp.dense_4h_to_h"):
            keys += [f"language_model.encoder.layers.{n}.{module}.{p}" for p in ("weight", "bias")]
    keys += ["language_model.encoder.final_layernorm.weight",
             "language_model.encoder.final_layernorm.bias"]
    if binary_head:
        keys += ["language_model.pooler.dense.weight", "language_model.pooler.dense.bias"]
    keys += ["lm_head.bias", "lm_head.dense.weight", "lm_head.dense.bias",
             "lm_head.layernorm.weight", "lm_head.layernorm.bias"]
    if binary_head:
        keys += ["binary_head.weight", "binary_head.bias"]
    return keys


def _model(binary_head: bool = True, **changes) -> BertModel:
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, num_tokentypes=2 if binary_head else 0, **changes)
    model = BertModel(config, None, add_binary_head=binary_head)
    with torch.no_grad():  # non-trivial LayerNorms and biases, so the references test them
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def _batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=gen)
    types = torch.zeros(B, S, dtype=torch.long)
    types[:, S // 2:] = 1
    padding = torch.ones(B, S, dtype=torch.long)
    padding[0, S - 3:] = 0  # sample 0 ends in padding
    labels = torch.full((B, S), -1)
    labels[:, 2] = torch.randint(0, V, (B,), generator=gen)
    labels[1, 5] = 7
    return ids, types, padding, labels


# --- hand-written references ---------------------------------------------------------------

def _ln(x, module):
    return F.layer_norm(x, (x.size(-1),), module.weight, module.bias, module.eps)


def _attention(x, layer, mask):
    """Self-attention of ``x [s, b, h]`` from the layer's weights, written out: fused QKV rows
    are ordered [heads, (q, k, v), head_dim]; bool ``mask [b, 1, s, s]``, True = masked."""
    att = layer.self_attention
    s, b, _ = x.shape
    qkv = x @ att.query_key_value.weight.t() + att.query_key_value.bias  # [s, b, 3h]
    qkv = qkv.view(s, b, HEADS, 3, H // HEADS)
    q, k, v = (qkv[..., i, :].permute(1, 2, 0, 3) for i in range(3))  # [b, np, s, hn]
    scores = q @ k.transpose(-1, -2) / math.sqrt(H // HEADS)
    scores = scores.masked_fill(mask, -10000.0)
    ctx = torch.softmax(scores, dim=-1) @ v  # [b, np, s, hn]
    ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, H)
    return ctx @ att.dense.weight.t() + att.dense.bias


def _mlp(x, layer):
    mlp = layer.mlp
    inner = F.gelu(x @ mlp.dense_h_to_4h.weight.t() + mlp.dense_h_to_4h.bias)
    return inner @ mlp.dense_4h_to_h.weight.t() + mlp.dense_4h_to_h.bias


def _pre_ln_layer(x, layer, mask):
    """The rearranged ("pre-LN") layer of figure 7."""
    x = x + _attention(_ln(x, layer.input_layernorm), layer, mask)
    return x + _mlp(_ln(x, layer.post_attention_layernorm), layer)


def _post_ln_residual_layer(x, layer, mask):
    """Megatron's layer with the residual taken after the LayerNorm."""
    a = _ln(x, layer.input_layernorm)
    y = a + _attention(a, layer, mask)
    b = _ln(y, layer.post_attention_layernorm)
    return b + _mlp(b, layer)


def _original_bert_stack(x, layers, final_ln, mask):
    """Original BERT (figure 7's left side): LN after each residual sum, an LN on the embedding.
    Megatron's post-LN-residual stack maps onto it as: the embedding LN is layer 1's input LN,
    each attention LN is the layer's post-attention LN, each MLP LN is the next layer's input LN
    (the final LN for the last layer)."""
    x = _ln(x, layers[0].input_layernorm)
    for i, layer in enumerate(layers):
        x = _ln(x + _attention(x, layer, mask), layer.post_attention_layernorm)
        out_ln = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_ln
        x = _ln(x + _mlp(x, layer), out_ln)
    return x


_PADDING = torch.ones(B, S, dtype=torch.long)
_PADDING[0, S - 3:] = 0
_REAL = _PADDING.bool()  # [b, s]
"""Rows compared: a padding query sees only masked keys, which torch's SDPA (an additive
-10000) and Megatron's masked softmax (a fill with -10000, then uniform) weigh differently;
nothing reads those rows (padding keys are masked for every real query; their labels are -1)."""


def _mask():
    return bert_extended_attention_mask(_PADDING)


# --- the layer in both arrangements ---------------------------------------------------------

@pytest.mark.parametrize("post_ln", [False, True], ids=["pre_ln", "post_ln_residual"])
def test_one_layer_equals_its_hand_written_reference(post_ln: bool) -> None:
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, apply_residual_connection_post_layernorm=post_ln)
    layer = TransformerLayer(config, 1, None, "padding").eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(0.05 * torch.randn_like(param))
    x = torch.randn(S, B, H, dtype=torch.float64)
    mask = _mask()
    reference = (_post_ln_residual_layer if post_ln else _pre_ln_layer)(x, layer, mask)
    other = (_pre_ln_layer if post_ln else _post_ln_residual_layer)(x, layer, mask)
    out = layer(x, mask)
    real = _REAL.transpose(0, 1)  # [s, b]
    torch.testing.assert_close(out[real], reference[real], rtol=1e-10, atol=1e-10)
    assert (out - other).abs().max() > 1e-3  # the two arrangements really differ


def test_post_ln_residual_stack_is_original_bert() -> None:
    model = _model(apply_residual_connection_post_layernorm=True)
    ids, types, padding, _ = _batch()
    mask = bert_extended_attention_mask(padding)
    emb = model.language_model.embedding(ids, torch.arange(S).expand(B, S), types)  # [s, b, h]
    encoder = model.language_model.encoder
    out = encoder(emb, mask)
    reference = _original_bert_stack(emb, list(encoder.layers), encoder.final_layernorm, mask)
    real = padding.bool().transpose(0, 1)  # [s, b]
    torch.testing.assert_close(out[real], reference[real], rtol=1e-10, atol=1e-10)


# --- the whole model ------------------------------------------------------------------------

def _reference_bert(model: BertModel, ids, types, padding):
    """Logits ``[b, s, V]`` and binary logits ``[b, 2]`` written out from the weights."""
    lm, mask = model.language_model, bert_extended_attention_mask(padding)
    emb = lm.embedding
    x = (emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[torch.arange(S)]
         + emb.tokentype_embeddings.weight[types]).transpose(0, 1)  # [s, b, h]
    for layer in lm.encoder.layers:
        x = _pre_ln_layer(x, layer, mask)
    x = _ln(x, lm.encoder.final_layernorm)
    pooled = torch.tanh(x[0] @ lm.pooler.dense.weight.t() + lm.pooler.dense.bias)
    binary = pooled @ model.binary_head.weight.t() + model.binary_head.bias
    head = model.lm_head
    t = F.gelu(x @ head.dense.weight.t() + head.dense.bias)  # exact GeLU, as Megatron's head
    t = _ln(t, head.layernorm)
    logits = t @ emb.word_embeddings.weight.t() + head.bias  # tied output weight + own bias
    return logits.transpose(0, 1), binary


def test_model_equals_hand_written_reference() -> None:
    model = _model()
    ids, types, padding, labels = _batch()
    ref_logits, ref_binary = _reference_bert(model, ids, types, padding)
    logits, binary = model(ids, padding, tokentype_ids=types)
    real = padding.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(binary, ref_binary, rtol=1e-10, atol=1e-10)

    loss, binary_with_labels = model(ids, padding, tokentype_ids=types, lm_labels=labels)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, V), labels.view(-1), ignore_index=-1,
                               reduction="none").view(B, S)
    predicted = labels >= 0
    torch.testing.assert_close(loss[predicted], ref_loss[predicted], rtol=1e-10, atol=1e-10)
    assert torch.all(loss[~predicted] == 0)  # only the predicted positions go through the head
    torch.testing.assert_close(binary_with_labels, ref_binary)


def test_masked_lm_loss_gradients_equal_the_full_head() -> None:
    """The head on the predicted rows only gives the gradients of Megatron's full-sequence
    head weighted by the loss mask."""
    model = _model()
    ids, types, padding, labels = _batch()
    loss_mask = (labels >= 0).double()
    loss, _ = model(ids, padding, tokentype_ids=types, lm_labels=labels)
    (loss * loss_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits, _ = model(ids, padding, tokentype_ids=types)
    full = F.cross_entropy(logits.reshape(-1, V), labels.clamp(min=0).view(-1),
                           reduction="none").view(B, S)
    (full * loss_mask).sum().backward()
    # No binary loss here: the pooler and the binary head get no gradient either way.
    assert set(grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(model.parameters())) - 4
    for name, param in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-9, atol=1e-12,
                                       msg=name)


def test_padding_does_not_reach_real_tokens() -> None:
    model = _model()
    ids, types, padding, _ = _batch()
    changed = ids.clone()
    changed[0, S - 3:] = (changed[0, S - 3:] + 1) % V  # other ids under the padding
    a, binary_a = model(ids, padding, tokentype_ids=types)
    b, binary_b = model(changed, padding, tokentype_ids=types)
    torch.testing.assert_close(a[0, :S - 3], b[0, :S - 3], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(binary_a, binary_b, rtol=1e-6, atol=1e-6)


def test_tokentype_ids_need_the_binary_head_model() -> None:
    model = _model(binary_head=False)
    ids, types, padding, labels = _batch()
    loss, binary = model(ids, padding, lm_labels=labels)
    assert binary is None and loss.shape == (B, S)
    with pytest.raises(ValueError, match="num_tokentypes = 0"):
        model(ids, padding, tokentype_ids=types)


# --- checkpoint keys and layout -------------------------------------------------------------

@pytest.mark.parametrize("binary_head", [True, False], ids=["binary_head", "no_binary_head"])
def test_checkpoint_keys_are_megatrons(binary_head: bool) -> None:
    model = _model(binary_head)
    nested = model.state_dict_for_save_checkpoint()
    flat = flatten_model_state(nested)
    assert list(flat) == _megatron_keys(CONFIG.num_layers, binary_head)
    # The real nesting: the pooler and the heads are flat dicts of their module.
    if binary_head:
        assert set(nested["language_model"]["pooler"]) == {"dense.weight", "dense.bias"}
        assert set(nested["binary_head"]) == {"weight", "bias"}
    assert set(nested["lm_head"]) == {"bias", "dense.weight", "dense.bias", "layernorm.weight",
                                      "layernorm.bias"}
    # Every key has a layout rule whose TP dim is the one the parameter is split on.
    params = dict(model.named_parameters())
    for key in flat:
        rule = BERT_LAYOUT.rule(key)
        param = params[key]
        split = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        assert rule.tp_dim == split, key
    # And the nested dict loads back (strictly).
    other = _model(binary_head, init_method_std=0.5)
    other.load_state_dict(nested)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(other.state_dict()[name], value)


def test_pipeline_stages_hold_the_heads_on_the_last_stage() -> None:
    """Split a one-stage BERT state over two stages: each stage model saves exactly those
    keys (the heads and the pooler on the last stage, with its copy of the embedding)."""
    full = flatten_model_state(_model().state_dict_for_save_checkpoint())
    stages = PipelineStages(CONFIG.num_layers, 2)
    split = BERT_LAYOUT.split_pipeline(full, stages)
    for rank, expected in enumerate(split):
        layers, offset = pipeline_stage_layers(CONFIG.num_layers, 2, rank)
        torch.manual_seed(0)
        stage = BertModel(CONFIG, None, pre_process=rank == 0, post_process=rank == 1,
                          num_layers=layers, layer_offset=offset)
        saved = flatten_model_state(stage.state_dict_for_save_checkpoint())
        assert set(saved) == set(expected), rank
        for key, value in saved.items():
            assert value.shape == expected[key].shape, key
    merged = BERT_LAYOUT.merge_pipeline(split, stages)
    assert list(merged) == list(full)


def test_unpadded_batch_takes_the_unmasked_path() -> None:
    """No padding: the mask is dropped (faster attention), with the same result as the full
    all-visible mask."""
    model = _model()
    ids, types, _, _ = _batch()
    padding = torch.ones(B, S, dtype=torch.long)
    assert model.prepare_attention_mask(padding) is None
    logits, binary = model(ids, padding, tokentype_ids=types)
    visible = bert_extended_attention_mask(padding)  # all False, [b, 1, s, s]
    ref_logits, ref_binary = model(ids, visible, tokentype_ids=types)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(binary, ref_binary, rtol=1e-10, atol=1e-10)
