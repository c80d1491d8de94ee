"""Models built from the transformer blocks: the shared language-model base, GPT and BERT."""

from megatron.core.models.bert import BertModel, bert_model_stage
from megatron.core.models.gpt import GPTModel, gpt_model_stage
from megatron.core.models.language_module import LanguageModule, build_model_stage

__all__ = ["BertModel", "GPTModel", "LanguageModule", "bert_model_stage", "build_model_stage",
           "gpt_model_stage"]
