"""The package's layers import downward only, and no modules import each other in a circle.

Layers, bottom up (a package may import its own modules and any lower layer):

    0  megatron.core, megatron.fused_kernels        the model-parallel library
    1  megatron.tokenizer                           text <-> ids
    2  megatron.data, megatron.checkpointing,       datasets; the checkpoint format; generation
       megatron.text_generation
    3  megatron.config                              flags -> the typed configs of the layers below
    4  megatron.training                            pretrain(), the loop, orchestration

Imports inside functions count too: a circle hidden behind a function-local import is still a
circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {
    "megatron.core": 0, "megatron.fused_kernels": 0,
    "megatron.tokenizer": 1,
    "megatron.data": 2, "megatron.checkpointing": 2, "megatron.text_generation": 2,
    "megatron.config": 3,
    "megatron.training": 4,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / "megatron").rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Megatron modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _layer(module: str) -> tuple[str, int] | None:
    for package, rank in LAYERS.items():
        if module == package or module.startswith(package + "."):
            return package, rank
    return None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_megatron_package_has_a_layer():
    unplaced = sorted(m for m in _modules() if m != "megatron" and _layer(m) is None)
    assert not unplaced, f"add these packages to LAYERS: {unplaced}"


def test_no_import_runs_upward_or_sideways():
    wrong = []
    for module, targets in _graph().items():
        here = _layer(module)
        if here is None:
            continue
        for target in sorted(targets):
            there = _layer(target)
            if there is not None and there[0] != here[0] and there[1] >= here[1]:
                wrong.append(f"{module} (layer {here[1]}) imports {target} (layer {there[1]})")
    assert not wrong, "\n".join(wrong)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def _only_reexports(path: Path) -> bool:
    """An ``__init__`` holding nothing but its docstring, imports and ``__all__``."""
    for stmt in ast.parse(path.read_text(), str(path)).body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.Assign) and [getattr(t, "id", None) for t in stmt.targets] == \
                ["__all__"]:
            continue
        return False
    return True


def _without_package_reexports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop edges from a re-export-only package ``__init__`` to its own modules: that is how a
    package presents its API, and Python resolves ``from pkg import sub`` inside ``pkg.sub``'s
    siblings without running into the circle. A package ``__init__`` with code of its own keeps
    its edges: a module importing that code back is a real circle."""
    modules = _modules()
    return {m: {t for t in targets if not (t.startswith(m + ".") and
                                           _only_reexports(modules[m]))}
            for m, targets in graph.items()}


def test_no_import_cycle():
    cycle = _find_cycle(_without_package_reexports(_graph()))
    assert cycle is None, " -> ".join(cycle)


def test_the_checker_sees_cycles_and_upward_imports():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    assert _layer("megatron.core.models.gpt") == ("megatron.core", 0)
    assert _layer("megatron.training.loop")[1] > _layer("megatron.config.cli")[1]


@pytest.mark.parametrize("package", ["megatron.core", "megatron.data", "megatron.tokenizer",
                                     "megatron.checkpointing", "megatron.text_generation"])
def test_library_layers_do_not_need_the_cli(package):
    # The concrete promise of the issue: these import without megatron.config or .training.
    offenders = sorted(f"{m} -> {t}" for m, targets in _graph().items()
                       if _layer(m) and _layer(m)[0] == package
                       for t in targets if t.startswith(("megatron.config", "megatron.training")))
    assert not offenders, offenders


def _imports_tests(path: Path) -> bool:
    """Whether ``path`` imports the tests package anywhere (function-local imports too)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(name.split(".")[0] == "tests" for name in names):
            return True
    return False


def test_nothing_outside_tests_imports_tests():
    # The library, the tools, the entry scripts and the benchmarks run where tests/ may not be
    # installed; what they share with the tests lives on their side (e.g. bench/launch.py,
    # bench/reference_gpt2.py), and tests import it from there.
    sources = [p for d in ("megatron", "tools", "bench") for p in sorted((ROOT / d).rglob("*.py"))]
    sources += sorted(ROOT.glob("*.py"))
    offenders = [str(p.relative_to(ROOT)) for p in sources if _imports_tests(p)]
    assert not offenders, offenders
