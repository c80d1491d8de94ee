"""Models built from the transformer blocks: the shared language-model base and GPT."""

from megatron.core.models.gpt import GPTModel, gpt_model_stage
from megatron.core.models.language_module import LanguageModule, build_model_stage

__all__ = ["GPTModel", "LanguageModule", "build_model_stage", "gpt_model_stage"]
