"""The GPT model at TP = 1, 2, 4 from one seed (same loss, same re-assembled gradients, gathered
logits), dropout masks across TP ranks, recomputation, init scaling, checkpoint layout and round
trip, parameter count and FLOPs. Inputs live on ``device.get_device()``, with the parameters."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.config import parse_args
from megatron.core import comm, device
from megatron.core import parallel_state as ps
from megatron.core.flops import num_floating_point_operations, num_parameters
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer.attention import causal_mask
from megatron.core.transformer.config import TransformerConfig
from megatron.config.core_configs import transformer_config
from megatron.training.models import gpt_model_from
from tests.core.tp_helpers import assert_same_params_and_grads
from tests.multiprocess import run_distributed

DT = torch.float64
VOCAB, SEQ, BATCH = 64, 8, 2
CONFIG = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                           padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
                           hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DT)


def _batch():
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    tokens[0, :4] = torch.tensor([0, 15, 16, 63])  # ids at TP-4 partition borders
    tokens = tokens.to(device.get_device())
    position_ids = torch.arange(SEQ, device=tokens.device).expand(BATCH, SEQ)
    return tokens[:, :-1], position_ids, tokens[:, 1:]


def _train_step(config, group, rank, mask=None, seed=1234):
    torch.manual_seed(seed)
    model = GPTModel(config, group)
    ids, pos, labels = _batch()
    model_parallel_manual_seed(seed, rank)
    loss = model(ids, pos, mask, labels=labels)  # [b, s]
    loss_mask = torch.ones_like(loss).index_fill_(1, torch.tensor([0]), 0.0)
    (loss * loss_mask).sum().div(loss_mask.sum()).backward()
    return model, loss.detach()


def _check_model_equivalence(group, rank):
    reset = causal_mask(SEQ, device.get_device()).repeat(BATCH, 1, 1, 1)
    reset[0, :, 4:, :4] = True
    for kwargs, mask in ((dict(), None), (dict(attention_backend="unfused"), reset),
                         (dict(untie_embeddings_and_output_weights=True), None),
                         (dict(hidden_dropout=0.2), None)):
        config = dataclasses.replace(CONFIG, **kwargs)
        ref, ref_loss = _train_step(config, None, 0, mask)
        par, loss = _train_step(config, group, rank, mask)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=1e-9)
        assert_same_params_and_grads(ref, par, group)
    # Logits without labels: this rank's vocabulary slice, [b, s, V/p].
    ids, pos, _ = _batch()
    logits = par.eval()(ids, pos)
    full = ref.eval()(ids, pos)
    tp = ps.get_tensor_model_parallel_world_size()
    torch.testing.assert_close(logits, full.chunk(tp, -1)[rank], rtol=1e-7, atol=1e-9)


def _check_gathered_logits(group, rank):
    """parallel_output=False: every rank gets the full [b, s, V] logits; gradients through the
    gather re-assemble to TP = 1's."""
    ids, pos, _ = _batch()
    grad = torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(5),
                       dtype=DT).to(ids.device)
    models = []
    for g in (None, group):
        torch.manual_seed(1234)
        model = GPTModel(CONFIG, g, parallel_output=False)
        logits = model(ids, pos)  # [b, s, V]
        logits.backward(grad)
        models.append((model, logits.detach()))
    (ref, full), (par, logits) = models
    assert logits.shape == (BATCH, SEQ, VOCAB)
    torch.testing.assert_close(logits, full, rtol=1e-7, atol=1e-9)
    assert_same_params_and_grads(ref, par, group)


class _DropoutMasks(TorchDispatchMode):
    """Records every dropout keep-mask drawn under it: ``bernoulli_`` (CPU dropout, SDPA's math
    kernel) or ``native_dropout`` (CUDA), whatever Python code issues it."""

    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.masks.append(out != 0)
        elif func is torch.ops.aten.native_dropout.default:
            self.masks.append(out[1])
        return out


def _dropout_masks(config, group, rank):
    """(residual + embedding masks [s, b, h], attention masks [b, np/p, s, s]) of one forward."""
    torch.manual_seed(1234)
    model = GPTModel(config, group)
    ids, pos, labels = _batch()
    model_parallel_manual_seed(1234, rank)
    with _DropoutMasks() as rec:
        model(ids, pos, labels=labels)
    hidden = [m for m in rec.masks if m.shape == (SEQ, BATCH, config.hidden_size)]
    attention = [m for m in rec.masks if m.dim() == 4]
    assert len(hidden) == 1 + 2 * config.num_layers  # embedding + two residuals per layer
    assert len(attention) == config.num_layers and len(rec.masks) == len(hidden) + len(attention)
    return torch.stack(hidden), torch.stack(attention)


