"""The KV cache: chunks fed through the cache give the logits of one full forward (any chunk
sizes, both attention paths), the buffers are preallocated once and bounded, and beam search's
row reordering moves every layer's rows."""

from __future__ import annotations

import pytest
import torch

from megatron.core.inference_params import InferenceParams
from tests.text_generation.tiny import tiny_model


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_chunks_through_the_cache_equal_one_forward(backend):
    model = tiny_model(attention_backend=backend)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9).expand(2, 9)
    full = model(ids, positions, None)  # [b, s, V]
    cache = InferenceParams(2, 12)
    pieces = []
    for start, end in ((0, 3), (3, 5), (5, 6), (6, 9)):
        pieces.append(model(ids[:, start:end], positions[:, start:end], None,
                            inference_params=cache))
        cache.sequence_len_offset = end
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-12)
    keys, values = cache.key_value_memory_dict[1]
    assert keys.shape == (12, 2, 4, 4) and values.shape == keys.shape  # [s_max, b, np, hn]


def test_buffers_are_bounded_and_allocated_once():
    cache = InferenceParams(2, 4)
    kv = torch.ones(3, 2, 1, 2)
    cache.store(1, kv, kv)
    first = cache.key_value_memory_dict[1][0].data_ptr()
    cache.sequence_len_offset = 3
    keys, _ = cache.store(1, kv[:1] * 2, kv[:1] * 2)
    assert cache.key_value_memory_dict[1][0].data_ptr() == first
    assert keys.shape == (4, 2, 1, 2) and float(keys[3, 0, 0, 0]) == 2.0
    cache.sequence_len_offset = 4
    with pytest.raises(ValueError, match="KV cache holds 4 positions x 2 rows; this step needs 5"):
        cache.store(1, kv[:1], kv[:1])
    with pytest.raises(ValueError, match=">= 1"):
        InferenceParams(0, 4)


def test_swap_reorders_every_layer():
    cache = InferenceParams(3, 2)
    for layer in (1, 2):
        rows = torch.arange(3.0).view(1, 3, 1, 1).expand(2, 3, 1, 1)
        cache.store(layer, rows + layer, rows + layer)
    cache.swap_key_value_dict(torch.tensor([2, 2, 0]))
    for layer in (1, 2):
        keys, values = cache.key_value_memory_dict[layer]
        assert keys[0, :, 0, 0].tolist() == [2 + layer, 2 + layer, 0 + layer]
        assert torch.equal(keys, values)


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_only_last_token_logits_are_those_of_the_full_forward(backend):
    """Generation without log-probs projects only each forward's last position."""
    model = tiny_model(attention_backend=backend)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(7).expand(2, 7)
    full = model(ids, positions, None)  # [b, s, V]
    cache = InferenceParams(2, 7, materialize_only_last_token_logits=True)
    for start, end in ((0, 4), (4, 5), (5, 6), (6, 7)):  # a prefill, then one token a step
        last = model(ids[:, start:end], positions[:, start:end], None, inference_params=cache)
        cache.sequence_len_offset = end
        assert last.shape == (2, 1, full.size(-1))
        assert torch.allclose(last[:, 0], full[:, end - 1], atol=1e-12)
