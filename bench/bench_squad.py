"""SQuAD finetuning throughput (examples/s) of ``tasks/main.py --task SQUAD`` against HF
transformers' ``BertForQuestionAnswering`` of the same shape, in the same run.

    PYTHONPATH=. .venv/bin/python bench/bench_squad.py [--quick] [--precisions fp32,bf16]
        [--micro-batch 4] [--tp 1] [--rounds 3] [--no-hf] [--force-bf16] [--untuned-baseline-malloc]

Shape: BERT-base (12 layers, hidden 768, 12 heads, FFN 3072), vocabulary 30592
(bert-base-uncased + [BOS]/[EOS], padded to 128), seq 384 (the recipe's max_seq_length),
dropout 0, AdamW, grad clip 1.0, one micro-batch per step. Every sequence is full (no
padding): the synthetic SQuAD file written here has 375-token contexts, so that each question
gives exactly one feature of 384 tokens on both sides.

* ``hf``: ``BertForQuestionAnswering`` (SDPA attention), start/end positions as labels (its loss
  is the same mean of the two cross entropies), fused AdamW (bench/plain_gpt.py); bf16 =
  ``torch.autocast`` over fp32 parameters; one process, 2 threads, glibc's allocator tuned as
  our entry points tune it on CPU (``--untuned-baseline-malloc`` leaves it alone).
* ``ours``: ``tasks/main.py --task SQUAD --squad-version 1.1 --epochs 1`` on that file (random
  weights: no ``--pretrained-checkpoint``, which changes nothing of the step), one process with
  ``OMP_NUM_THREADS=2`` (TP=1), or torchrun with TP=2 at one thread per rank; bf16 = ``--bf16``.
  The figure is the median of the logged "elapsed time per iteration" after the warm-up steps.

``--rounds`` (3) rounds alternate HF's steps and a run of ours, so that a change in the machine's
load (20-25% between runs here) touches both alike; the table gives the medians over the rounds
and the median of the per-round ratios.

bf16: on a CPU without native bf16 GEMMs (AVX2 only: no AVX-512 bf16 / AMX) torch emulates
them, ~100x slower than fp32; such a figure says nothing about the models, so bf16 is skipped
there unless ``--force-bf16``. Run it on an idle machine (``uptime`` first; the load average is
printed at start and end).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_bert  # noqa: E402
import bench_train  # noqa: E402
import launch  # noqa: E402
import plain_gpt  # noqa: E402

ROOT = bench_bert.ROOT
SEQ = 384
QUESTION = "which colour is named here ?"  # 6 WordPiece tokens
_FILLER = ["the", "cat", "walked", "to", "river", "and", "then", "looked", "at", "small",
           "boat", "near", "hill", "friend", "bought", "house", "garden", "old", "man", "found"]


def write_full_length_squad(path: str, questions: int, seed: int = 0) -> None:
    """SQuAD 1.1 JSON whose every question is one full 384-token feature: [CLS] + 6 question
    tokens + [SEP] + 373 single-piece words + "Red" "," + [SEP]."""
    rng = random.Random(seed)
    articles = []
    for i in range(questions):
        words = [rng.choice(_FILLER) for _ in range(SEQ - 6 - 3 - 2)]
        words.insert(rng.randrange(len(words) + 1), "Red,")
        context = " ".join(words)
        qa = {"id": f"q{i}", "question": QUESTION,
              "answers": [{"text": "Red", "answer_start": context.index("Red,")}]}
        articles.append({"title": str(i), "paragraphs": [{"context": context, "qas": [qa]}]})
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"version": "1.1", "data": articles}, f)


def hf_model():
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(
        vocab_size=bench_bert.VOCAB, hidden_size=bench_bert.HIDDEN,
        num_hidden_layers=bench_bert.LAYERS, num_attention_heads=bench_bert.HEADS,
        intermediate_size=4 * bench_bert.HIDDEN, max_position_embeddings=512,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return transformers.BertForQuestionAnswering(config)


def hf_stepper(mb: int, bf16: bool):
    """One training step of HF's BertForQuestionAnswering per call (model and AdamW built once,
    so that later rounds reuse them)."""
    torch.manual_seed(0)
    model = hf_model()
    model.train()
    opt = plain_gpt.configure_adamw(model)
    gen = torch.Generator().manual_seed(0)

    def step():
        ids = torch.randint(1000, bench_bert.VOCAB - 100, (mb, SEQ), generator=gen)
        types = torch.zeros_like(ids)
        types[:, 8:] = 1
        start = torch.randint(8, SEQ - 1, (mb,), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, token_type_ids=types, attention_mask=torch.ones_like(ids),
                         start_positions=start, end_positions=start + 1).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


def ours_command(data: str, mb: int, bf16: bool, tp: int, extra: list[str]) -> list[str]:
    args = ["tasks/main.py", "--task", "SQUAD", "--squad-version", "1.1", "--train-data", data,
            "--epochs", "1", "--num-layers", str(bench_bert.LAYERS),
            "--hidden-size", str(bench_bert.HIDDEN),
            "--num-attention-heads", str(bench_bert.HEADS), "--seq-length", str(SEQ),
            "--max-position-embeddings", "512", "--micro-batch-size", str(mb),
            "--global-batch-size", str(mb), "--lr", "1e-4", "--log-interval", "1",
            "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", bench_bert.VOCAB_FILE,
            "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
            "--distributed-backend", "gloo", "--tensor-model-parallel-size", str(tp),
            "--make-vocab-size-divisible-by", str(128 // tp), "--clip-grad", "1.0",
            "--num-workers", "0"]
    if bf16:
        args.append("--bf16")
    return launch.entry_point_command([*args, *extra], tp)


def bench_ours(data: str, mb: int, bf16: bool, tp: int, warmup: int, steps: int,
               extra: list[str]) -> float:
    """Median seconds per iteration of tasks/main.py --task SQUAD after ``warmup`` iterations
    (the data file holds exactly ``(warmup + steps) x mb`` questions: one epoch)."""
    cmd = ours_command(data, mb, bf16, tp, extra)
    return launch.median_iteration_seconds(cmd, ROOT, tp, warmup, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--tp", default="1", help="TP sizes of our runs")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of HF and ours (medians over them)")
    parser.add_argument("--quick", action="store_true",
                        help="1 warm-up and 1 timed step of micro-batch 1, fp32 only unless "
                             "--precisions is given (a smoke run, not a measurement)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' BERT")
    parser.add_argument("--ours-args", default="", help="extra flags for tasks/main.py")
    parser.add_argument("--force-bf16", action="store_true",
                        help="run bf16 even where this CPU has no native bf16 GEMMs")
    parser.add_argument("--untuned-baseline-malloc", action="store_true",
                        help="leave HF's host allocator at glibc's defaults")
    args = parser.parse_args()
    if not args.untuned_baseline_malloc:
        from megatron.core.device import tune_host_allocator
        print(f"# HF's host allocator tuned as ours: {tune_host_allocator()}", flush=True)
    torch.set_num_threads(2)
    precisions = args.precisions.split(",")
    mb, warmup, steps = args.micro_batch, args.warmup, args.steps
    if args.quick:
        mb, warmup, steps, args.rounds = 1, 1, 1, 1
        if args.precisions == "fp32,bf16":
            precisions = ["fp32"]
    tps = [int(t) for t in args.tp.split(",")]
    print(f"# load at start (1/5/15 min): {bench_train.load()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    peak = {"fp32": bench_train.gemm_peak(torch.float32),
            "bf16": bench_train.gemm_peak(torch.bfloat16)}
    print(f"# torch.mm peak, 2 threads: fp32 {peak['fp32']:.0f} GFLOP/s, "
          f"bf16 {peak['bf16']:.0f} GFLOP/s", flush=True)
    if "bf16" in precisions and peak["bf16"] < 1.2 * peak["fp32"] and not args.force_bf16:
        print("# bf16 skipped: this CPU has no native bf16 GEMMs (bf16 peak below 1.2x fp32): "
              "torch emulates them, so a bf16 figure would not compare the models; "
              "--force-bf16 runs it anyway", flush=True)
        precisions = [p for p in precisions if p != "bf16"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "train-full-length.json")
        write_full_length_squad(data, (warmup + steps) * mb)
        for prec in precisions:
            bf16 = prec == "bf16"
            hf_step = None if args.no_hf else hf_stepper(mb, bf16)
            for tp in tps:
                rows.append(_alternate(hf_step, data, mb, bf16, tp, warmup, steps, args))
                print(_fmt(rows[-1]), flush=True)
            del hf_step
            gc.collect()
    print(f"# load at end: {bench_train.load()}")
    print("\n| seq | mb | precision | TP | ours examples/s | HF examples/s | ours/HF |\n"
          "|---|---|---|---|---|---|---|")
    for row in rows:
        print(_fmt(row))


def _alternate(hf_step, data: str, mb: int, bf16: bool, tp: int, warmup: int, steps: int,
               args) -> tuple:
    """``--rounds`` rounds of HF's steps (in this process) then ours (a fresh run of
    tasks/main.py), back to back, so that a change in the machine's load touches both alike:
    the examples/s are medians over the rounds and the ratio is the median per-round ratio."""
    ours, hf, ratios = [], [], []
    for i in range(args.rounds):
        if hf_step is not None:  # HF warms up in the first round only: its model is reused
            hf.append(mb / bench_train._timed(hf_step, warmup if i == 0 else 0, steps))
        ours.append(mb / bench_ours(data, mb, bf16, tp, warmup, steps, args.ours_args.split()))
        if hf_step is not None:
            ratios.append(ours[-1] / hf[-1])
            print(f"# round {i + 1}: ours {ours[-1]:.3f}, HF {hf[-1]:.3f} examples/s "
                  f"({ratios[-1]:.3f}x)", flush=True)
    median = statistics.median
    return (SEQ, mb, "bf16" if bf16 else "fp32", tp, median(ours),
            median(hf) if hf else None, median(ratios) if ratios else None)


def _fmt(row) -> str:
    seq, mb, prec, tp, ours, hf, ratio = row
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (f"| {seq} | {mb} | {prec} | {tp} | {ours:.3f} | {f(hf, '.3f')} | "
            f"{f(ratio, '.2f')}x |")


if __name__ == "__main__":
    main()
