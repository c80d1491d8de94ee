"""An explicit attention mask (BERT's padding, --reset-attention-mask) becomes SDPA's additive
mask once per forward of the block, not once in every layer; the values are unchanged."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.config import TransformerConfig


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_padding_mask_is_made_additive_once_for_every_layer():
    cfg = TransformerConfig(num_layers=3, hidden_size=16, num_attention_heads=2,
                            hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=torch.float64)
    torch.manual_seed(0)
    block = TransformerBlock(cfg, None, attn_mask_type="padding")
    x = torch.randn(6, 2, 16, dtype=torch.float64)
    keep = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = ~(keep[:, None, :, None] & keep[:, None, None, :])  # [b, 1, s, s], True = masked
    with _OpCounter() as counter:
        out = block(x, mask)
    assert counter.counts["masked_fill"] == 1
    # The same as each layer taking the boolean mask itself.
    ref = x
    for layer in block.layers:
        ref = layer(ref, mask)
    torch.testing.assert_close(out, block.final_layernorm(ref), rtol=0, atol=0)
