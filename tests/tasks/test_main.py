"""tasks/main.py: the task registry, and a smoke run of the real script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import main as tasks_main
from tasks.registry import TASKS, get_task, register

ROOT = Path(__file__).resolve().parents[2]


def test_zero_shot_tasks_are_registered_and_load():
    assert {"WIKITEXT103", "LAMBADA"} <= set(TASKS)
    assert get_task("LAMBADA").load().__name__ == "run_lambada"
    with pytest.raises(ValueError, match="task WIKITEXT103 is registered twice"):
        register("WIKITEXT103", "x:y", "")


@pytest.mark.parametrize("argv,message", [
    ([], "tasks/main.py: error: --task is required"),
    (["--task", "NOPE"], "tasks/main.py: error: --task NOPE is not a task this framework has: "
                         "choose one of " + ", ".join(sorted(TASKS))),
    (["--task", "WIKITEXT103"], "tasks/main.py: error: --task WIKITEXT103 needs --valid-data"),
    (["--task", "LAMBADA", "--valid-data", "/nonexistent/lambada.jsonl"],
     "tasks/main.py: error: --valid-data /nonexistent/lambada.jsonl: no such file"),
    (["--task", "WIKITEXT103", "--valid-data", "{data}", "--load", "{tmp}"],
     "tasks/main.py: error: --load {tmp} holds no checkpoint"),
    (["--task", "WIKITEXT103", "--valid-data", "{data}", "--pretrained-checkpoint", "{tmp}/x"],
     "tasks/main.py: error: --pretrained-checkpoint {tmp}/x: no such directory"),
    (["--task", "WIKITEXT103", "--valid-data", "{data}", "--load", "{tmp}",
      "--pretrained-checkpoint", "{tmp}/x"], "tasks/main.py: error: --load {tmp} and "
                                             "--pretrained-checkpoint {tmp}/x name different"),
])
def test_refused_before_any_process_group(tmp_path, monkeypatch, argv, message):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("started"))
    data = tmp_path / "wiki.tokens"
    data.write_text(" a b c \n")
    argv = [a.format(data=data, tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exc:
        tasks_main.run(argv)
    assert str(exc.value).startswith(message.format(tmp=tmp_path)), str(exc.value)


def test_cli_smoke_wikitext(tmp_path, shared_data):
    data = tmp_path / "wiki.test.tokens"
    text = " \n = A = \n \n The cat 's toy cost $ 1 @,@ 000 ( roughly ) . \n" * 3
    data.write_text(text)
    tokenizers = shared_data / "tokenizers"
    cmd = [sys.executable, "tasks/main.py", "--task", "WIKITEXT103", "--valid-data", str(data),
           "--random-weights", "--num-layers", "1", "--hidden-size", "16",
           "--num-attention-heads", "2", "--seq-length", "16", "--max-position-embeddings", "16",
           "--micro-batch-size", "2", "--overlapping-eval", "4", "--tokenizer-type",
           "GPT2BPETokenizer", "--vocab-file", str(tokenizers / "gpt2-vocab.json"),
           "--merge-file", str(tokenizers / "gpt2-merges.txt"), "--distributed-backend", "gloo"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    words = len(text.strip().split(" "))  # Megatron's count: 58
    assert f" > number of original tokens: {words}, number of detokenized tokens: " in out
    assert " validation results on WIKITEXT103 | avg loss: " in out
    assert "| adjusted ppl: " in out and "| token ratio: " in out
