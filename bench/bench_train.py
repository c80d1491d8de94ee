"""Training throughput of ``pretrain_gpt.py`` against plain PyTorch and HF GPT-2, same run.

    PYTHONPATH=. .venv/bin/python bench/bench_train.py [--quick] [--shapes small|gpt2|all]
        [--precisions fp32,bf16] [--tp 1,2] [--no-hf] [--ours-args "--num-workers 0"]
        [--ours-also=--compile-layers]
        [--tune-baseline-malloc] [--rounds 1]

For every shape x precision it measures, one after the other in this process's run:

* ``plain``: the nanoGPT-style GPT-2 of ``bench/plain_gpt.py`` (SDPA, fused AdamW, grad clip 1.0),
  one process, 2 threads; bf16 = ``torch.autocast`` over fp32 params (what a plain script does).
* ``hf``: transformers' ``GPT2LMHeadModel`` (SDPA attention, dropout 0, same AdamW), if installed.
* ``ours TP=1``: ``pretrain_gpt.py`` with ``--mock-data``, one process, ``OMP_NUM_THREADS=2``;
  bf16 = ``--bf16`` (bf16 params, fp32 main params in the optimizer).
* ``ours TP=2``: ``torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2``,
  one thread per rank. Its baseline is still the one-process plain model.
* ``--ours-also FLAGS``: ours once more per TP size with FLAGS added, in the same rounds (e.g.
  ``--compile-layers``: its compilation falls in the warm-up iterations, which are dropped).

Same shapes everywhere (vocab 50304: ``--vocab-size 50303`` + the NullTokenizer's EOD pads to
exactly 50304), dropout 0, AdamW (wd 0.01 on matrices), clip 1.0, one micro-batch per step.
Warm-up steps are dropped; the figure is the median of the timed steps. ``--rounds R`` measures
every side R times, one round after another (plain, HF, ours), and reports the medians and the
median of the per-round ratios: on a machine whose speed drifts 20-25% between runs, sides
measured minutes apart can differ by more than what is compared. MFU = 6 N tokens/s over the
``torch.mm`` peak measured here at 2 threads (fp32 peak for fp32, bf16 peak for bf16), N = the
parameters without the position embeddings.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch  # noqa: E402
import plain_gpt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 50304


@dataclasses.dataclass
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    mb: int
    warmup: int
    steps: int


SHAPES = {"small": Shape("small", 4, 256, 8, 256, 8, warmup=3, steps=5),
          "gpt2": Shape("gpt2", 12, 768, 12, 512, 4, warmup=2, steps=3)}


def gemm_peak(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """GFLOP/s of ``torch.mm`` on n x n matrices (best of ``reps``)."""
    if dtype == torch.bfloat16 and not native_bf16():
        n, reps = 256, 2  # emulated bf16 is ~100x slower: measure a small one
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _timed(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_step(shape: Shape, bf16: bool) -> tuple[Callable[[], None], int]:
    """(one training step of the plain GPT on fresh random tokens, N parameters)."""
    torch.manual_seed(0)
    cfg = plain_gpt.GPTConfig(shape.layers, shape.hidden, shape.heads, shape.seq, VOCAB)
    model = plain_gpt.GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    opt = plain_gpt.configure_adamw(model)

    def step():
        data = torch.randint(0, VOCAB, (shape.mb, shape.seq + 1))
        plain_gpt.train_step(model, opt, data[:, :-1], data[:, 1:], bf16)

    return step, n_params


def hf_step(shape: Shape, bf16: bool) -> Callable[[], None] | None:
    """One training step of transformers' GPT2LMHeadModel, or None if not installed."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=shape.seq, n_embd=shape.hidden, n_layer=shape.layers,
        n_head=shape.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    opt = plain_gpt.configure_adamw(model)

    def step():
        data = torch.randint(0, VOCAB, (shape.mb, shape.seq))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=data, labels=data).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


def bench_plain(shape: Shape, bf16: bool, warmup: int, steps: int) -> tuple[float, int]:
    """(seconds per step, N) of the plain GPT."""
    step, n_params = plain_step(shape, bf16)
    sec = _timed(step, warmup, steps)
    del step
    gc.collect()
    return sec, n_params


