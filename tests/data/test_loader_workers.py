"""Loader worker processes: they ignore SIGTERM (so --exit-signal-handler can save
when the whole process group is signalled), die with their parent, and never keep a process
that raised from exiting.

The loaders run in a subprocess: forking workers out of the pytest process (which holds the
pooled worlds' queues and threads) is what the house style forbids, and an exit is the point.
"""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WALL_S = 120  # hang detection only

_SCRIPT = r"""
import ctypes, os, signal, sys, time
import torch
from megatron.data.loader import stop_loader_workers
from megatron.data.samplers import build_pretraining_data_loader


class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, idx):
        sig = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        ignored = signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        return torch.tensor([sig.value, int(ignored), os.getpid()])


def loader():
    return build_pretraining_data_loader(Probe(), 0, None, 2, 0, 1, num_workers=2)


it = iter(loader())
rows = torch.cat([next(it) for _ in range(4)])
pids = sorted(set(rows[:, 2].tolist()))
print("deathsig", sorted(set(rows[:, 0].tolist())), "sigterm-ignored",
      sorted(set(rows[:, 1].tolist())), "workers", len(pids), flush=True)
stop_loader_workers()
time.sleep(0.5)  # torch's SIGCHLD handler would raise here for workers not yet reaped
print("left after stop", [p for p in pids if os.path.exists(f"/proc/{p}")], flush=True)
from tasks.finetune_loaders import make_loader
rows = torch.cat(list(make_loader(Probe(), [[0, 1], [2, 3]], None, num_workers=2)))
print("finetuning deathsig", sorted(set(rows[:, 0].tolist())), "sigterm-ignored",
      sorted(set(rows[:, 1].tolist())), flush=True)
it2 = iter(loader())
next(it2)
raise RuntimeError("boom with live loader workers")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc")
def test_loader_workers_and_an_uncaught_error():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True,
                          text=True, timeout=WALL_S, env={"OMP_NUM_THREADS": "1",
                                                         "PATH": "/usr/bin:/bin",
                                                         "PYTHONPATH": str(REPO)})
    out = proc.stdout
    assert f"deathsig [{int(signal.SIGKILL)}] sigterm-ignored [1] workers 2" in out, (out,
                                                                                    proc.stderr)
    assert "left after stop []" in out, (out, proc.stderr)
    # The finetuning loaders' workers too (they died of the scheduler's SIGTERM).
    assert f"finetuning deathsig [{int(signal.SIGKILL)}] sigterm-ignored [1]" in out, \
        (out, proc.stderr)
    # The interpreter's exit used to SIGTERM the (SIGTERM-ignoring) workers and wait forever.
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "RuntimeError: boom with live loader workers" in proc.stderr


_FORKSERVER_SCRIPT = r"""
import multiprocessing, torch
from megatron.data.samplers import build_pretraining_data_loader

# Python 3.14's default on Linux: a worker's parent is then the forkserver, not this process.
multiprocessing.set_start_method("forkserver")
data = torch.utils.data.TensorDataset(torch.arange(16))
loader = build_pretraining_data_loader(data, 0, None, 2, 0, 1, num_workers=2)
print("batches", len([batch for batch in loader]), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver start method")
def test_loader_workers_start_under_forkserver():
    proc = subprocess.run([sys.executable, "-c", _FORKSERVER_SCRIPT], cwd=REPO,
                          capture_output=True, text=True, timeout=WALL_S,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "batches 8" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("broken", [ConnectionResetError(104, "Connection reset by peer"),
                                    EOFError()])
def test_a_broken_hand_over_from_a_dead_worker_is_named(broken):
    """A worker killed between queueing a batch and handing over its shared memory breaks the
    socket the memory travels on: the user reads that a loader worker died, not a bare
    ConnectionResetError (seen in CI with the OOM-killer fault test)."""
    from megatron.data.loader import _NamedWorkerDeath

    def batches():
        yield 1
        raise broken

    iterator = _NamedWorkerDeath(batches())
    assert next(iterator) == 1
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) .*\) died while "
                                           r"handing over a batch") as caught:
        next(iterator)
    assert caught.value.__cause__ is broken


def _data_loaders_built(path: Path) -> list[str]:
    """``file:line`` of each DataLoader construction or subclass in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Call):
            targets = [node.func]
        elif isinstance(node, ast.ClassDef):
            targets = node.bases
        for target in targets:
            name = target.attr if isinstance(target, ast.Attribute) else \
                getattr(target, "id", None)
            if name == "DataLoader":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_data_loader_in_the_project_is_built_by_the_one_factory():
    """Regression: the finetuning loaders were plain DataLoaders, whose workers died
    of a scheduler's SIGTERM before --exit-signal-handler could save. Only
    ``megatron/data/loader.py`` may make one; everything else calls its build_data_loader."""
    sources = [p for top in ("megatron", "tasks", "tools", "examples", "bench")
               for p in (REPO / top).rglob("*.py")] + sorted(REPO.glob("*.py"))
    built = [site for path in sources if path != REPO / "megatron" / "data" / "loader.py"
             for site in _data_loaders_built(path)]
    assert built == [], f"DataLoaders made outside megatron.data.loader.build_data_loader: {built}"
