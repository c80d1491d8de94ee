"""Typed configuration: Megatron-LM compatible flags parsed into validated dataclass sections.

argv -> :func:`megatron.config.cli.parse_args` -> :class:`MegatronConfig` -> :func:`validate`.
"""

from megatron.config.checkpoint import CheckpointConfig
from megatron.config.cli import MegatronConfig, build_parser, parse_args
from megatron.config.data import DataConfig, TokenizerConfig
from megatron.config.logging import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.config.optimizer import MixedPrecisionConfig, OptimizerConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.training import TrainingConfig
from megatron.config.validate import validate

__all__ = [
    "CheckpointConfig", "DataConfig", "LoggingConfig", "MegatronConfig", "MixedPrecisionConfig",
    "ModelConfig", "OptimizerConfig", "ParallelConfig", "TokenizerConfig", "TrainingConfig",
    "build_parser", "parse_args", "validate",
]
