"""Whole training steps of ours, the plain GPT and HF GPT-2, alternating in one process, with
torch.profiler's account of where each step's time goes and the lead the profile allows.

    PYTHONPATH=. .venv/bin/python bench/profile_train.py [--shape gpt2|small] [--rounds 5]
        [--warmup 2] [--bf16] [--unfused] [--no-hf] [--no-profile] [--rows 12] [--json F]
        [--plot F.png [--plot-also EARLIER.json ...]]

``bench_train.py`` runs ``pretrain_gpt.py`` as a subprocess and the baselines in its own process,
one after the other: on a machine whose speed drifts 20-45% between minutes, a 5% difference
between sides is inside the noise of that. Here every side lives in this one process (2 threads)
and the rounds alternate step by step (plain, HF, ours, plain, ...), so a drift touches every
side alike:

* ``ours``: pretrain_gpt.py's own pieces (``initialize_megatron`` with bench_train's flags,
  ``setup_model_and_optimizer``, the mock-data loader) and the trainer's ``train_step``: zeroing
  the gradient buffers, forward and backward, the gradient finalisation, the NaN check, the
  optimizer with clipping. Not timed: the loop's log line and exit checks;
* ``plain`` and ``hf``: ``bench_train.py``'s baselines (same shapes, optimizer, clip 1.0), with
  glibc's allocator tuned as ours tunes it (one process: the same setting for every side).

``--unfused`` makes the C++ extension unimportable and passes ``--no-masked-softmax-fusion
--no-bias-gelu-fusion --no-bias-dropout-fusion --no-gradient-accumulation-fusion`` to ours (the
"before" of the fusions; run the script twice, once with it, to compare both against the same
baselines). Every timed step runs under torch.profiler (``--no-profile``: timings only; the
last round's op tables are printed). Its self CPU time is split into GEMMs (``mm``, ``addmm``,
``addmm_``, ``bmm``, ``baddbmm``), attention (SDPA's kernels, the softmaxes of the unfused
attention path) and the rest. The **ceiling** of ours' lead over a baseline is the lead ours
would have if its rest cost nothing: per round, the baseline's step / ours' GEMMs + attention.
All figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402

EXTENSION = "megatron.fused_kernels._cpu"
UNFUSED_FLAGS = ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                 "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion"]
SHAPE_NAMES = {"gpt2": "GPT-2-small", "small": "small shape"}
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"}
# SDPA's kernels; the fused softmaxes (the unfused attention path); ATen's softmax and its
# backward (not the loss's log_softmax).
ATTENTION_MARKERS = ("scaled_dot_product", "_ScaledSoftmax", "aten::_softmax")


def ours_step(shape: bench_train.Shape, bf16: bool, extra: list[str]) -> Callable[[], None]:
    """One ``train_step`` of pretrain_gpt.py's run at ``shape`` (TP=1, this process)."""
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    from megatron.training.initialize import build_tokenizer_from_config, initialize_megatron
    from megatron.training.loop import train_step
    from megatron.training.pretrain import (build_data_iterators, build_microbatch_calculator,
                                            compute_train_iters, setup_model_and_optimizer)
    from megatron.core.timers import Timers

    argv = bench_train.ours_flags(shape, bf16, 1, 10_000, extra)
    cfg = initialize_megatron(argv, require_train_length=True)
    timers = Timers(0, "minmax")
    model, optimizer, scheduler, state = setup_model_and_optimizer(
        cfg, pretrain_gpt.model_provider, timers)
    microbatches = build_microbatch_calculator(cfg)
    tokenizer = build_tokenizer_from_config(cfg) if cfg.tokenizer.tokenizer_type else None
    train_it, _, _ = build_data_iterators(cfg, tokenizer, pretrain_gpt.datasets_provider,
                                          compute_train_iters(cfg), state)
    for chunk in model:
        chunk.train()

    def step():
        state.iteration += 1
        train_step(functools.partial(pretrain_gpt.forward_step, cfg=cfg), train_it, model, optimizer, scheduler, cfg,
                   microbatches, timers, iteration=state.iteration)

    return step


def split_profile(prof) -> dict[str, float]:
    """Seconds of self CPU time in GEMMs, attention and the rest of the profiled step."""
    out = {"gemm": 0.0, "attention": 0.0, "total": 0.0}
    for event in prof.key_averages():
        sec = event.self_cpu_time_total / 1e6
        out["total"] += sec
        if event.key in GEMM_OPS:
            out["gemm"] += sec
        elif any(marker in event.key for marker in ATTENTION_MARKERS):
            out["attention"] += sec
    out["rest"] = out["total"] - out["gemm"] - out["attention"]
    return out