def bench_hf(shape: Shape, bf16: bool, warmup: int, steps: int) -> float | None:
    """Seconds per step of transformers' GPT2LMHeadModel, or None if not installed."""
    step = hf_step(shape, bf16)
    if step is None:
        return None
    sec = _timed(step, warmup, steps)
    del step
    gc.collect()
    return sec


def ours_flags(shape: Shape, bf16: bool, tp: int, iters: int, extra: list[str]) -> list[str]:
    """pretrain_gpt.py's flags for ``shape`` (mock data, the baselines' settings)."""
    args = ["--num-layers", str(shape.layers),
            "--hidden-size", str(shape.hidden), "--num-attention-heads", str(shape.heads),
            "--seq-length", str(shape.seq), "--max-position-embeddings", str(shape.seq),
            "--micro-batch-size", str(shape.mb), "--global-batch-size", str(shape.mb),
            "--lr", "1e-4", "--train-iters", str(iters), "--log-interval", "1",
            "--mock-data", "--vocab-size", str(VOCAB - 1), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--eval-iters", "0", "--distributed-backend", "gloo",
            "--tensor-model-parallel-size", str(tp)]
    if bf16:
        args.append("--bf16")
    return [*args, *extra]


def ours_command(shape: Shape, bf16: bool, tp: int, iters: int, extra: list[str]) -> list[str]:
    return launch.entry_point_command(
        ["pretrain_gpt.py", *ours_flags(shape, bf16, tp, iters, extra)], tp)


