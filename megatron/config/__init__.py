"""Typed configuration: Megatron-LM compatible flags parsed into validated dataclass sections.

argv -> :func:`megatron.config.cli.parse_args` -> :class:`MegatronConfig` -> :func:`validate`.
The section dataclasses import without torch (tools such as preprocess_data start faster);
the parser and validation load it on first use.
"""

from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import DataConfig
from megatron.config.logging import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.config.optimizer import MixedPrecisionConfig, OptimizerConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.training import TrainingConfig
from megatron.tokenizer.config import TokenizerConfig

__all__ = [
    "CheckpointConfig", "DataConfig", "LoggingConfig", "MegatronConfig", "MixedPrecisionConfig",
    "ModelConfig", "OptimizerConfig", "ParallelConfig", "TokenizerConfig", "TrainingConfig",
    "build_parser", "parse_args", "validate",
]

_LAZY = {"MegatronConfig": "megatron.config.cli", "build_parser": "megatron.config.cli",
         "parse_args": "megatron.config.cli", "validate": "megatron.config.validate"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron.config' has no attribute {name!r}")
