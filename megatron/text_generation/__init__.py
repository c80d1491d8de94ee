"""Autoregressive text generation from a (tensor-parallel) GPT model."""

from megatron.text_generation.generation import (check_generation_lengths, generate_text,
                                                 generate_tokens)
from megatron.text_generation.sampling import check_sampling_options, sample

__all__ = ["check_generation_lengths", "check_sampling_options", "generate_text",
           "generate_tokens", "sample"]
