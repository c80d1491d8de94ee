"""Models built from the transformer blocks: the shared language-model base, GPT and BERT, and
the builder of a rank's pipeline stage (``builder``)."""

from megatron.core.models.bert import BertModel
from megatron.core.models.builder import build_model_stage, pipeline_stage_layers
from megatron.core.models.gpt import GPTModel
from megatron.core.models.language_module import LanguageModule

__all__ = ["BertModel", "GPTModel", "LanguageModule", "build_model_stage",
           "pipeline_stage_layers"]
