"""Training throughput of ``pretrain_bert.py`` against HF transformers' ``BertForPreTraining``
of the same shape, in the same run.

    PYTHONPATH=. .venv/bin/python bench/bench_bert.py [--quick] [--seqs 128,512]
        [--precisions fp32,bf16] [--tp 1] [--no-hf] [--ours-args "..."]
        [--untuned-baseline-malloc] [--rounds 1]

Shape: BERT-base (12 layers, hidden 768, 12 heads, FFN 3072), vocabulary 30592 (bert-base-uncased
+ Megatron's [BOS]/[EOS], padded to 128, on both sides), seq 128 with micro-batch 8 and seq 512
with micro-batch 2 (the same 1024 tokens per step), dropout 0, AdamW, grad clip 1.0, one
micro-batch per step.

* ``hf``: ``BertForPreTraining`` (SDPA attention), masked-LM + next-sentence loss, 15% of the
  positions labelled, fused AdamW (as bench/plain_gpt.py); bf16 = ``torch.autocast`` over fp32
  parameters; one process, 2 threads, glibc's allocator tuned as ``pretrain_bert.py`` tunes it
  on CPU (``--untuned-baseline-malloc`` leaves it alone).
* ``ours``: ``pretrain_bert.py --mock-data`` (the BERT mock dataset: sentence-pair samples, 15%
  masked, padded to seq), one process with ``OMP_NUM_THREADS=2`` (TP=1), or torchrun with TP=2
  at one thread per rank; bf16 = ``--bf16``.

Both count tokens as micro-batch x seq (padding included: attention runs over it either way).
The heads differ in one way that is the point of ours: the LM head runs on the predicted
positions only (``BertModel.masked_lm_loss``), while HF's projects every position onto the
vocabulary. Warm-up steps are dropped; the figure is the median of the timed steps; with
``--rounds R`` both sides are measured R times, back to back in each round, and the table has
the medians and the median of the per-round ratios (this machine drifts 20-45% between
minutes: sides measured minutes apart can differ by more than what is compared). MFU = 6 N
tokens/s over the ``torch.mm`` peak measured here (N = parameters without position embeddings).
Run it on an idle machine (``uptime`` first; the load average is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402
import launch  # noqa: E402
import plain_gpt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 30592
VOCAB_FILE = os.path.join(ROOT, "..", "shared", "data", "tokenizers",
                          "bert-base-uncased-vocab.txt")
LAYERS, HIDDEN, HEADS = 12, 768, 12


@dataclasses.dataclass
class Shape:
    seq: int
    mb: int
    warmup: int = 3
    steps: int = 5


SHAPES = {128: Shape(128, 8), 512: Shape(512, 2)}


def hf_model():
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=4 * HIDDEN, max_position_embeddings=512,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return transformers.BertForPreTraining(config)


def non_embedding_params(model) -> int:
    """Parameters without the position embeddings (the MFU count, as bench_train.py)."""
    pos = model.bert.embeddings.position_embeddings.weight.numel()
    return sum(p.numel() for p in model.parameters()) - pos


def hf_step(shape: Shape, bf16: bool):
    """One training step of HF's BertForPreTraining on fresh random sentence pairs."""
    torch.manual_seed(0)
    model = hf_model()
    model.train()
    opt = plain_gpt.configure_adamw(model)
    gen = torch.Generator().manual_seed(0)

    def step():
        ids = torch.randint(1000, VOCAB - 100, (shape.mb, shape.seq), generator=gen)
        types = torch.zeros_like(ids)
        types[:, shape.seq // 2:] = 1
        labels = torch.full_like(ids, -100)
        predicted = torch.rand(ids.shape, generator=gen) < 0.15
        labels[predicted] = ids[predicted]
        order = torch.randint(0, 2, (shape.mb,), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, token_type_ids=types, labels=labels,
                         next_sentence_label=order).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


def bench_hf(shape: Shape, bf16: bool, warmup: int, steps: int) -> float:
    """Median seconds per training step of HF's BertForPreTraining."""
    step = hf_step(shape, bf16)
    sec = bench_train._timed(step, warmup, steps)
    del step  # the model and optimizer live in its closure
    gc.collect()
    return sec


def ours_command(shape: Shape, bf16: bool, tp: int, iters: int, extra: list[str]) -> list[str]:
    args = ["pretrain_bert.py", "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
            "--num-attention-heads", str(HEADS), "--seq-length", str(shape.seq),
            "--max-position-embeddings", "512", "--micro-batch-size", str(shape.mb),
            "--global-batch-size", str(shape.mb), "--lr", "1e-4", "--train-iters", str(iters),
            "--log-interval", "1", "--mock-data", "--vocab-file", VOCAB_FILE,
            "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
            "--distributed-backend", "gloo", "--tensor-model-parallel-size", str(tp),
            "--make-vocab-size-divisible-by", str(128 // tp), "--clip-grad", "1.0"]
    if bf16:
        args.append("--bf16")
    return launch.entry_point_command([*args, *extra], tp)


def bench_ours(shape: Shape, bf16: bool, tp: int, warmup: int, steps: int,
               extra: list[str]) -> float:
    """Median seconds per iteration of pretrain_bert.py after ``warmup`` iterations."""
    cmd = ours_command(shape, bf16, tp, warmup + steps, extra)
    return launch.median_iteration_seconds(cmd, ROOT, tp, warmup, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="128,512")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--tp", default="1", help="TP sizes of our runs")
    parser.add_argument("--quick", action="store_true",
                        help="2 warm-up and 2 timed steps, seq 128 fp32 only unless given")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternating rounds of HF and ours (medians, per-round ratios)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' BERT")
    parser.add_argument("--ours-args", default="", help="extra flags for pretrain_bert.py")
    parser.add_argument("--force-bf16", action="store_true",
                        help="run bf16 even where this CPU has no native bf16 GEMMs")
    parser.add_argument("--untuned-baseline-malloc", action="store_true",
                        help="leave HF's host allocator at glibc's defaults (by default it gets "
                             "the tuning pretrain_bert.py applies on CPU, so that the "
                             "comparison is of the models, PERF_NOTES.md)")
    args = parser.parse_args()
    if not args.untuned_baseline_malloc:
        from megatron.core.device import tune_host_allocator
        print(f"# HF's host allocator tuned as ours: {tune_host_allocator()}", flush=True)
    torch.set_num_threads(2)
    seqs = [int(s) for s in args.seqs.split(",")]
    precisions = args.precisions.split(",")
    if args.quick and args.seqs == "128,512" and args.precisions == "fp32,bf16":
        seqs, precisions = [128], ["fp32"]
    tps = [int(t) for t in args.tp.split(",")]
    extra = args.ours_args.split()
    print(f"# load at start (1/5/15 min): {bench_train.load()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    peak = {"fp32": bench_train.gemm_peak(torch.float32),
            "bf16": bench_train.gemm_peak(torch.bfloat16)}
    print(f"# torch.mm peak, 2 threads: fp32 {peak['fp32']:.0f} GFLOP/s, "
          f"bf16 {peak['bf16']:.0f} GFLOP/s", flush=True)
    if "bf16" in precisions and peak["bf16"] < 1.2 * peak["fp32"] and not args.force_bf16:
        # Without AVX-512 bf16 / AMX torch emulates bf16 GEMMs (bench_train.py: hours a step).
        print("# bf16 skipped: this CPU has no native bf16 GEMMs (bf16 peak below 1.2x fp32); "
              "--force-bf16 runs it anyway", flush=True)
        precisions = [p for p in precisions if p != "bf16"]
    n_params = non_embedding_params(hf_model())
    rows = []
    for seq in seqs:
        shape = SHAPES[seq]
        warmup, steps = (2, 2) if args.quick else (shape.warmup, shape.steps)
        for prec in precisions:
            bf16 = prec == "bf16"
            measured = _alternate(shape, bf16, tps, warmup, steps, extra, args)
            hf = bench_train.median(measured.get("hf", []))
            for tp in tps:
                ours = bench_train.median(measured[f"ours TP={tp}"])
                row = (seq, shape.mb, prec, tp, ours, hf,
                       bench_train.median_ratio(measured[f"ours TP={tp}"],
                                                measured.get("hf", [])),
                       6 * n_params * ours / (peak[prec] * 1e9))
                rows.append(row)
                print(_fmt(row), flush=True)
    print(f"# load at end: {bench_train.load()}")
    print("\n| seq | mb | precision | TP | ours tok/s | HF tok/s | ours/HF | MFU ours |\n"
          "|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(_fmt(row))


def _alternate(shape: Shape, bf16: bool, tps: list[int], warmup: int, steps: int,
               extra: list[str], args) -> dict[str, list[float]]:
    """Tokens/s of HF ("hf") and of ours at each TP ("ours TP=n") in each of ``--rounds``
    rounds (bench_train.alternate_rounds)."""
    tokens = shape.mb * shape.seq
    sides = {} if args.no_hf else {"hf": lambda: tokens / bench_hf(shape, bf16, warmup, steps)}
    for tp in tps:
        sides[f"ours TP={tp}"] = lambda tp=tp: tokens / bench_ours(shape, bf16, tp, warmup,
                                                                  steps, extra)
    return bench_train.alternate_rounds(sides, args.rounds)


def _fmt(row) -> str:
    seq, mb, prec, tp, ours, hf, ratio, mfu = row
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (f"| {seq} | {mb} | {prec} | {tp} | {ours:,.0f} | {f(hf, ',.0f')} | "
            f"{f(ratio, '.2f')}{'x' if ratio else ''} | {mfu:.0%} |")


if __name__ == "__main__":
    main()