def run_rounds(steps: dict[str, Callable[[], None]], warmup: int, rounds: int,
               profiled: bool, rows: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """Step times of every side per round (sides back to back in each round) and, if
    ``profiled``, the split of every timed step (each under torch.profiler; the last round's
    op tables are printed)."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    splits: dict[str, list] = {name: [] for name in steps}
    for r in range(rounds):
        for name, step in steps.items():
            prof = profile(activities=[ProfilerActivity.CPU]) if profiled else None
            if prof is not None:
                prof.start()
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
            if prof is None:
                continue
            prof.stop()
            splits[name].append(split_profile(prof))
            if r == rounds - 1:
                print(f"\n## {name}: round {r + 1}, self CPU time by op\n", flush=True)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                                max_name_column_width=48), flush=True)
        print(f"# round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()),
              flush=True)
    return times, splits


def summary(times: dict[str, list[float]], splits: dict[str, list]) -> list[dict]:
    """One row per side: the medians over rounds of its step time, of ours' lead over it (per
    round, both measured in that round), of its profile split, and of the ceiling of ours' lead
    (per round: its step / ours' GEMMs + attention)."""
    ours = splits.get("ours") or []
    out = []
    for name, values in times.items():
        row = {"side": name, "step_s": statistics.median(values), "rounds_s": values}
        if name != "ours":
            row["ours_lead"] = bench_train.median_ratio(values, times["ours"])
            if ours:
                row["ceiling"] = statistics.median(
                    t / (o["gemm"] + o["attention"]) for t, o in zip(values, ours))
        for key in ("gemm", "attention", "rest", "total"):
            if splits.get(name):
                row[key] = statistics.median(split[key] for split in splits[name])
        out.append(row)
    return out


def print_table(rows: list[dict]) -> None:
    f = lambda row, key, spec: format(row[key], spec) if key in row else "-"  # noqa: E731
    print("\n| side | step s (median) | ours' lead (median of rounds) | GEMMs s | attention s | "
          "rest s | ceiling of ours' lead |\n|---|---|---|---|---|---|---|")
    for row in rows:
        lead = f"{row['ours_lead']:.3f}x" if "ours_lead" in row else "-"
        ceiling = f"{row['ceiling']:.3f}x" if "ceiling" in row else "-"
        print(f"| {row['side']} | {row['step_s']:.3f} | {lead} | {f(row, 'gemm', '.2f')} | "
              f"{f(row, 'attention', '.2f')} | {f(row, 'rest', '.2f')} | {ceiling} |")


def plot(runs: list[tuple[str, list[dict]]], path: str) -> None:
    """One panel per run (title, summary rows): stacked bars of each side's step split into
    GEMMs, attention and the rest (medians over the rounds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6.2 * len(runs), 3.4), squeeze=False,
                             sharex=True)
    for ax, (title, rows) in zip(axes[0], runs):
        rows = [row for row in rows if "gemm" in row]
        left = [0.0] * len(rows)
        for key, color in (("gemm", "#4c72b0"), ("attention", "#dd8452"), ("rest", "#c44e52")):
            widths = [row[key] for row in rows]
            ax.barh([row["side"] for row in rows], widths, left=left, color=color, label=key)
            left = [a + b for a, b in zip(left, widths)]
        for y, row in enumerate(rows):
            ax.text(left[y], y, f" rest {row['rest']:.2f} s", va="center", fontsize=8)
        ax.set_xlabel("self CPU time of one step (s), median of the rounds")
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, max(left) * 1.25)
    axes[0][0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3,
                      frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# plot: {path}")


def run_title(shape: str, unfused: bool, precision: str) -> str:
    return (f"{SHAPE_NAMES[shape]} {precision}, ours "
            f"{'unfused' if unfused else 'fused (defaults)'}; one process, sides alternating")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="gpt2", choices=sorted(bench_train.SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--bf16", action="store_true",
                        help="ours --bf16, the baselines under torch.autocast (bench_train's bf16)")
    parser.add_argument("--force-bf16", action="store_true",
                        help="run --bf16 even where this CPU has no native bf16 GEMMs")
    parser.add_argument("--unfused", action="store_true",
                        help="ours without the C++ extension and with the fusion flags off")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' GPT-2")
    parser.add_argument("--no-profile", action="store_true", help="timings only")
    parser.add_argument("--rows", type=int, default=12, help="rows of each profiler table")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the summary rows here")
    parser.add_argument("--plot", help="write the stacked-bar picture here (matplotlib)")
    parser.add_argument("--plot-also", nargs="*", default=[], metavar="JSON",
                        help="earlier runs' --json files, drawn as panels beside this run's")
    args = parser.parse_args()
    if args.bf16 and not bench_train.native_bf16() and not args.force_bf16:
        parser.error("--bf16: this CPU has no native bf16 GEMMs (torch emulates them ~100x "
                     "slower than fp32, so nothing would be learnt); --force-bf16 runs anyway")
    if args.plot and args.no_profile:
        parser.error("--plot draws the profile's split: drop --no-profile")
    precision = "bf16" if args.bf16 else "fp32"
    if args.unfused:
        sys.modules[EXTENSION] = None  # import raises ImportError: the PyTorch paths run
    torch.set_num_threads(args.threads)
    shape = bench_train.SHAPES[args.shape]
    print(f"# load at start (1/5/15 min): {bench_train.load()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {precision}; ours "
          f"{'unfused' if args.unfused else 'fused (defaults)'}", flush=True)
    steps = {"plain": bench_train.plain_step(shape, args.bf16)[0]}
    hf = None if args.no_hf else bench_train.hf_step(shape, args.bf16)
    if hf is not None:
        steps["hf"] = hf
    steps["ours"] = ours_step(shape, args.bf16, UNFUSED_FLAGS if args.unfused else [])
    times, splits = run_rounds(steps, args.warmup, args.rounds, not args.no_profile,
                               args.rows)
    rows = summary(times, splits)
    print(f"# load at end: {bench_train.load()}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "unfused": args.unfused, "precision": precision,
                       "rows": rows}, f, indent=1)
    if args.plot:
        runs = []
        for other in args.plot_also:
            with open(other) as f:
                earlier = json.load(f)
            if not any("gemm" in row for row in earlier["rows"]):
                sys.exit(f"--plot-also {other}: a --no-profile run has no split to draw")
            runs.append((run_title(earlier["shape"], earlier["unfused"],
                                   earlier.get("precision", "fp32")), earlier["rows"]))
        plot([*runs, (run_title(args.shape, args.unfused, precision), rows)], args.plot)
    sys.stdout.flush()
    os._exit(0)  # the loader's workers and process group: nothing left to tear down gracefully


if __name__ == "__main__":
    main()
