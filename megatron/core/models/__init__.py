"""Models built from the transformer blocks: GPT (and the shared language-model pieces)."""

from megatron.core.models.gpt import GPTModel, gpt_model_from

__all__ = ["GPTModel", "gpt_model_from"]
