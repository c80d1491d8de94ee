"""Transformer building blocks composed from tensor-parallel layers (no collectives here)."""

from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layer import TransformerLayer

__all__ = ["TransformerBlock", "TransformerConfig", "TransformerLayer"]