def _check_dropout_masks(group, rank):
    """Paper B.2, checked on the masks themselves: embedding and residual dropout masks are the
    same on every TP rank (and as at TP = 1); attention dropout masks differ between TP ranks."""
    for backend in ("auto", "unfused"):
        config = dataclasses.replace(CONFIG, hidden_dropout=0.3, attention_dropout=0.3,
                                     attention_backend=backend)
        hidden, attention = _dropout_masks(config, group, rank)
        ref_hidden, _ = _dropout_masks(config, None, 0)
        assert torch.equal(hidden, ref_hidden), backend
        # (gloo has no bool collectives: gather as float64.)
        all_hidden = comm.all_gather_list(hidden.to(DT), group)
        all_attention = comm.all_gather_list(attention.to(DT), group)
        assert all(torch.equal(all_hidden[0], h) for h in all_hidden[1:]), backend
        assert all(not torch.equal(all_attention[0], a) for a in all_attention[1:]), backend


def _check_recompute(group, rank):
    """Full (uniform, block, distributed input) and selective recompute, with dropout on,
    give the same loss and gradients as no recompute."""
    base = dataclasses.replace(CONFIG, hidden_dropout=0.2, attention_dropout=0.2,
                               num_layers=3)
    ref, ref_loss = _train_step(base, group, rank)
    for kwargs in (dict(recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=2),
                   dict(recompute_granularity="full", recompute_method="block",
                        recompute_num_layers=2, distribute_saved_activations=True),
                   dict(recompute_granularity="selective")):
        model, loss = _train_step(dataclasses.replace(base, **kwargs), group, rank)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=1e-9)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-9, msg=name)


def _check_checkpoint_shapes(group, rank):
    torch.manual_seed(0)
    model = GPTModel(dataclasses.replace(CONFIG, untie_embeddings_and_output_weights=True),
                     group)
    sd = model.state_dict_for_save_checkpoint()
    lm = sd["language_model"]
    shapes = {"word": tuple(lm["embedding"]["word_embeddings"]["weight"].shape),
              "pos": tuple(lm["embedding"]["position_embeddings"]["weight"].shape),
              "out": tuple(lm["output_layer"]["weight"].shape)}
    shapes.update({k: tuple(v.shape) for k, v in lm["encoder"].items()})
    return shapes


