"""Training throughput of a Llama-style ``pretrain_gpt.py`` model against HF ``LlamaForCausalLM``
of the same shape, CPU fp32, both in this process, alternating rounds.

    PYTHONPATH=. .venv/bin/python bench/bench_llama.py [--layers 4 --hidden 512 --heads 8
        --groups 2 --ffn 1536 --seq 512 --mb 2] [--rounds 3] [--warmup 1] [--steps 2]

* ``ours``: pretrain_gpt.py's own pieces and flags (``profile_train.ours_step``: the mock-data
  loader, ``setup_model_and_optimizer``, the trainer's ``train_step``) with RoPE, RMSNorm,
  SwiGLU, grouped-query attention, no biases, an untied output layer.
* ``hf``: transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig`` of the same shape
  (nothing downloads; SDPA attention, dropout 0), bench_train's AdamW and clip 1.0.

Vocabulary 50304 (bench_train's mock-data flags). Each round times every side back to back
(``bench_train.alternate_rounds``); the figures are medians of tokens/s over the rounds and the
median of the per-round ratios. The default shape is the largest whose rounds finish in minutes
on 2 CPU cores: a ~1B model takes minutes a step there.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402
import plain_gpt  # noqa: E402
import profile_train  # noqa: E402


def llama_flags(args: argparse.Namespace) -> list[str]:
    """The Llama-style flags pretrain_gpt.py adds to bench_train's shape flags."""
    return ["--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu",
            "--ffn-hidden-size", str(args.ffn), "--position-embedding-type", "rope",
            "--group-query-attention", "--num-query-groups", str(args.groups),
            "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


def hf_llama_step(shape: bench_train.Shape, args: argparse.Namespace) -> Callable[[], None]:
    """One training step of transformers' LlamaForCausalLM at ``shape``."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=bench_train.VOCAB, hidden_size=shape.hidden, intermediate_size=args.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=args.groups, max_position_embeddings=shape.seq, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_dropout=0.0, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).train()
    opt = plain_gpt.configure_adamw(model)

    def step():
        data = torch.randint(0, bench_train.VOCAB, (shape.mb, shape.seq), device="cpu")
        model(input_ids=data, labels=data).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def tokens_per_second(step: Callable[[], None], shape: bench_train.Shape) -> Callable[[], float]:
    def measure() -> float:
        sec = bench_train._timed(step, shape.warmup, shape.steps)
        gc.collect()
        return shape.mb * shape.seq / sec
    return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("layers", 4), ("hidden", 512), ("heads", 8), ("groups", 2),
                          ("ffn", 1536), ("seq", 512), ("mb", 2), ("rounds", 3),
                          ("warmup", 1), ("steps", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(2)
    shape = bench_train.Shape("llama", args.layers, args.hidden, args.heads, args.seq, args.mb,
                              warmup=args.warmup, steps=args.steps)
    print(f"# load before: {bench_train.load()}", flush=True)
    sides = {"hf": tokens_per_second(hf_llama_step(shape, args), shape),
             "ours": tokens_per_second(
                 profile_train.ours_step(shape, False, llama_flags(args)), shape)}
    out = bench_train.alternate_rounds(sides, args.rounds)
    ratio = bench_train.median_ratio(out["ours"], out["hf"])
    print(f"# load after: {bench_train.load()}")
    print("| shape | ours tokens/s | HF LlamaForCausalLM tokens/s | ours / HF |")
    print("|---|---|---|---|")
    print(f"| {args.layers}x{args.hidden}, {args.heads} heads / {args.groups} groups, ffn "
          f"{args.ffn}, seq {args.seq}, mb {args.mb} | {bench_train.median(out['ours']):,.0f} | "
          f"{bench_train.median(out['hf']):,.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
