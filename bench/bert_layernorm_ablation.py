"""The paper's figure 7 at CPU scale: BERT with the original layer-norm placement
(``--apply-residual-connection-post-layernorm``) against the rearranged (pre-LN, default) one,
trained on the same data, with the same seed and flags, through ``pretrain_bert.py``.

    PYTHONPATH=. .venv/bin/python bench/bert_layernorm_ablation.py [--iters 300]
        [--layers 24] [--hidden 64] [--lr 1e-3] [--data-path PREFIX] [--out docs/]
        [--parallel]

Without ``--data-path`` it builds the sentence-split quickstart corpus first
(``examples/prepare_bert_data.sh``: the shared books, bert-base-uncased WordPiece). Each run's
``lm loss`` and ``sop loss`` are read from the training log line at every iteration; the script
writes ``bert_layernorm_ablation.png`` (loss curves, matplotlib) and
``bert_layernorm_ablation.json`` (the flags and every logged value) to ``--out``.

The paper trains 336M / 752M / 1.2B / 3.9B BERTs; here the model is many thin layers, so the
effect of the placement (deep post-LN stacks train badly at a learning rate pre-LN takes) shows
in minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARRANGEMENTS = {"rearranged (pre-LN, default)": [],
                "original (--apply-residual-connection-post-layernorm)":
                    ["--apply-residual-connection-post-layernorm"]}
_LINE = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|(?: sop loss: (\S+) \|)?")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-path", default=None)
    p.add_argument("--vocab-file",
                   default=os.path.join(ROOT, "..", "shared", "data", "tokenizers",
                                        "bert-base-uncased-vocab.txt"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", action="store_true",
                   help="train both arrangements at once (threads split between them)")
    return p.parse_args(argv)


def data_path(args: argparse.Namespace) -> str:
    if args.data_path:
        return args.data_path
    out = os.path.join(ROOT, "quickstart_out")
    subprocess.run(["bash", os.path.join(ROOT, "examples", "prepare_bert_data.sh"), out],
                   check=True)
    return os.path.join(out, "bert_data", "corpus_text_sentence")


def run_flags(args: argparse.Namespace, prefix: str) -> list[str]:
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
            "--max-position-embeddings", str(args.seq), "--micro-batch-size",
            str(args.micro_batch), "--global-batch-size", str(args.micro_batch),
            "--train-iters", str(args.iters), "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
            "--lr-decay-style", "linear", "--lr-warmup-iters", str(args.warmup_iters),
            "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", str(args.seed),
            "--data-path", prefix, "--vocab-file", args.vocab_file, "--split", "98,2,0",
            "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--distributed-backend", "gloo"]


def start(flags: list[str], threads: int) -> subprocess.Popen:
    """Start one pretrain_bert.py run (its output collected by :func:`finish`)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_bert.py"), *flags],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen) -> list[dict]:
    """Every logged iteration's losses of a started run."""
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain_bert.py failed:\n{stdout[-3000:]}{stderr[-3000:]}")
    rows = []
    for line in stdout.splitlines():
        match = _LINE.match(line)
        if match:
            rows.append({"iteration": int(match[1]), "lm loss": float(match[2]),
                         "sop loss": float(match[3]) if match[3] else None})
    return rows


def plot(results: dict[str, list[dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        its = [r["iteration"] for r in rows]
        axes[0].plot(its, [r["lm loss"] for r in rows], label=name, linewidth=1)
        axes[1].plot(its, [r["sop loss"] for r in rows], label=name, linewidth=1)
    for ax, what in zip(axes, ("masked-LM loss", "sentence-order loss")):
        ax.set_xlabel("iteration")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tail_mean(rows: list[dict], key: str, n: int = 20) -> float:
    values = [r[key] for r in rows[-n:]]
    return sum(values) / len(values)


def main(argv=None) -> int:
    args = parse_args(argv)
    prefix = data_path(args)
    os.makedirs(args.out, exist_ok=True)
    results, seconds = {}, {}
    if args.parallel:
        # Both at once, one thread each: on 2 cores about as fast as one after the other.
        start_time = time.time()
        procs = {name: start(run_flags(args, prefix) + extra, max(1, args.threads // 2))
                 for name, extra in ARRANGEMENTS.items()}
        for name, proc in procs.items():
            results[name] = finish(proc)
            seconds[name] = time.time() - start_time
    else:
        for name, extra in ARRANGEMENTS.items():
            start_time = time.time()
            results[name] = finish(start(run_flags(args, prefix) + extra, args.threads))
            seconds[name] = time.time() - start_time
    for name, rows in results.items():
        print(f"== {name}: {len(rows)} iterations in {seconds[name]:.0f} s; last-20 mean lm "
              f"loss {tail_mean(rows, 'lm loss'):.3f}, sop loss {tail_mean(rows, 'sop loss'):.3f}",
              flush=True)
    title = (f"BERT {args.layers} layers x hidden {args.hidden}, seq {args.seq}, batch "
             f"{args.micro_batch}, lr {args.lr:g} (warm-up {args.warmup_iters}), seed {args.seed}")
    plot(results, os.path.join(args.out, "bert_layernorm_ablation.png"), title)
    summary = {"flags": run_flags(args, prefix), "arrangements": ARRANGEMENTS,
               "seconds": seconds, "load_average": os.getloadavg(), "results": results,
               "last20_mean": {n: {k: tail_mean(r, k) for k in ("lm loss", "sop loss")}
                               for n, r in results.items()}}
    with open(os.path.join(args.out, "bert_layernorm_ablation.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["last20_mean"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
