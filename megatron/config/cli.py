"""Build the argument parser from the config sections and parse argv into a MegatronConfig."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

import torch

from megatron.config.base import add_section, build_section
from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import DataConfig
from megatron.config.logging import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.config.optimizer import MixedPrecisionConfig, OptimizerConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.training import TrainingConfig
from megatron.tokenizer.config import TokenizerConfig

# (attribute of MegatronConfig, section class, --help group title)
SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("model", ModelConfig, "model (network size, dropout, initialization)"),
    ("parallel", ParallelConfig, "distributed"),
    ("training", TrainingConfig, "training and validation"),
    ("optimizer", OptimizerConfig, "optimizer and learning rate"),
    ("precision", MixedPrecisionConfig, "mixed precision"),
    ("data", DataConfig, "data"),
    ("tokenizer", TokenizerConfig, "tokenizer"),
    ("checkpoint", CheckpointConfig, "checkpointing"),
    ("logging", LoggingConfig, "logging"),
)

# Field names whose Megatron-LM ``args`` attribute is spelled differently.
_MEGATRON_DEST = {"ddp_impl": "DDP_impl"}

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


@dataclasses.dataclass(kw_only=True)
class MegatronConfig:
    """Every section, plus the values derived from them by :func:`validate`."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: MixedPrecisionConfig = dataclasses.field(default_factory=MixedPrecisionConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    extra: argparse.Namespace = dataclasses.field(default_factory=argparse.Namespace)
    """Flags added by a script's extra_args_provider (tasks, tools)."""

    # Derived by validate() -------------------------------------------------------------------
    world_size: int = dataclasses.field(default=1, init=False)
    data_parallel_size: int = dataclasses.field(default=1, init=False)
    virtual_pipeline_model_parallel_size: int | None = dataclasses.field(default=None, init=False)
    params_dtype: torch.dtype = dataclasses.field(default=torch.float32, init=False)
    padded_vocab_size: int | None = dataclasses.field(default=None, init=False)
    """Set once the tokenizer is known (megatron.tokenizer)."""

    def to_namespace(self) -> argparse.Namespace:
        """A flat ``argparse.Namespace`` with Megatron-LM's attribute names (saved as ``args``
        in checkpoints, so Megatron-LM can read ours)."""
        flat: dict = {}
        for attr, _, _ in SECTIONS:
            for key, value in dataclasses.asdict(getattr(self, attr)).items():
                flat[_MEGATRON_DEST.get(key, key)] = value
        flat.update(vars(self.extra))
        flat.update(world_size=self.world_size, data_parallel_size=self.data_parallel_size,
                    virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
                    params_dtype=self.params_dtype, padded_vocab_size=self.padded_vocab_size)
        return argparse.Namespace(**flat)


def build_parser(extra_args_provider: ExtraArgsProvider | None = None,
                 prog: str | None = None) -> argparse.ArgumentParser:
    """The full parser: one group per config section, no abbreviations."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Megatron-LM compatible arguments", allow_abbrev=False,
        usage="%(prog)s [options]  (see the groups below; every flag keeps Megatron-LM's name)")
    for attr, cls, title in SECTIONS:
        add_section(parser, cls, title)
    # Megatron-LM 23.06 spelled query-key layer scaling as an opt-out switch.
    parser.add_argument("--no-query-key-layer-scaling", dest="apply_query_key_layer_scaling",
                        action="store_false", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def parse_args(argv: Sequence[str] | None = None,
               extra_args_provider: ExtraArgsProvider | None = None,
               world_size: int | None = None, validate_config: bool = True,
               require_model: bool = True, prog: str | None = None) -> MegatronConfig:
    """Parse Megatron-LM flags into a validated :class:`MegatronConfig`.

    Args:
        argv: arguments (``sys.argv[1:]`` when None).
        extra_args_provider: adds a script's own flags to the parser; they land in ``cfg.extra``.
        world_size: ranks the run will have; defaults to ``$WORLD_SIZE`` (torchrun) or 1.
        validate_config: run :func:`validate` (exits with a clear message on a bad combination).
        require_model: the script builds a model, so the architecture flags are required.

    Raises:
        SystemExit: unknown flags, bad values or an impossible combination (exit code 2).
    """
    parser = build_parser(extra_args_provider, prog=prog)
    namespace = parser.parse_args(argv)
    values = vars(namespace)
    cfg = MegatronConfig(**{attr: build_section(cls, namespace) for attr, cls, _ in SECTIONS})
    owned = {f.name for _, cls, _ in SECTIONS for f in dataclasses.fields(cls)}
    cfg.extra = argparse.Namespace(**{k: v for k, v in values.items() if k not in owned})
    _fill_extra_defaults(parser, cfg.extra)
    cfg._parser = parser
    if validate_config:
        validate_or_exit(cfg, world_size, require_model)
    return cfg


def validate_or_exit(cfg: MegatronConfig, world_size: int | None = None,
                     require_model: bool = True, require_train_length: bool = False) -> None:
    """:func:`validate`, turning a ``ValueError`` into argparse's usage + error + exit 2."""
    from megatron.config.validate import validate

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    parser = getattr(cfg, "_parser", None) or build_parser()
    try:
        validate(cfg, world_size, require_model=require_model,
                 require_train_length=require_train_length)
    except ValueError as err:
        parser.print_usage(sys.stderr)
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def _fill_extra_defaults(parser: argparse.ArgumentParser, extra: argparse.Namespace) -> None:
    """Extra (script) flags keep their declared defaults; ours are SUPPRESSed until given."""
    for action in parser._actions:  # argparse offers no public iterator over actions
        if action.dest in ("help",) or action.default is argparse.SUPPRESS:
            continue
        if not hasattr(extra, action.dest):
            setattr(extra, action.dest, action.default)
