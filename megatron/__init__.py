"""A Megatron-LM compatible large-language-model pretraining framework."""

__version__ = "0.1.0"
