"""Autoregressive text generation from a (tensor-parallel) GPT model."""

from megatron.text_generation.generation import generate_tokens, generate_text
from megatron.text_generation.sampling import sample

__all__ = ["generate_text", "generate_tokens", "sample"]
