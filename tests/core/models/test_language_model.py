"""BERT-readiness of the shared language-model stack at TP = 2 and 4 against TP = 1 (float64):
padding attention mask, token-type embeddings, both attention paths; and the checkpoint key of
the token-type table (``docs/FORMATS.md``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.core import device
from megatron.core import parallel_state as ps
from megatron.core.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.core.models.gpt import GPTModel
from megatron.core.models.language_model import TransformerLanguageModel
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer.config import TransformerConfig
from tests.core.tp_helpers import assert_same_params_and_grads
from tests.multiprocess import run_distributed

DT = torch.float64
VOCAB, SEQ, BATCH, HIDDEN = 64, 8, 2, 16
LENGTHS = (SEQ, 5)  # sample 1 is padded after 5 tokens
CONFIG = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                           padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
                           num_tokentypes=2, hidden_dropout=0.0, attention_dropout=0.0,
                           params_dtype=DT)
TOKENTYPE_KEY = "language_model.embedding.tokentype_embeddings.weight"


def _bert_batch():
    """ids, position ids, token types (two segments) ``[b, s]`` and the padding mask
    ``[b, 1, s, s]`` (True = masked: a padded query or key, as Megatron's BERT builds it)."""
    dev = device.get_device()
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(dev)
    ids[0, :4] = torch.tensor([0, 15, 16, 63])  # ids at TP-4 partition borders
    pos = torch.arange(SEQ, device=dev).expand(BATCH, SEQ)
    tokentypes = (torch.arange(SEQ, device=dev) >= 3).long().expand(BATCH, SEQ)
    real = torch.arange(SEQ, device=dev) < torch.tensor(LENGTHS, device=dev).unsqueeze(1)
    mask = ~(real[:, None, :, None] & real[:, None, None, :])  # [b, 1, s, s]
    return ids, pos, tokentypes, mask


def _forward_backward(config, group, rank, seed=1234):
    torch.manual_seed(seed)
    lm = TransformerLanguageModel(config, group, attn_mask_type="padding")
    ids, pos, tokentypes, mask = _bert_batch()
    model_parallel_manual_seed(seed, rank)
    out = lm(ids, pos, mask, tokentype_ids=tokentypes)  # [s, b, h]
    grad = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3),
                       dtype=DT).to(out.device)
    out.backward(grad)
    return lm, out.detach()


def _bert_checks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    for backend in ("auto", "unfused"):
        config = dataclasses.replace(CONFIG, attention_backend=backend)
        ref, ref_out = _forward_backward(config, None, 0)
        par, out = _forward_backward(config, group, rank)
        torch.testing.assert_close(out, ref_out, rtol=1e-7, atol=1e-9)
        assert_same_params_and_grads(ref, par, group)
        assert par.embedding.tokentype_embeddings.weight.grad.abs().min() > 0  # both rows used
    flat = flatten_checkpoint_state_dict(
        {"language_model": par.state_dict_for_save_checkpoint()})
    return {key: tuple(value.shape) for key, value in flat.items()
            if key.startswith("language_model.embedding.")}


@pytest.mark.parametrize("tp", [2, 4])
def test_padding_mask_and_tokentypes_match_tp1(tp):
    shapes = run_distributed(tp, _bert_checks)[0]
    assert shapes == {"language_model.embedding.word_embeddings.weight": (VOCAB // tp, HIDDEN),
                      "language_model.embedding.position_embeddings.weight": (SEQ, HIDDEN),
                      TOKENTYPE_KEY: (2, HIDDEN)}


def test_tokentype_embeddings_saved_and_loaded():
    """The token-type table is saved under Megatron's key and read back (replicated, not
    TP-split: the optimizer counts it on TP rank 0 only)."""
    torch.manual_seed(0)
    model = GPTModel(CONFIG, None)
    table = model.language_model.embedding.tokentype_embeddings.weight
    assert not table.tensor_model_parallel
    flat = flatten_checkpoint_state_dict(model.state_dict_for_save_checkpoint())
    assert torch.equal(flat[TOKENTYPE_KEY], table)
    torch.manual_seed(1)
    other = GPTModel(CONFIG, None)
    other.load_state_dict(model.state_dict_for_save_checkpoint())
    assert torch.equal(other.language_model.embedding.tokentype_embeddings.weight, table)
