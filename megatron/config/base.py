"""Turn ``@dataclass`` config sections into argparse groups.

A field ``micro_batch_size: int | None = None`` followed by a docstring becomes the flag
``--micro-batch-size`` whose help is that docstring. Booleans that default to False are
``store_true`` flags; booleans that default to True are ``--no-...`` switches (``store_false``).
Megatron-LM's irregular spellings (``--DDP-impl``, ``--no-position-embedding``...) are given per field
with :func:`spec` (``flag=``), and renamed legacy flags with ``aliases=``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any


def spec(default: Any = None, *, flag: str | None = None, aliases: tuple[str, ...] = (),
         choices: tuple | None = None, nargs: str | None = None, metavar: str | None = None,
         argtype: Any = None, default_factory: Any = None, repeat: bool = False) -> Any:
    """A dataclass field with CLI details that the name and type cannot express
    (``repeat``: a list flag given once per value, ``--prompt a --prompt b``)."""
    meta = {"flag": flag, "aliases": aliases, "choices": choices, "nargs": nargs,
            "metavar": metavar, "argtype": argtype, "repeat": repeat}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass."""
    docs: dict[str, str] = {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _scalar_type(hint: Any) -> Any:
    """The element type argparse should convert to: int from ``int | None``, str from ``list[str]``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _scalar_type(args[0])
    if origin in (list, tuple):
        return _scalar_type(typing.get_args(hint)[0])
    if origin is typing.Literal:
        return type(typing.get_args(hint)[0])
    return hint


def _is_list(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_list(a) for a in typing.get_args(hint))
    return origin in (list, tuple)


def flag_name(f: dataclasses.Field) -> str:
    """The main command-line spelling of field ``f``."""
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    if f.default is True:
        return "--no-" + f.name.replace("_", "-")
    return "--" + f.name.replace("_", "-")


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """Fields that are flags (derived ``init=False`` fields are not)."""
    return [f for f in dataclasses.fields(cls) if f.init]


def add_section(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Add one argparse group for the dataclass ``cls``; dests are ``section.field``."""
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip().split("\n")[0])
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in cli_fields(cls):
        meta = f.metadata
        names = [flag_name(f), *meta.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                                  "help": docs.get(f.name, "")}
        hint = hints[f.name]
        if meta.get("argtype") is None and (hint is bool or hint == bool | None):
            kwargs["action"] = "store_false" if default is True else "store_true"
        else:
            kwargs["type"] = meta.get("argtype") or _scalar_type(hint)
            if meta.get("choices") is not None:
                kwargs["choices"] = meta["choices"]
            elif typing.get_origin(_strip_none(hint)) is typing.Literal:
                kwargs["choices"] = typing.get_args(_strip_none(hint))
            if meta.get("repeat"):
                kwargs["action"] = "append"
            elif meta.get("nargs"):
                kwargs["nargs"] = meta["nargs"]
            elif _is_list(hint) and meta.get("argtype") is None:
                # An argtype parses the whole value itself (--moe-layer-freq's list string).
                kwargs["nargs"] = "+"
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
            elif "choices" not in kwargs:
                kwargs["metavar"] = {int: "N", float: "X"}.get(kwargs["type"], "STR")
            if default not in (None, [], ()):
                kwargs["help"] += f" (default: {default})"
        group.add_argument(*names, **kwargs)


def _strip_none(hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def build_section(cls: type, namespace: argparse.Namespace) -> Any:
    """Instantiate ``cls`` from the parsed values it owns (others keep their defaults)."""
    values = {f.name: getattr(namespace, f.name) for f in cli_fields(cls)
              if hasattr(namespace, f.name)}
    return cls(**values)


# --- read-only configs ------------------------------------------------------------------------
# validate() returns the final config; nothing may change it afterwards (values derived later
# would reach some readers and not others). The section classes stay ordinary dataclasses (the
# lower layers own several of them), so a validated config's objects are re-classed to
# read-only subclasses instead.
_READ_ONLY_CLASSES: dict[type, type] = {}


def _refuse_write(self, name: str, value: Any) -> None:
    if self.__dict__.get("_read_only"):
        raise dataclasses.FrozenInstanceError(
            f"cannot set {type(self).__name__}.{name}: a validated config is read-only; derive "
            "values in megatron.config.validate (or build a new config)")
    object.__setattr__(self, name, value)


def _rebuild_read_only(cls: type, state: dict) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return make_read_only(obj)


def _reduce_read_only(self, protocol: int):
    # Pickle and deepcopy by the ordinary class: the read-only subclasses are made at run time.
    state = {k: v for k, v in self.__dict__.items() if k != "_read_only"}
    return _rebuild_read_only, (type(self).__mro__[1], state)


def _equal_fields(self, other) -> bool:
    # A dataclass's own __eq__ wants the very same class; a read-only copy equals a plain one.
    base = type(self).__mro__[1]
    if not isinstance(other, base):
        return NotImplemented
    return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(base))


def _read_only_class(cls: type) -> type:
    if cls not in _READ_ONLY_CLASSES:
        _READ_ONLY_CLASSES[cls] = type(cls.__name__, (cls,), {
            "__setattr__": _refuse_write, "__delattr__": _refuse_write, "__eq__": _equal_fields,
            "__reduce_ex__": _reduce_read_only, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return _READ_ONLY_CLASSES[cls]


def make_read_only(obj: Any) -> Any:
    """Make the dataclass ``obj`` and every dataclass it holds refuse attribute writes.

    Returns ``obj`` itself (its class becomes a read-only subclass, so ``isinstance`` and
    ``dataclasses.fields`` are unchanged). List values stay lists (checkpoints save them as
    Megatron-LM does).
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        for item in value.values() if isinstance(value, dict) else (value,):
            make_read_only(item)
    if type(obj) not in _READ_ONLY_CLASSES.values():
        obj.__class__ = _read_only_class(type(obj))
    object.__setattr__(obj, "_read_only", True)
    return obj
