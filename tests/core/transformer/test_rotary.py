"""RoPE's per-step work: cos and sin come from a table built once, one pair per forward serves
every layer's queries and keys, and at ``--rotary-percent 1`` no pass-through part is joined
back (a ``torch.cat`` copy of q and k). The rotation's values are checked against written-out
references in ``test_llama_layer.py``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import device
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.rotary import RotaryEmbedding, apply_rotary_pos_emb
from tests.core.transformer.test_llama_layer import LLAMA


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _forward_counts(percent: float) -> tuple[Counter, Counter]:
    cfg = TransformerConfig(**{**LLAMA, "padded_vocab_size": 64, "max_position_embeddings": 16,
                               "rotary_percent": percent, "num_query_groups": LLAMA[
                                   "num_attention_heads"]})
    torch.manual_seed(0)
    model = GPTModel(cfg, None)
    ids = torch.randint(0, 64, (2, 8), device=device.get_device())
    positions = torch.arange(8, device=device.get_device()).expand(2, 8)
    out = []
    for _ in range(2):
        with _OpCounter() as counter:
            model(ids, positions).sum().backward()
        out.append(counter.counts)
    return out[0], out[1]


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_cos_and_sin_once_per_table_and_no_pass_through_copy_at_full_rotation(percent):
    first, second = _forward_counts(percent)
    layers = LLAMA["num_layers"]
    # The table's cos and sin, once; later steps slice it (no per-layer, per-q/k recompute).
    assert (first["cos"], first["sin"]) == (1, 1)
    assert (second["cos"], second["sin"]) == (0, 0)
    # Forward cats (no grad): _rotate_half of q and of k in every layer, and the pass-through
    # join only where part of each head passes through.
    joins = 2 * layers * (1 if percent == 1.0 else 2)
    assert _forward_only_cats(percent) == joins


def _forward_only_cats(percent: float) -> int:
    cfg = TransformerConfig(**{**LLAMA, "padded_vocab_size": 64, "max_position_embeddings": 16,
                               "rotary_percent": percent, "num_query_groups": LLAMA[
                                   "num_attention_heads"]})
    model = GPTModel(cfg, None)
    ids = torch.randint(0, 64, (2, 8), device=device.get_device())
    positions = torch.arange(8, device=device.get_device()).expand(2, 8)
    with torch.no_grad():
        model(ids, positions)  # builds the angle table (its own cat)
        with _OpCounter() as counter:
            model(ids, positions)
    return counter.counts["cat"]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_cos_sin_pair_equals_the_angles_form(interleaved, percent):
    rope = RotaryEmbedding(16, percent, interleaved)
    t = torch.randn(8, 2, 3, 16, dtype=torch.float64)
    angles = rope.table(8, t.device).view(8, 1, 1, -1)
    pair = rope(8, device=t.device, dtype=torch.float64)
    torch.testing.assert_close(apply_rotary_pos_emb(t, pair, interleaved),
                               apply_rotary_pos_emb(t, angles, interleaved), rtol=0, atol=0)
