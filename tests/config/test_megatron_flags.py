"""Every Megatron-LM 23.06 flag of the groups we cover exists here, with Megatron's default.

The reference is ``../shared/MEGATRON_FLAGS.md`` (an AST extraction of Megatron-LM 23.06's
``megatron/arguments.py``); the test skips only where that file is absent.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from megatron.config import build_parser
from megatron.config.cli import _MEGATRON_DEST, SECTIONS

# The groups of Megatron-LM's arguments.py this framework covers. The others
# (autoresume, biencoder, vision, transformer engine / fp8, inference, retro) belong to models
# and tools not built here.
IN_SCOPE = ("network size", "regularization", "training", "initialization", "learning rate",
            "checkpointing", "mixed precision", "distributed", "validation", "data", "logging")

# Documented deviations from Megatron-LM 23.06's defaults: flag -> (ours, why).
DEVIATIONS: dict[str, tuple[object, str]] = {
    # nccl cannot run without CUDA: None picks NCCL with CUDA and gloo without
    # (megatron/core/device.py), so GPU runs behave exactly as Megatron-LM's.
    "--distributed-backend": (None, "auto-detected backend"),
    # Megatron-Core's default since it replaced the opt-out switch with
    # --apply-query-key-layer-scaling (off). 23.06's --no-query-key-layer-scaling is accepted
    # (hidden); the scaling only changes fp16 numerics (it forces an fp32 softmax).
    "--no-query-key-layer-scaling": (False, "query-key layer scaling off by default"),
}


@dataclasses.dataclass(frozen=True)
class MegatronFlag:
    group: str
    flag: str
    action: str  # "store_true", "store_false", a type name ("int", "float", "str", "bool") or ""
    default: object
    choices: tuple | None
    dest: str


def _literal(text: str) -> object:
    """A default or choices cell: a Python literal, or ``2 ** 32`` / ``range(0, 3)``."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        # Only the table's own cells reach here; no names but range are allowed.
        return eval(text, {"__builtins__": {}}, {"range": range})  # noqa: S307


def parse_megatron_flags(path: Path) -> list[MegatronFlag]:
    """The rows of every ``## group  (`_add_..._args`)`` table of MEGATRON_FLAGS.md."""
    flags, group = [], None
    row = re.compile(r"^\| `(--[^`]+)` \| ([^|]*) \| `([^`]*)` \| ([^|]*) \|$")
    for line in path.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^## (.+?)\s+\(`_add_\w+_args`\)", line)
        if heading:
            group = heading.group(1)
            continue
        if line.startswith("## "):
            group = None  # prose sections after the tables
            continue
        match = row.match(line.strip())
        if not match or group is None:
            continue
        flag, action, default, extra = (g.strip() for g in match.groups())
        dest_match = re.search(r"dest=(\w+)", extra)
        choices_text = extra[:dest_match.start()].strip() if dest_match else extra
        dest = dest_match.group(1) if dest_match else flag.lstrip("-").replace("-", "_")
        choices = tuple(_literal(choices_text)) if choices_text else None
        flags.append(MegatronFlag(group, flag, action, _literal(default), choices, dest))
    return flags


def _our_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for _, cls, _ in SECTIONS for f in dataclasses.fields(cls)}


def _field_default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


@pytest.fixture(scope="module")
def megatron_flags(megatron_flags_md) -> list[MegatronFlag]:
    flags = parse_megatron_flags(megatron_flags_md)
    groups = {f.group for f in flags}
    assert set(IN_SCOPE) <= groups, f"MEGATRON_FLAGS.md lacks groups {set(IN_SCOPE) - groups}"
    return flags


def test_reference_table_is_parsed(megatron_flags):
    """Guards the parser of the table itself: known rows come out as written."""
    by_flag = {f.flag: f for f in megatron_flags}
    assert len([f for f in megatron_flags if f.group in IN_SCOPE]) > 150
    assert by_flag["--split"].default == "969, 30, 1"
    assert by_flag["--initial-loss-scale"].default == 2 ** 32
    assert by_flag["--no-gradient-accumulation-fusion"].dest == "gradient_accumulation_fusion"
    assert by_flag["--no-gradient-accumulation-fusion"].default is True
    assert by_flag["--timing-log-level"].choices == (0, 1, 2)
    assert by_flag["--DDP-impl"].choices == ("local", "torch")