def bench_ours(shape: Shape, bf16: bool, tp: int, warmup: int, steps: int,
               extra: list[str]) -> float:
    """Median seconds per iteration of pretrain_gpt.py after ``warmup`` iterations."""
    cmd = ours_command(shape, bf16, tp, warmup + steps, extra)
    return launch.median_iteration_seconds(cmd, ROOT, tp, warmup, steps)


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="all", choices=["small", "gpt2", "all"])
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--tp", default="1,2", help="TP sizes of our runs")
    parser.add_argument("--quick", action="store_true", help="fewer warm-up and timed steps")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternating rounds of every side (medians, per-round ratios)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' GPT-2")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain baseline")
    parser.add_argument("--ours-args", default="", help="extra flags for pretrain_gpt.py")
    parser.add_argument("--ours-also", default="",
                        help="flags of a second ours side per TP size, measured in the same "
                             "rounds (e.g. --ours-also=--compile-layers); its tokens/s over "
                             "ours' is printed (median of the per-round ratios)")
    parser.add_argument("--force-bf16", action="store_true",
                        help="run bf16 even where this CPU has no native bf16 GEMMs")
    parser.add_argument("--tune-baseline-malloc", action="store_true",
                        help="give the in-process baselines the host-allocator tuning that "
                             "pretrain_gpt.py applies on CPU (MEGATRON_TUNE_HOST_MALLOC=0 turns "
                             "ours off), to separate its effect from the rest")
    args = parser.parse_args()
    if args.tune_baseline_malloc:
        from megatron.core.device import tune_host_allocator
        print(f"# baselines' host allocator tuned: {tune_host_allocator()}", flush=True)
    torch.set_num_threads(2)
    shapes = list(SHAPES.values()) if args.shapes == "all" else [SHAPES[args.shapes]]
    precisions = args.precisions.split(",")
    tps = [int(t) for t in args.tp.split(",")]
    extra = args.ours_args.split()

    print(f"# load at start (1/5/15 min): {load()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, native bf16: {native_bf16()}",
          flush=True)
    peak = {"fp32": gemm_peak(torch.float32), "bf16": gemm_peak(torch.bfloat16)}
    print(f"# torch.mm peak, 2 threads: fp32 {peak['fp32']:.0f} GFLOP/s, "
          f"bf16 {peak['bf16']:.0f} GFLOP/s", flush=True)
    if "bf16" in precisions and peak["bf16"] < 1.2 * peak["fp32"] and not args.force_bf16:
        # Without AVX-512 bf16 / AMX, torch emulates bf16 GEMMs (seen: 1.5 GFLOP/s on an AVX2
        # EPYC, one GPT-2-small step would take hours): nothing to learn, skip.
        print("# bf16 skipped: this CPU has no native bf16 GEMMs (bf16 peak below 1.2x fp32); "
              "--force-bf16 runs it anyway", flush=True)
        precisions = [p for p in precisions if p != "bf16"]
    rows = []
    for shape in shapes:
        warmup, steps = shape.warmup, shape.steps
        if args.quick:
            # Fewer timed steps only: the second step still pays one-time costs (the optimizer
            # state allocated in step 1 grows the heap), so warm-up is never cut below 2.
            steps = max(2, steps - 2)
        for prec in precisions:
            bf16 = prec == "bf16"
            model = plain_gpt.GPT(plain_gpt.GPTConfig(shape.layers, shape.hidden, shape.heads,
                                                      shape.seq, VOCAB))
            n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
            del model
            measured = _alternate(shape, bf16, tps, warmup, steps, extra, args)
            for tp in tps:
                if args.ours_also:
                    also = measured[f"ours TP={tp} {args.ours_also}"]
                    print(f"# {shape.name} {prec} TP={tp}: ours {args.ours_also} / ours = "
                          f"{median_ratio(also, measured[f'ours TP={tp}']):.3f}x (tok/s "
                          f"{median(also):,.0f}; median of the per-round ratios)", flush=True)
                ours, plain, hf = (measured.get(k, []) for k in (f"ours TP={tp}", "plain", "hf"))
                row = (shape.name, prec, tp, median(ours), median(plain), median(hf),
                       median_ratio(ours, plain), median_ratio(ours, hf),
                       6 * n_params * median(ours) / (peak[prec] * 1e9),
                       6 * n_params * median(plain) / (peak[prec] * 1e9) if plain else None)
                rows.append(row)
                print(_fmt(row), flush=True)
    print(f"# load at end: {load()}")
    print("\n| shape | precision | TP | ours tok/s | plain tok/s | HF tok/s | ours/plain | "
          "ours/HF | MFU ours | MFU plain |\n|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(_fmt(row))


def _alternate(shape: Shape, bf16: bool, tps: list[int], warmup: int, steps: int,
               extra: list[str], args) -> dict[str, list[float]]:
    """Tokens/s of each side ("plain", "hf", "ours TP=n") in each of ``--rounds`` rounds."""
    tokens = shape.mb * shape.seq

    def hf() -> float | None:
        sec = bench_hf(shape, bf16, warmup, steps)
        return tokens / sec if sec else None

    sides: dict[str, Callable[[], float | None]] = {}
    if not args.no_plain:
        sides["plain"] = lambda: tokens / bench_plain(shape, bf16, warmup, steps)[0]
    if not args.no_hf:
        sides["hf"] = hf
    for tp in tps:
        sides[f"ours TP={tp}"] = lambda tp=tp: tokens / bench_ours(shape, bf16, tp, warmup,
                                                                  steps, extra)
        if args.ours_also:
            also = [*extra, *args.ours_also.split()]
            sides[f"ours TP={tp} {args.ours_also}"] = lambda tp=tp: tokens / bench_ours(
                shape, bf16, tp, warmup, steps, also)
    return alternate_rounds(sides, args.rounds)


def alternate_rounds(sides: dict[str, Callable[[], float | None]], rounds: int
                     ) -> dict[str, list[float]]:
    """Each side's figure (its callable's value; None: the side is unavailable) in each of
    ``rounds`` rounds, the sides back to back within a round, so that a drift of the machine's
    speed touches every side alike. Prints each round's figures."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(rounds):
        for name, measure in sides.items():
            value = measure()
            if value is not None:
                out[name].append(value)
        print(f"# round {i + 1}: " + ", ".join(
            f"{name} {v[-1]:,.0f}" for name, v in out.items() if v), flush=True)
    return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def median_ratio(ours: list[float], theirs: list[float]) -> float | None:
    """The median of the per-round ratios (both measured in the same round)."""
    return statistics.median(o / t for o, t in zip(ours, theirs)) if theirs else None


def _fmt(row) -> str:
    name, prec, tp, ours, plain, hf, ratio, ratio_hf, mfu, mfu_plain = row
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (f"| {name} | {prec} | {tp} | {ours:,.0f} | {f(plain, ',.0f')} | {f(hf, ',.0f')} | "
            f"{f(ratio, '.2f')}{'x' if ratio else ''} | {f(ratio_hf, '.2f')}"
            f"{'x' if ratio_hf else ''} | {mfu:.0%} | {f(mfu_plain, '.0%')} |")


if __name__ == "__main__":
    main()
