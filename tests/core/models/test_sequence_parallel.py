"""Sequence parallelism on the model: GPT and BERT at TP = 2 and 4 with
``sequence_parallel`` give the loss and the re-assembled gradients of TP = 1 (float64, dropout 0),
with every recompute mode; the replicated LayerNorm and row-parallel bias gradients are summed
over TP ranks and so identical on all of them; with dropout on, a run reproduces itself and its
residual masks differ between TP ranks (each rank drops its own rows); the state dict is the one
without sequence parallelism (a checkpoint loads either way); the sequence-split mappings'
forward and backward. One pooled world per TP size runs every check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.core import comm, device
from megatron.core import parallel_state as ps
from megatron.core.distributed import allreduce_sequence_parallel_grads
from megatron.core.models.bert import BertModel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import (gather_from_sequence_parallel_region,
                                           model_parallel_manual_seed,
                                           reduce_scatter_to_sequence_parallel_region,
                                           scatter_to_sequence_parallel_region)
from megatron.core.transformer.config import TransformerConfig
from tests.core.tp_helpers import assert_same_params_and_grads
from tests.multiprocess import run_distributed

DT = torch.float64
VOCAB, SEQ, BATCH = 64, 8, 2
CONFIG = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                           padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
                           hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DT)
SP = dataclasses.replace(CONFIG, sequence_parallel=True)
RECOMPUTE = (dict(),
             dict(recompute_granularity="selective"),
             dict(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1, distribute_saved_activations=True),
             dict(recompute_granularity="full", recompute_method="block",
                  recompute_num_layers=1))


def _batch():
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device.get_device())
    position_ids = torch.arange(SEQ, device=tokens.device).expand(BATCH, SEQ)
    return tokens[:, :-1], position_ids, tokens[:, 1:]


def _gpt_step(config, group, rank, seed=1234):
    torch.manual_seed(seed)
    model = GPTModel(config, group)
    ids, pos, labels = _batch()
    model_parallel_manual_seed(seed, rank)
    loss = model(ids, pos, labels=labels)  # [b, s]
    loss.mean().backward()
    allreduce_sequence_parallel_grads([model], group)  # finalize_model_grads' TP sum
    return model, loss.detach()


def _bert_step(config, group, rank):
    torch.manual_seed(1234)
    model = BertModel(dataclasses.replace(config, num_tokentypes=2), group)
    ids, _, _ = _batch()
    padding = torch.ones_like(ids)
    padding[1, -3:] = 0
    labels = torch.full_like(ids, -1)
    labels[:, 1::3] = ids[:, 1::3]
    types = torch.zeros_like(ids)
    types[:, SEQ // 2:] = 1
    model_parallel_manual_seed(1234, rank)
    lm_loss, binary = model(ids, padding, types, lm_labels=labels)
    (lm_loss.sum() + binary.square().sum()).backward()
    allreduce_sequence_parallel_grads([model], group)
    return model, lm_loss.detach()


def _assert_replicated_grads_identical(model, group):
    """Every replicated parameter's gradient is bitwise the same on every TP rank."""
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            continue
        grads = comm.all_gather_list(param.grad.contiguous(), group)
        assert all(torch.equal(grads[0], g) for g in grads[1:]), name


def _check_gpt_equals_tp1(group, rank):
    for kwargs in RECOMPUTE + (dict(untie_embeddings_and_output_weights=True),
                               dict(attention_backend="unfused")):
        ref, ref_loss = _gpt_step(dataclasses.replace(CONFIG, **kwargs), None, 0)
        par, loss = _gpt_step(dataclasses.replace(SP, **kwargs), group, rank)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=1e-9, msg=str(kwargs))
        assert_same_params_and_grads(ref, par, group)
        _assert_replicated_grads_identical(par, group)
    marked = sorted(n for n, p in par.named_parameters() if getattr(p, "sequence_parallel", 0))
    assert marked == sorted(
        [f"language_model.encoder.layers.{i}.{m}.{w}" for i in range(2)
         for m in ("input_layernorm", "post_attention_layernorm") for w in ("weight", "bias")]
        + [f"language_model.encoder.layers.{i}.{m}.dense{d}.bias" for i in range(2)
           for m, d in (("self_attention", ""), ("mlp", "_4h_to_h"))]
        + ["language_model.encoder.final_layernorm.weight",
           "language_model.encoder.final_layernorm.bias"])


