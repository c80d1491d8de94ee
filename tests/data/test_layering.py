"""megatron/data stands on its own: it imports neither the CLI config nor the training loop,
its modules import each other without a cycle (function-local imports included), and the
builder with the base dataset and config imports no dataset kind (GPT, BERT)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import megatron.data

PACKAGE = "megatron.data"
ROOT = Path(megatron.data.__file__).parent
FORBIDDEN = ("megatron.config", "megatron.training")


def _modules() -> dict[str, Path]:
    """``{dotted name: source file}`` of every Python module of the package."""
    return {(PACKAGE if p.stem == "__init__" else f"{PACKAGE}.{p.stem}"): p
            for p in sorted(ROOT.glob("*.py"))}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (``from a import b`` gives ``a.b``
    when that is a module of this package, else ``a``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in _modules())
    return found


def _graph() -> dict[str, set[str]]:
    """Import edges between the package's own modules."""
    modules = _modules()
    return {name: {m for m in _imports(path) if m in modules and m != name}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, stack + [nxt])) is not None:
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])) is not None:
            return found
    return None


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_imports_and_stays_below_config_and_training(name):
    importlib.import_module(name)
    bad = sorted(m for m in _imports(_modules()[name])
                 if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert not bad, f"{name} imports {bad}: the data layer gets its typed config from the caller"


def test_no_import_cycle_in_the_data_layer():
    cycle = _cycle(_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("name", ["builder", "blended_dataset", "megatron_dataset",
                                  "dataset_config"])
def test_builder_and_bases_know_no_dataset_kind(name):
    kinds = sorted(m for m in _imports(_modules()[f"{PACKAGE}.{name}"])
                   if m.startswith(f"{PACKAGE}.") and m.endswith("_dataset")
                   and m not in (f"{PACKAGE}.megatron_dataset", f"{PACKAGE}.blended_dataset",
                                 f"{PACKAGE}.indexed_dataset"))
    assert not kinds, f"{name} imports {kinds}: the builder takes the dataset class it builds"


def test_cycle_finder_finds_a_cycle():
    """The check above can fail: a two-module cycle (the old blended_dataset <-> gpt_dataset)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"b"}, "d": set()}
    assert _cycle(graph) == ["b", "c", "b"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
