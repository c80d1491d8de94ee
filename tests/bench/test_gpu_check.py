"""bench/gpu_check.py runs on a machine without a GPU as a smoke test: its stages are listed, the
data stage generates everything from text on the machine (no ../shared), a GPU-only stage is
skipped with its reason, and the table is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _check(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/gpu_check.py", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_stages_are_listed():
    proc = _check("--list")
    assert proc.returncode == 0, proc.stderr
    for stage in ("build", "data", "gpt-bf16", "gpt-compiled", "llama", "resume", "eval-cpu", "convert",
                  "generate", "server", "zeroshot", "finetune", "tp2", "pp2", "tp2-sp", "kernels",
                  "speed-gpt2"):
        assert stage in proc.stdout


def test_a_cpu_smoke_run_generates_its_data_and_skips_gpu_only_stages(tmp_path):
    proc = _check("--out", str(tmp_path), "--only", "env,data,eval-cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    by_stage = {row["stage"]: row for row in rows}
    assert by_stage["data"]["rc"] == 0 and "vocab 4096" in by_stage["data"]["figure"]
    assert by_stage["eval-cpu"]["rc"] is None and "needs a GPU" in by_stage["eval-cpu"]["figure"]
    for name in ("corpus_text_document.bin", "vocab.txt", "MNLI/train.tsv",
                 "zeroshot/lambada_test.jsonl"):
        assert (tmp_path / "data" / name).is_file(), name
    assert "| data | 0 |" in (tmp_path / "gpu_check.md").read_text()


def test_unknown_stages_are_refused_by_name():
    proc = _check("--only", "gpt-bf16,nonsense")
    assert proc.returncode == 2 and "nonsense" in proc.stderr
