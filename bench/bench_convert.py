"""Checkpoint conversion: seconds and peak RSS of ``tools/checkpoint/convert.py`` against the
checkpoint's size.

A GPT-2-medium-shape checkpoint (24 layers, hidden 1024, 16 heads, padded vocabulary 50304,
1024 positions, fp32 random weights; ``--quick``: 6 layers, hidden 512) is written at TP1.PP1,
then converted in a fresh process each, measured from outside (wall seconds; the child's peak
resident set from ``getrusage(RUSAGE_CHILDREN)``), which also counts the pages of the source
files the loader maps:

* TP1 -> TP2.PP2 (``--saver megatron``);
* the same with ``--keep-optimizer-state``, from a copy of the checkpoint that holds an fp32
  Adam state (random moments: 3x the weights; the row's size column is that checkpoint's);
* TP1 -> HuggingFace ``GPT2LMHeadModel`` (``--saver hf``);
* a bare ``import`` of the tool's modules (the interpreter + torch baseline).

Run: ``PYTHONPATH=. .venv/bin/python bench/bench_convert.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron.checkpointing import (checkpoint_dir, checkpoint_name,  # noqa: E402
                                    nest_model_state, publish_tracker, save_file)

SHAPES = {"medium": dict(layers=24, hidden=1024, heads=16),
          "quick": dict(layers=6, hidden=512, heads=8)}
VOCAB, POSITIONS = 50304, 1024


def _layer(i: int, hidden: int) -> dict[str, torch.Tensor]:
    p = f"language_model.encoder.layers.{i}."
    shapes = {"input_layernorm.weight": (hidden,), "input_layernorm.bias": (hidden,),
              "self_attention.query_key_value.weight": (3 * hidden, hidden),
              "self_attention.query_key_value.bias": (3 * hidden,),
              "self_attention.dense.weight": (hidden, hidden),
              "self_attention.dense.bias": (hidden,),
              "post_attention_layernorm.weight": (hidden,),
              "post_attention_layernorm.bias": (hidden,),
              "mlp.dense_h_to_4h.weight": (4 * hidden, hidden),
              "mlp.dense_h_to_4h.bias": (4 * hidden,),
              "mlp.dense_4h_to_h.weight": (hidden, 4 * hidden),
              "mlp.dense_4h_to_h.bias": (hidden,)}
    return {p + k: torch.randn(s) * 0.02 for k, s in shapes.items()}


def _adam_state(flat: dict[str, torch.Tensor]) -> dict:
    """A plain fp32 optimizer's state dict (Megatron's FP32Optimizer = torch AdamW's) over the
    model's parameters, in Megatron's order and weight-decay groups, random moments."""
    from tools.checkpoint.optimizer_state import param_groups

    groups, state, index = [], {}, 0
    for kind, members in param_groups([flat]):
        ids = []
        for _, key in members:
            state[index] = {"step": torch.tensor(100.0),
                            "exp_avg": torch.randn_like(flat[key]) * 1e-3,
                            "exp_avg_sq": torch.rand_like(flat[key]) * 1e-6}
            ids.append(index)
            index += 1
        groups.append({"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay":
                       0.01 if kind == "decay" else 0.0, "wd_mult": 1.0 if kind == "decay"
                       else 0.0, "lr_mult": 1.0, "params": ids})
    return {"state": state, "param_groups": groups}


def write_source(root: Path, layers: int, hidden: int, heads: int,
                 optimizer: bool = False) -> int:
    """A TP1.PP1 GPT checkpoint of random weights (and an Adam state); returns its file's size
    in bytes."""
    flat = {"language_model.embedding.word_embeddings.weight": torch.randn(VOCAB, hidden) * 0.02,
            "language_model.embedding.position_embeddings.weight":
                torch.randn(POSITIONS, hidden) * 0.02}
    for i in range(layers):
        flat.update(_layer(i, hidden))
    flat["language_model.encoder.final_layernorm.weight"] = torch.ones(hidden)
    flat["language_model.encoder.final_layernorm.bias"] = torch.zeros(hidden)
    args = argparse.Namespace(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=4 * hidden, kv_channels=hidden // heads,
        max_position_embeddings=POSITIONS, padded_vocab_size=VOCAB,
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, untie_embeddings_and_output_weights=False,
        tokenizer_type="GPT2BPETokenizer", vocab_file=None, merge_file=None,
        bias_gelu_fusion=True, add_bias_linear=True, layernorm_epsilon=1e-5, iteration=100)
    path = checkpoint_name(root, 100)
    sd = {"args": args, "checkpoint_version": 3.0, "iteration": 100,
          "model": nest_model_state(flat)}
    if optimizer:
        sd["optimizer"] = _adam_state(flat)
    save_file(sd, path)
    publish_tracker(root, 100, checkpoint_dir(root, 100))
    return path.stat().st_size


def measure(argv: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one child process (each child is the only one measured:
    the grandchild trick makes RUSAGE_CHILDREN hold just that process's maximum)."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "rc = subprocess.call(sys.argv[1:]); "
             "print(time.perf_counter() - t, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, rc)")
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    seconds, rss, rc = out.stdout.split()[-3:]
    if rc != "0":
        raise RuntimeError(f"{argv} exited {rc}: {out.stderr[-2000:]}")
    return float(seconds), int(rss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="6 layers, hidden 512")
    opts = parser.parse_args()
    shape = SHAPES["quick" if opts.quick else "medium"]
    convert = [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"),
               "--model-type", "GPT"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        size = write_source(tmp / "src", **shape)
        print(f"shape {shape}, vocab {VOCAB}: checkpoint {size / 2**20:.0f} MiB "
              f"(written in {time.perf_counter() - start:.1f} s)")
        rows = [("import only (baseline)", [sys.executable, "-c",
                                            "import torch, tools.checkpoint.convert"]),
                ("TP1 -> TP2.PP2", [*convert, "--load-dir", str(tmp / "src"), "--save-dir",
                                    str(tmp / "tp2pp2"), "--target-tensor-parallel-size", "2",
                                    "--target-pipeline-parallel-size", "2"]),
                ("TP1 -> HF GPT2LMHeadModel", [*convert, "--load-dir", str(tmp / "src"),
                                               "--save-dir", str(tmp / "hf"), "--saver", "hf"])]
        print("| conversion | seconds | peak RSS | peak RSS / checkpoint |")
        print("|---|---|---|---|")
        for name, argv in rows:
            seconds, rss = measure(argv)
            print(f"| {name} | {seconds:.1f} | {rss / 2**20:.0f} MiB | {rss / size:.2f} |")
        with_state = write_source(tmp / "src_optim", **shape, optimizer=True)
        seconds, rss = measure([*convert, "--load-dir", str(tmp / "src_optim"), "--save-dir",
                                str(tmp / "tp2pp2_optim"), "--target-tensor-parallel-size", "2",
                                "--target-pipeline-parallel-size", "2",
                                "--keep-optimizer-state"])
        print(f"| TP1 -> TP2.PP2 --keep-optimizer-state ({with_state / 2**20:.0f} MiB with the "
              f"state) | {seconds:.1f} | {rss / 2**20:.0f} MiB | {rss / with_state:.2f} |")


if __name__ == "__main__":
    main()
