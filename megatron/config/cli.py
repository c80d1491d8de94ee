"""Build the argument parser from the config sections and parse argv into a MegatronConfig."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

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
# A script's own typed flag section: (dataclass, --help group title).
ToolSection = tuple[type, str]
T = TypeVar("T")


@dataclasses.dataclass(kw_only=True)
class MegatronConfig:
    """Every section, plus the values derived from them by :func:`validate`.

    A config returned by :func:`parse_args` or :func:`validate` is read-only.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: MixedPrecisionConfig = dataclasses.field(default_factory=MixedPrecisionConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    tools: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Typed flag sections of the running script (a tool's or task's), by class name: read
    them with :meth:`section`."""
    extra: argparse.Namespace = dataclasses.field(default_factory=argparse.Namespace)
    """Flags added by a Megatron-LM style ``extra_args_provider`` (third-party scripts)."""
    given: dict[str, str] = dataclasses.field(default_factory=dict)
    """The flags given on the command line: field name -> the spelling typed (an alias such as
    ``--norm-epsilon`` included), so errors name the flag the user wrote."""

    def flag(self, name: str, main: str) -> str:
        """The spelling of field ``name`` the user typed, else ``main``."""
        return self.given.get(name, main)

    # Derived by validate() -------------------------------------------------------------------
    world_size: int = dataclasses.field(default=1, init=False)
    data_parallel_size: int = dataclasses.field(default=1, init=False)
    virtual_pipeline_model_parallel_size: int | None = dataclasses.field(default=None, init=False)
    params_dtype: torch.dtype = dataclasses.field(default=torch.float32, init=False)
    padded_vocab_size: int | None = dataclasses.field(default=None, init=False)
    """The tokenizer's vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP
    (None when the script builds no model or names no tokenizer)."""

    def section(self, cls: type[T]) -> T:
        """The script's flag section of type ``cls`` (given to :func:`parse_args`)."""
        try:
            return self.tools[cls.__name__]
        except KeyError:
            raise KeyError(f"no {cls.__name__} flags were parsed: pass it in tool_sections "
                           "when parsing") from None

    def to_namespace(self) -> argparse.Namespace:
        """A flat ``argparse.Namespace`` with Megatron-LM's attribute names (saved as ``args``
        in checkpoints, so Megatron-LM can read ours)."""
        flat: dict = {}
        for attr, _, _ in SECTIONS:
            for key, value in dataclasses.asdict(getattr(self, attr)).items():
                flat[_MEGATRON_DEST.get(key, key)] = value
        for section in self.tools.values():
            flat.update(dataclasses.asdict(section))
        flat.update(vars(self.extra))
        flat.update(world_size=self.world_size, data_parallel_size=self.data_parallel_size,
                    virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
                    params_dtype=self.params_dtype, padded_vocab_size=self.padded_vocab_size)
        return argparse.Namespace(**flat)


def build_parser(extra_args_provider: ExtraArgsProvider | None = None,
                 prog: str | None = None,
                 tool_sections: Sequence[ToolSection] = ()) -> argparse.ArgumentParser:
    """The full parser: one group per config section, no abbreviations."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Megatron-LM compatible arguments", allow_abbrev=False,
        usage="%(prog)s [options]  (see the groups below; every flag keeps Megatron-LM's name)")
    for attr, cls, title in SECTIONS:
        add_section(parser, cls, title)
    for cls, title in tool_sections:
        add_section(parser, cls, title)
    # Megatron-LM 23.06 spelled query-key layer scaling as an opt-out switch.
    parser.add_argument("--no-query-key-layer-scaling", dest="apply_query_key_layer_scaling",
                        action="store_false", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
                tool_sections: Sequence[ToolSection] = ()) -> MegatronConfig:
    """The flags as given, not yet validated (a writable config for :func:`validate`)."""
    namespace = parser.parse_args(argv)
    values = vars(namespace)
    cfg = MegatronConfig(**{attr: build_section(cls, namespace) for attr, cls, _ in SECTIONS})
    cfg.tools = {cls.__name__: build_section(cls, namespace) for cls, _ in tool_sections}
    owned = {f.name for cls in [c for _, c, _ in SECTIONS] + [c for c, _ in tool_sections]
             for f in dataclasses.fields(cls)}
    cfg.extra = argparse.Namespace(**{k: v for k, v in values.items() if k not in owned})
    _fill_extra_defaults(parser, cfg.extra)
    cfg.given = _given_flags(parser, sys.argv[1:] if argv is None else argv)
    return cfg


def _given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """dest -> the option string typed for it (the last one where several were)."""
    given: dict[str, str] = {}
    for token in argv:
        if token == "--":
            break
        action = parser._option_string_actions.get(str(token).split("=", 1)[0])  # noqa: SLF001
        if action is not None and action.dest not in (None, argparse.SUPPRESS, "help"):
            given[action.dest] = str(token).split("=", 1)[0]
    return given


def parse_command_line(argv: Sequence[str] | None = None, prog: str | None = None,
                       tool_sections: Sequence[ToolSection] = (),
                       extra_args_provider: ExtraArgsProvider | None = None,
                       ) -> tuple[MegatronConfig, argparse.ArgumentParser]:
    """``argv`` parsed once: the flags as given (writable, not validated) and the parser, whose
    usage line and ``prog`` later errors print (:func:`validate_or_exit`)."""
    parser = build_parser(extra_args_provider, prog=prog, tool_sections=tool_sections)
    return parse_flags(parser, argv, tool_sections), parser


def replace_flags(flags: MegatronConfig, **sections: dict[str, Any]) -> MegatronConfig:
    """A copy of the parsed, not yet validated ``flags`` with some fields changed, as if their
    flags had been given: ``replace_flags(flags, training={"train_iters": 100})``. Each named
    section is rebuilt with ``dataclasses.replace``; the others are shared with ``flags``
    (:func:`validate` copies before it derives anything), and ``flags`` itself is unchanged.

    A script derives its configs this way from one parse (a finetuning run's length, a weights
    only load) instead of parsing its argv again with flag strings appended.
    """
    derived = copy.copy(flags)
    for name, changes in sections.items():
        setattr(derived, name, dataclasses.replace(getattr(flags, name), **changes))
    return derived


def parse_args(argv: Sequence[str] | None = None,
               extra_args_provider: ExtraArgsProvider | None = None,
               world_size: int | None = None, validate_config: bool = True,
               require_model: bool = True, prog: str | None = None,
               tool_sections: Sequence[ToolSection] = ()) -> MegatronConfig:
    """Parse Megatron-LM flags into a validated, read-only :class:`MegatronConfig`.

    Args:
        argv: arguments (``sys.argv[1:]`` when None).
        extra_args_provider: adds a script's own flags to the parser; they land in ``cfg.extra``.
        world_size: ranks the run will have; defaults to ``$WORLD_SIZE`` (torchrun) or 1.
        validate_config: run :func:`validate` (exits with a clear message on a bad combination);
            without it the flags come back as given, writable.
        require_model: the script builds a model, so the architecture flags are required.
        tool_sections: the script's own typed flag sections (read with ``cfg.section(cls)``).

    Raises:
        SystemExit: unknown flags, bad values or an impossible combination (exit code 2).
    """
    parser = build_parser(extra_args_provider, prog=prog, tool_sections=tool_sections)
    cfg = parse_flags(parser, argv, tool_sections)
    if validate_config:
        cfg = validate_or_exit(cfg, world_size, require_model, parser=parser)
    return cfg


def validate_or_exit(cfg: MegatronConfig, world_size: int | None = None,
                     require_model: bool = True, require_train_length: bool = False,
                     parser: argparse.ArgumentParser | None = None,
                     require_data: bool = False, tool_checks=None) -> MegatronConfig:
    """:func:`validate`, turning a ``ValueError`` into argparse's usage + error + exit 2 (a
    tool check's error into the tools' one line, ``SystemExit("<prog>: error: ...")``).

    Returns:
        The validated, read-only config (``cfg`` itself is left as given).
    """
    from megatron.config.validate import ToolChecks, ToolFlagError, validate

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    parser = parser or build_parser()
    try:
        return validate(cfg, world_size, require_model=require_model,
                        require_train_length=require_train_length, require_data=require_data,
                        tool_checks=tool_checks or ToolChecks())
    except ToolFlagError as err:
        raise SystemExit(f"{parser.prog}: error: {err}") from None
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
