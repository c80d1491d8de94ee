"""Process groups are named for what they are, given explicitly, and used only through comm.

Source-level checks (no process group), over the library and its entry points:

* a parameter holding a process group says which one: ``tp_group``, ``pp_group``, ``dp_group``,
  ``mp_group`` (TP x PP), ``cp_group`` (context parallelism), ``embedding_group``,
  ``position_embedding_group``, ``ep_group`` (expert parallelism), ``tp_dp_group`` /
  ``dp_cp_group`` (an MoE router's balancing statistics: TP x DP, DP x CP), ``count_group`` (the group a router's token counts are summed
  over), ``ckpt_group`` (the ranks writing one checkpoint), ``expert_dp_group`` / ``expert_mp_group``
  / ``etp_group`` (expert tensor parallelism) / ``tp_ep_group`` (ETP x EP); plain ``group`` only
  in comm.py's generic functions; never ``data_parallel_group`` / ``model_parallel_group``;
* every call of a comm function passes its group, and never a literal ``None`` (which is this
  rank alone: a caller meaning every rank passes ``comm.world_group()``);
* no torch.distributed collective is called outside comm.py.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from megatron.core import comm

ROOT = Path(__file__).resolve().parents[2]
COMM = ROOT / "megatron" / "core" / "comm.py"
GROUP_NAMES = {"tp_group", "pp_group", "dp_group", "mp_group", "cp_group", "embedding_group",
               "position_embedding_group", "ep_group", "tp_dp_group", "dp_cp_group", "count_group", "ckpt_group",
               "expert_dp_group", "expert_mp_group", "etp_group", "tp_ep_group"}
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "broadcast", "broadcast_object_list", "barrier",
               "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
               "all_to_all", "all_to_all_single"}


def _sources(*tops: str) -> list[Path]:
    files: list[Path] = []
    for top in tops:
        path = ROOT / top
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [f for f in files if f.exists()]


def _parameters(tree: ast.AST):
    """``(function name, line, parameter name)`` for every function and lambda."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
                if arg is not None:
                    yield getattr(node, "name", "<lambda>"), node.lineno, arg.arg


def _bad_group_names(path: Path, source: str) -> list[str]:
    bad = []
    for function, line, name in _parameters(ast.parse(source)):
        allowed = name in GROUP_NAMES or (name == "group" and path == COMM)
        if (name == "group" or name.endswith("_group")) and not allowed:
            bad.append(f"{path.relative_to(ROOT)}:{line} {function}({name})")
    return bad


def test_group_parameters_say_which_group():
    bad = [b for path in _sources("megatron") for b in _bad_group_names(path, path.read_text())]
    assert bad == [], "name the group (tp_group, dp_group, mp_group, ...):\n" + "\n".join(bad)


def _group_index(name: str) -> int | None:
    fn = getattr(comm, name, None)
    if not inspect.isfunction(fn):
        return None
    names = list(inspect.signature(fn).parameters)
    return names.index("group") if "group" in names else None


def _comm_calls_without_a_group(path: Path, source: str) -> list[str]:
    """``comm.f(...)`` calls that leave ``group`` out or pass a literal None."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "comm"):
            continue
        index = _group_index(node.func.attr)
        if index is None or any(isinstance(a, ast.Starred) for a in node.args) \
                or any(k.arg is None for k in node.keywords):
            continue  # not a group-taking comm function, or arguments it cannot see
        given = [k.value for k in node.keywords if k.arg == "group"]
        if index < len(node.args):
            given.append(node.args[index])
        where = f"{path.relative_to(ROOT)}:{node.lineno} comm.{node.func.attr}"
        if not given:
            bad.append(f"{where}: no group")
        elif isinstance(given[0], ast.Constant) and given[0].value is None:
            bad.append(f"{where}: group None (this rank alone)")
    return bad


# test_comm.py passes None on purpose: it checks what None means.
NOT_CALLERS = {COMM, ROOT / "tests" / "core" / "test_comm.py"}


def test_comm_callers_name_their_group():
    bad = [b for path in _sources("megatron", "pretrain_gpt.py", "tools", "bench", "tests")
           if path not in NOT_CALLERS
           for b in _comm_calls_without_a_group(path, path.read_text())]
    assert bad == [], "pass the group, comm.world_group() for every rank:\n" + "\n".join(bad)


def _distributed_aliases(tree: ast.AST) -> set[str]:
    """Names this module binds to torch.distributed (``dist``, or ``torch`` for
    ``torch.distributed.x``)."""
    names = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname for a in node.names
                         if a.name == "torch.distributed" and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names.update(a.asname or a.name for a in node.names if a.name == "distributed")
    return names


def _direct_collectives(path: Path, source: str) -> list[str]:
    tree = ast.parse(source)
    aliases = _distributed_aliases(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in COLLECTIVES \
                and ast.unparse(node.func.value) in aliases:
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node.func)}")
    return bad


def test_collectives_only_in_comm():
    bad = [b for path in _sources("megatron", "pretrain_gpt.py", "tools", "bench")
           if path != COMM for b in _direct_collectives(path, path.read_text())]
    assert bad == [], "call megatron.core.comm instead:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, found", [
    ("def f(x, group): pass", ["f(group)"]),
    ("class A:\n def __init__(self, *, data_parallel_group): pass",
     ["__init__(data_parallel_group)"]),
    ("def f(model_parallel_group=None): pass", ["f(model_parallel_group)"]),
    ("g = lambda tensor_group: 0", ["<lambda>(tensor_group)"]),
    ("def f(tp_group, dp_group, mp_group, pp_group, embedding_group): pass", []),
])
def test_the_name_check_sees_anonymous_groups(source, found):
    path = ROOT / "megatron" / "core" / "example.py"
    assert [b.split(" ", 1)[1] for b in _bad_group_names(path, source)] == found


@pytest.mark.parametrize("source, found", [
    ("comm.barrier()", ["comm.barrier: no group"]),
    ("comm.all_reduce(t, None, op='max')", ["comm.all_reduce: group None (this rank alone)"]),
    ("comm.broadcast_object(x, 0, group=None)",
     ["comm.broadcast_object: group None (this rank alone)"]),
    ("comm.all_reduce(t, comm.world_group())\ncomm.barrier(tp_group)\ncomm.world_group()", []),
])
def test_the_caller_check_sees_missing_and_none_groups(source, found):
    path = ROOT / "megatron" / "example.py"
    assert [b.split(" ", 1)[1] for b in _comm_calls_without_a_group(path, source)] == found


@pytest.mark.parametrize("source, found", [
    ("import torch.distributed as dist\ndist.all_gather_object(out, x, group=g)",
     ["dist.all_gather_object"]),
    ("import torch\ntorch.distributed.barrier()", ["torch.distributed.barrier"]),
    ("from torch import distributed\ndistributed.broadcast(t, 0)", ["distributed.broadcast"]),
    ("import torch.distributed as dist\ndist.get_rank()\ndist.destroy_process_group()", []),
])
def test_the_collective_check_sees_direct_calls(source, found):
    path = ROOT / "megatron" / "example.py"
    assert [b.split(" ", 1)[1] for b in _direct_collectives(path, source)] == found
