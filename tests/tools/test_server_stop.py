"""tools/run_text_generation_server.py at TP 2 stopped as a user stops it: torchrun passes a
SIGTERM to every rank, Ctrl-C sends SIGINT to the whole process group. Every rank exits 0, the
leader says so on one line, and no rank prints a traceback (before: the followers died of the
signal and the leader's shutdown broadcast failed, ``Connection closed by peer``, rc 1).

The two ranks are started here with torchrun's environment variables and signalled as torchrun
signals them (torchrun itself re-raises the signal it got and exits nonzero, whatever its
workers do)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from bench.launch import free_port
from tests.tools.test_run_text_generation_server import MODEL, ROOT, SERVER


def _start(port: int, master_port: int) -> list[subprocess.Popen]:
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master_port)}
        procs.append(subprocess.Popen(
            [sys.executable, str(SERVER), *MODEL, "--tensor-model-parallel-size", "2",
             "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_every_rank_stops_cleanly_on_the_signal(sig):
    port = free_port()
    procs = _start(port, free_port())
    try:
        deadline = time.monotonic() + 180
        while True:
            assert all(p.poll() is None for p in procs), [p.stdout.read() for p in procs]
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.3)
        answer = requests.put(f"http://127.0.0.1:{port}/api", timeout=60, json={
            "prompts": ["1 2 3"], "tokens_to_generate": 3, "top_k": 1})
        assert answer.status_code == 200, answer.text
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)
        outs = [proc.communicate(timeout=120)[0] for proc in procs]
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, (rank, out)
        assert "Traceback" not in out and "Connection closed" not in out, (rank, out)
    name = signal.Signals(sig).name
    assert outs[0].count(f"server stopped ({name}): every rank exits") == 1, outs[0]
