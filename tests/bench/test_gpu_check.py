"""bench/gpu_check.py runs on a machine without a GPU as a smoke test: its stages are listed, the
data stage generates everything from text on the machine (no ../shared), a GPU-only stage is
skipped with its reason, and the table is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _check(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/gpu_check.py", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_stages_are_listed():
    proc = _check("--list")
    assert proc.returncode == 0, proc.stderr
    for stage in ("build", "data", "gpt-bf16", "gpt-compiled", "llama", "moe", "resume", "eval-cpu",
                  "convert", "generate", "server", "zeroshot", "finetune", "tp2", "pp2", "tp2-sp",
                  "cp2", "kernels", "speed-gpt2", "speed-llama", "speed-moe", "speed-bert",
                  "speed-generate"):
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


def _hf_and_ours(shape: str, tmp_path: Path) -> dict:
    """gpu_speed.py's hf and ours sides at ``shape``, one step each: their results."""
    result = tmp_path / f"{shape}.json"
    proc = subprocess.run([sys.executable, "bench/gpu_speed.py", "--shape", shape,
                           "--sides", "hf,ours", "--steps", "1", "--warmup", "1", "--json",
                           str(result)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(result.read_text())["results"]


def test_the_llama_speed_sides_train_the_same_model(tmp_path):
    """speed-llama's sides at the smoke shape: ours and transformers' LlamaForCausalLM have the
    same parameter count (the same shape), and a GPT side is refused for a Llama shape."""
    pytest.importorskip("transformers")
    sides = _hf_and_ours("llama-small", tmp_path)
    assert sides["ours"]["n_params"] == sides["hf"]["n_params"] == 13_247_104
    assert all(side["ms"] > 0 for side in sides.values())
    refused = subprocess.run([sys.executable, "bench/gpu_speed.py", "--shape", "llama-small",
                              "--sides", "plain"], cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and "not sides of --shape llama-small" in refused.stderr


def test_the_mixtral_speed_sides_train_the_same_moe_model(tmp_path):
    """speed-moe's sides at the smoke shape: ours and transformers' MixtralForCausalLM have the
    same parameter count, and the MFU counts a token's two experts on both."""
    pytest.importorskip("transformers")
    sides = _hf_and_ours("mixtral-tiny", tmp_path)
    assert sides["ours"]["n_params"] == sides["hf"]["n_params"] == 6_660_928
    # 2 of 4 experts: each layer drops 2 x 3 x 64 x 128 expert weights.
    assert sides["ours"]["active_params"] == sides["hf"]["active_params"] == \
        6_660_928 - 2 * 2 * 3 * 64 * 128
    assert all(side["ms"] > 0 for side in sides.values())


def test_unknown_stages_are_refused_by_name():
    proc = _check("--only", "gpt-bf16,nonsense")
    assert proc.returncode == 2 and "nonsense" in proc.stderr


def test_the_report_only_speed_stages_run_on_the_cpu_at_a_tiny_shape(tmp_path):
    """speed-bert and speed-generate time both sides, and show that they did the same work:
    BERT's same-function losses agree, HF's greedy tokens equal ours (fp32 on the CPU)."""
    pytest.importorskip("transformers")
    proc = _check("--out", str(tmp_path), "--only", "speed-bert,speed-generate")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {json.loads(line)["stage"]: json.loads(line)
            for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()}
    assert rows["speed-bert"]["rc"] == 0 and "ours/HF" in rows["speed-bert"]["figure"]
    bert = json.loads((tmp_path / "speed-bert.json").read_text())
    assert bert["check"]["diff"] < 1e-4
    tokens = bert["shape"]["mb"] * bert["shape"]["seq"]
    for side in ("hf", "ours"):
        res = bert["results"][side]
        assert res["ms"] > 0
        assert abs(res["tokens_per_s"] - tokens / (res["ms"] / 1000)) < 1e-6 * tokens
    generation = json.loads((tmp_path / "speed-generate.json").read_text())
    assert [row["batch"] for row in generation["results"]] == [1, 8]
    for row in generation["results"]:
        assert row["agreement"] == f"{row['batch']}/{row['batch']} rows equal"
        assert row["ours"]["tokens_per_s"] > 0 and row["hf"]["tokens_per_s"] > 0
    assert "| speed-generate | 0 |" in (tmp_path / "gpu_check.md").read_text()