def test_every_in_scope_flag_exists_with_megatron_default(megatron_flags):
    parser = build_parser()
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    fields = _our_fields()
    problems = []
    for ref in megatron_flags:
        if ref.group not in IN_SCOPE:
            continue
        action = actions.get(ref.flag)
        if action is None:
            problems.append(f"{ref.flag} ({ref.group}): missing")
            continue
        field = fields.get(action.dest)
        if field is None:
            problems.append(f"{ref.flag}: dest {action.dest!r} is no config field")
            continue
        ours = _field_default(field)
        expected = DEVIATIONS[ref.flag][0] if ref.flag in DEVIATIONS else ref.default
        if ours != expected or (type(ours) is bool) != (type(expected) is bool):
            problems.append(f"{ref.flag}: default {ours!r}, Megatron-LM 23.06 {ref.default!r}")
        # Checkpoints store args under Megatron-LM's attribute names (to_namespace).
        if _MEGATRON_DEST.get(field.name, field.name) != ref.dest:
            problems.append(f"{ref.flag}: args.{_MEGATRON_DEST.get(field.name, field.name)}, "
                            f"Megatron-LM args.{ref.dest}")
        if ref.action in ("store_true", "store_false"):
            kind = type(action).__name__
            want = "_StoreTrueAction" if ref.action == "store_true" else "_StoreFalseAction"
            if kind != want:
                problems.append(f"{ref.flag}: {kind}, Megatron-LM {ref.action}")
        elif ref.action in ("int", "float") and action.type is not {"int": int,
                                                                    "float": float}[ref.action]:
            problems.append(f"{ref.flag}: type {action.type}, Megatron-LM {ref.action}")
        if ref.choices is not None and not set(ref.choices) <= set(action.choices or ()):
            problems.append(f"{ref.flag}: choices {action.choices}, Megatron-LM {ref.choices}")
    assert not problems, "\n".join(problems)


def test_deviations_are_real(megatron_flags):
    """Each documented deviation still deviates (drop it from DEVIATIONS once it does not)."""
    by_flag = {f.flag: f for f in megatron_flags}
    for flag, (ours, _) in DEVIATIONS.items():
        assert flag in by_flag and by_flag[flag].group in IN_SCOPE, flag
        assert by_flag[flag].default != ours, flag


@pytest.mark.parametrize("flag,dest", [
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
    ("--no-async-tensor-model-parallel-allreduce", "async_tensor_model_parallel_allreduce"),
])
def test_no_effect_switches_parse(flag, dest):
    """Accepted (Megatron-LM example scripts pass them) and recorded, never refused."""
    from tests.config.test_cli import parse

    assert getattr(parse().parallel, dest) is True
    ns = parse(flag).to_namespace()
    assert getattr(ns, dest) is False


def test_no_persist_layer_norm_parses():
    from tests.config.test_cli import parse

    assert parse().model.no_persist_layer_norm is False
    assert parse("--no-persist-layer-norm").to_namespace().no_persist_layer_norm is True


def test_unbuilt_retriever_flag_accepted_but_refused_when_set(capsys):
    from tests.config.test_cli import parse

    assert parse("--retriever-seq-length 256").data.retriever_seq_length == 256
    with pytest.raises(SystemExit):
        parse("--retriever-seq-length 128")
    assert "--retriever-seq-length is a Megatron-LM flag" in capsys.readouterr().err


def test_help_lists_no_effect_switches():
    text = " ".join(build_parser().format_help().split())
    for flag in ("--no-gradient-accumulation-fusion", "--no-async-tensor-model-parallel-allreduce",
                 "--no-persist-layer-norm"):
        assert flag in text
    assert "no effect here" in text