def _check_bert_equals_tp1(group, rank):
    ref, ref_loss = _bert_step(CONFIG, None, 0)
    par, loss = _bert_step(SP, group, rank)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=1e-9)
    assert_same_params_and_grads(ref, par, group)
    _assert_replicated_grads_identical(par, group)


def _check_dropout(group, rank):
    """With dropout the SP run is deterministic, its replicated gradients agree over TP ranks,
    and it differs from the run without SP (each rank draws its rows' masks from its own TP
    stream, as Megatron)."""
    config = dataclasses.replace(SP, hidden_dropout=0.3, attention_dropout=0.3)
    runs = [_gpt_step(config, group, rank) for _ in range(2)]
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)
    for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert torch.equal(p.grad, q.grad)
    _assert_replicated_grads_identical(runs[0][0], group)
    _, plain = _gpt_step(dataclasses.replace(config, sequence_parallel=False), group, rank)
    assert not torch.equal(plain, runs[0][1])
    # Selective and full recompute replay the forward's masks.
    for kwargs in RECOMPUTE[1:]:
        _, loss = _gpt_step(dataclasses.replace(config, **kwargs), group, rank)
        torch.testing.assert_close(loss, runs[0][1], rtol=1e-12, atol=1e-12, msg=str(kwargs))


def _check_state_dict_unchanged(group, rank):
    """SP changes no weight: same keys, shapes, values; loading across works."""
    torch.manual_seed(7)
    plain = GPTModel(CONFIG, group)
    torch.manual_seed(7)
    split = GPTModel(SP, group)
    a, b = plain.state_dict_for_save_checkpoint(), split.state_dict_for_save_checkpoint()
    flat_a, flat_b = plain.state_dict(), split.state_dict()
    assert list(flat_a) == list(flat_b)
    assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a)
    torch.manual_seed(99)
    other = GPTModel(SP, group)
    other.load_state_dict(a)
    ids, pos, labels = _batch()
    torch.testing.assert_close(other(ids, pos, labels=labels), plain(ids, pos, labels=labels),
                               rtol=1e-7, atol=1e-9)
    plain.load_state_dict(b)


def _check_mappings(group, rank):
    tp = comm.world_size(group)
    full = torch.arange(4 * tp * 3, dtype=DT).view(4 * tp, 3)  # [s, h]
    mine = full.chunk(tp)[rank]
    x = full.clone().requires_grad_()
    out = scatter_to_sequence_parallel_region(x, group)
    assert torch.equal(out, mine)
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, torch.ones_like(full))  # every rank's rows gathered back
    y = mine.clone().requires_grad_()
    gathered = gather_from_sequence_parallel_region(y, group)
    assert torch.equal(gathered, full)
    gathered.backward(full)  # partial gradients: summed over ranks, this rank's rows kept
    assert torch.equal(y.grad, tp * mine)
    y.grad = None
    gather_from_sequence_parallel_region(y, group, grad_is_partial=False).backward(full)
    assert torch.equal(y.grad, mine)
    z = full.clone().requires_grad_()
    reduced = reduce_scatter_to_sequence_parallel_region(z, group)
    assert torch.equal(reduced, tp * mine)
    reduced.backward(mine)
    assert torch.equal(z.grad, full)


def _sp_checks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    _check_mappings(group, rank)
    _check_gpt_equals_tp1(group, rank)
    _check_bert_equals_tp1(group, rank)
    if world_size == 2:
        _check_dropout(group, rank)
        _check_state_dict_unchanged(group, rank)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_matches_tp1(tp):
    assert run_distributed(tp, _sp_checks) == [True] * tp


def test_sequence_parallel_half_precision():
    """bf16 with SP stays within rounding of the same bf16 model without it."""
    assert run_distributed(2, _half_checks) == [True, True]


def _half_checks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    for dtype in (torch.bfloat16, torch.float16):
        base = dataclasses.replace(CONFIG, params_dtype=dtype)
        _, plain = _gpt_step(base, group, rank)
        model, split = _gpt_step(dataclasses.replace(base, sequence_parallel=True), group, rank)
        torch.testing.assert_close(split, plain, rtol=2e-2, atol=2e-2)
        _assert_replicated_grads_identical(model, group)
    return True
