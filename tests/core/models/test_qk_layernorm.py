"""--qk-layernorm on the model: a Llama-style GPT (GQA, RoPE, RMSNorm, no biases;
GeLU, whose fc1 gathers rank-major, unlike SwiGLU's [gate_r; up_r]) at TP = 2, with and
without sequence parallelism, gives TP = 1's parameters and gradients (float64) once the q/k
norms' per-rank partial gradients are summed over TP; without that sum they differ, which is
why the norms are marked even without sequence parallelism."""

from __future__ import annotations

import dataclasses

import torch

from megatron.core import device
from megatron.core import parallel_state as ps
from megatron.core.distributed import allreduce_sequence_parallel_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer.config import TransformerConfig
from tests.core.tp_helpers import assert_same_params_and_grads
from tests.multiprocess import run_distributed

DT = torch.float64
VOCAB, SEQ, BATCH = 64, 8, 2
LLAMA = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=48, padded_vocab_size=VOCAB,
                          max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                          params_dtype=DT, normalization="RMSNorm",
                          position_embedding_type="rope", add_bias_linear=False,
                          untie_embeddings_and_output_weights=True, qk_layernorm=True)


def _step(config, group, rank, reduce=True):
    torch.manual_seed(1234)
    model = GPTModel(config, group)
    with torch.no_grad():  # norm weights away from their init: each head's scale matters
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype, device=p.device))
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device.get_device())
    positions = torch.arange(SEQ, device=tokens.device).expand(BATCH, SEQ)
    model_parallel_manual_seed(1234, rank)
    model(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean().backward()
    if reduce:
        allreduce_sequence_parallel_grads([model], group)  # finalize_model_grads' TP sum
    return model


def _checks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    for config in (LLAMA, dataclasses.replace(LLAMA, sequence_parallel=True),
                   dataclasses.replace(LLAMA, normalization="LayerNorm", num_query_groups=4)):
        ref = _step(config, None, 0)
        assert_same_params_and_grads(ref, _step(config, group, rank), group,
                                     rtol=1e-10, atol=1e-12)
    partial = dict(_step(LLAMA, group, rank, reduce=False).named_parameters())
    q_norm = "language_model.encoder.layers.0.self_attention.q_layernorm.weight"
    assert not torch.allclose(partial[q_norm].grad, dict(ref.named_parameters())[q_norm].grad)
    return partial[q_norm].shape, bool(getattr(partial[q_norm], "sequence_parallel", False))


def test_qk_layernorm_tp2_equals_tp1():
    for shape, marked in run_distributed(2, _checks):
        assert shape == (LLAMA.kv_channels,) and marked  # whole [hn] on every rank
