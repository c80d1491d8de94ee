"""--async-save: a process killed (SIGKILL) during the background write of iteration 2 leaves
iteration 1 the tracked, loadable checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from bench.launch import free_port
from megatron.checkpointing.dist import storage
from megatron.checkpointing.names import parse_tracker, tracker_path

ROOT = Path(__file__).resolve().parents[3]


def test_kill_during_an_async_write_keeps_the_previous_checkpoint(tmp_path):
    save = tmp_path / "save"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    victim = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("async_save_victim.py")), str(save),
         str(free_port())], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = victim.stdout.readline()
        assert line.strip() == "STALLED", line
        assert (save / "iter_0000002" / "__0_0.distcp").is_file()  # mid-save: shard written
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
    finally:
        if victim.poll() is None:
            victim.kill()
    assert parse_tracker(tracker_path(save)) == (1, False)
    first = storage.read_plain_tensors(save / "iter_0000001")
    assert storage.read_common_state(save / "iter_0000001") == {"iteration": 1}
    assert first["embedding.word_embeddings.weight"].shape == (32, 16)
    assert not (save / "iter_0000002" / "metadata.json").exists()  # never finished
    assert torch.isfinite(first["decoder.layers.self_attention.linear_qkv.weight"]).all()