def _gpt_checks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    _check_model_equivalence(group, rank)
    _check_gathered_logits(group, rank)
    _check_dropout_masks(group, rank)
    if world_size == 2:
        _check_recompute(group, rank)
    return _check_checkpoint_shapes(group, rank)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_matches_tp1(tp):
    shapes = run_distributed(tp, _gpt_checks)[0]
    h = 16
    assert shapes["word"] == (VOCAB // tp, h)
    assert shapes["pos"] == (SEQ, h)
    assert shapes["out"] == (VOCAB // tp, h)
    assert shapes["layers.1.self_attention.query_key_value.weight"] == (3 * h // tp, h)
    assert shapes["layers.1.self_attention.query_key_value.bias"] == (3 * h // tp,)
    assert shapes["layers.1.self_attention.dense.weight"] == (h, h // tp)
    assert shapes["layers.1.self_attention.dense.bias"] == (h,)
    assert shapes["layers.0.mlp.dense_h_to_4h.weight"] == (4 * h // tp, h)
    assert shapes["layers.0.mlp.dense_4h_to_h.weight"] == (h, 4 * h // tp)
    assert shapes["final_layernorm.weight"] == (h,)


def test_checkpoint_layout_and_round_trip():
    torch.manual_seed(0)
    model = GPTModel(CONFIG, None)
    sd = model.state_dict_for_save_checkpoint()
    assert set(sd) == {"language_model"}
    assert set(sd["language_model"]) == {"embedding", "encoder"}
    assert set(sd["language_model"]["embedding"]) == {"word_embeddings", "position_embeddings"}
    enc = sd["language_model"]["encoder"]
    assert "layers.0.self_attention.query_key_value.weight" in enc
    assert "final_layernorm.bias" in enc
    per_layer = {k.split(".", 2)[2] for k in enc if k.startswith("layers.0.")}
    assert per_layer == {f"{m}.{p}" for p in ("weight", "bias") for m in (
        "input_layernorm", "self_attention.query_key_value", "self_attention.dense",
        "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")}

    buf = io.BytesIO()
    torch.save({"model": sd, "checkpoint_version": 3.0}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["model"]
    torch.manual_seed(1)
    other = GPTModel(CONFIG, None)
    other.load_state_dict(loaded)
    ids, pos, labels = _batch()
    torch.testing.assert_close(other(ids, pos, labels=labels), model(ids, pos, labels=labels))
    # The tied output weight is the embedding Parameter itself.
    assert other.shared_embedding_or_output_weight() is \
        other.language_model.embedding.word_embeddings.weight
    # One Parameter, not a duplicate: counted in the grad norm (not marked `shared`).
    assert not getattr(other.shared_embedding_or_output_weight(), "shared", False)
    assert [n for n, _ in other.named_parameters()].count(
        "language_model.embedding.word_embeddings.weight") == 1


def test_last_pipeline_stage_holds_shared_copy():
    torch.manual_seed(0)
    last = GPTModel(CONFIG, None, pre_process=False, post_process=True, num_layers=1,
                    layer_offset=1)
    weight = last.shared_embedding_or_output_weight()
    assert weight.shared and weight is last.word_embeddings.weight
    assert set(last.state_dict_for_save_checkpoint()) == {"language_model",
                                                          "word_embeddings_for_head"}
    last.set_input_tensor(torch.randn(SEQ, BATCH, 16, dtype=DT, device=device.get_device()))
    _, _, labels = _batch()
    assert last(None, None, labels=labels).shape == (BATCH, SEQ)
    first = GPTModel(CONFIG, None, pre_process=True, post_process=False, num_layers=1)
    ids, pos, _ = _batch()
    assert first(ids, pos).shape == (SEQ, BATCH, 16)


def test_load_old_names_and_strict_errors():
    torch.manual_seed(0)
    model = GPTModel(CONFIG, None)
    sd = model.state_dict_for_save_checkpoint()
    lm = sd["language_model"]
    old = {"language_model": {"embedding": lm["embedding"], "transformer": {
        k.replace(".self_attention.", ".attention."): v for k, v in lm["encoder"].items()}}}
    torch.manual_seed(1)
    other = GPTModel(CONFIG, None)
    other.load_state_dict(old)
    for a, b in zip(other.parameters(), model.parameters()):
        assert torch.equal(a, b)

    broken = {"language_model": {"embedding": lm["embedding"], "encoder": dict(lm["encoder"])}}
    del broken["language_model"]["encoder"]["final_layernorm.bias"]
    broken["language_model"]["encoder"]["layers.9.extra"] = torch.zeros(1)
    broken["language_model"]["encoder"]["layers.0.mlp.dense_h_to_4h.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as err:
        other.load_state_dict(broken)
    msg = str(err.value)
    assert "language_model.encoder.final_layernorm.bias" in msg
    assert "language_model.encoder.layers.9.extra" in msg
    assert "dense_h_to_4h.weight: checkpoint (3, 3) vs model (64, 16)" in msg


def test_gpt_model_from_cli_and_param_count():
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
                      "--max-position-embeddings", "8", "--seq-length", "8",
                      "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", str(VOCAB - 1), "--make-vocab-size-divisible-by",
                      str(VOCAB)], world_size=1)
    assert cfg.padded_vocab_size == VOCAB  # the vocabulary and its end-of-document token
    torch.manual_seed(0)
    model = gpt_model_from(cfg)
    assert num_parameters(transformer_config(cfg)) == \
        sum(p.numel() for p in model.parameters())
    untied = dataclasses.replace(CONFIG, untie_embeddings_and_output_weights=True)
    assert num_parameters(untied) == sum(p.numel() for p in GPTModel(untied, None).parameters())
    # GPT-2 small (vocab padded to 50304): 124.48 M; FLOPs = the paper's 72 B s l h^2 (...).
    gpt2 = TransformerConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                             padded_vocab_size=50304, max_position_embeddings=1024)
    assert num_parameters(gpt2) == 124_475_904
    b, s, l, h, v = 8, 1024, 12, 768, 50304
    paper = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert num_floating_point_operations(gpt2, b, s) == pytest.approx(paper)
    full = dataclasses.replace(gpt2, recompute_granularity="full", recompute_method="uniform")
    paper_recompute = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert num_floating_point_operations(full, b, s, include_recompute=True) == \
        pytest.approx(paper_recompute)


def test_init_std_and_scaled_output_projections():
    """Init N(0, sigma); the two output projections (attention dense, MLP dense_4h_to_h) use
    sigma / sqrt(2 L) (paper, section 4.2), here for L = 8."""
    layers, sigma = 8, 0.02
    config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                               padded_vocab_size=256, max_position_embeddings=64,
                               init_method_std=sigma)
    torch.manual_seed(0)
    params = dict(GPTModel(config, None).named_parameters())

    def std(suffix):
        values = torch.cat([p.detach().flatten() for n, p in params.items()
                            if n.endswith(suffix)])
        return values.std().item()

    scaled = sigma / math.sqrt(2 * layers)
    for suffix in ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight"):
        assert std(suffix) == pytest.approx(scaled, rel=0.05), suffix
    for suffix in ("self_attention.query_key_value.weight", "mlp.dense_h_to_4h.weight",
                   "word_embeddings.weight", "position_embeddings.weight"):
        assert std(suffix) == pytest.approx(sigma, rel=0.05), suffix


def test_inplace_loss_matches_cross_entropy_on_logits():
    """The in-place vocab-parallel loss (logits marked dirty) gives F.cross_entropy's loss and
    every parameter gradient through the tied output layer."""
    ids, pos, labels = _batch()
    grads = []
    for use_labels in (True, False):
        torch.manual_seed(3)
        model = GPTModel(CONFIG, None)
        if use_labels:
            loss = model(ids, pos, labels=labels)  # [b, s]
        else:
            logits = model(ids, pos)  # [b, s, V]
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                   reduction="none").view(BATCH, SEQ)
        loss.sum().backward()
        grads.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-10, atol=1e-12)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
