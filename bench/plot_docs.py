"""The plots of docs/benchmarks.md, from a quickstart log and the page's own tables.

    PYTHONPATH=. python bench/plot_docs.py --quickstart-log quickstart.log --out docs

``--quickstart-log``: the output of ``bash examples/quickstart.sh`` (its training log lines);
the speed plots read the tables of docs/benchmarks.md, so they show what the page says.
Needs matplotlib (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| lm loss: ([0-9.Ee+-]+)")
_VALID = re.compile(r"validation loss at iteration (\d+) .*?lm loss value: ([0-9.Ee+-]+)")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def quickstart_loss(log: Path, out: Path) -> None:
    """Training (and validation) lm loss against the iteration, from the quickstart's log."""
    text = log.read_text(encoding="utf-8", errors="replace")
    train = [(int(i), float(v)) for i, v in _ITER.findall(text)]
    valid = [(int(i), float(v)) for i, v in _VALID.findall(text)]
    if not train:
        raise SystemExit(f"{log}: no 'iteration N/ M | ... | lm loss: X' line found")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    ax.plot(*zip(*train), marker="o", ms=3, label="training lm loss (log interval)")
    if valid:
        ax.plot(*zip(*valid), marker="s", ls="--", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("bash examples/quickstart.sh: GPT 4 x 256, TP=2, CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after ``marker``."""
    lines = text[text.index(marker):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return [r for r in rows if not set("".join(r)) <= set("-:")]


def _ms(cell: str) -> float | None:
    match = re.match(r"([0-9.]+)", cell)
    return float(match.group(1)) if match else None


def gpu_speed(bench_md: str, out: Path) -> None:
    """ms/step of every side per shape, from the H100 speed table."""
    rows = _table_after(bench_md, "| shape | plain | plain + compile |")
    header, body = rows[0][1:], rows[1:]
    plt = _plt()
    fig, axes = plt.subplots(1, len(body), figsize=(3.2 * len(body), 3.4), dpi=110)
    for ax, row in zip(axes, body):
        sides = [(h, _ms(c)) for h, c in zip(header, row[1:]) if _ms(c) is not None]
        names = [h.replace("`--compile-layers`", "compile-layers") for h, _ in sides]
        colors = ["tab:orange" if n.startswith("ours") else "tab:gray" for n in names]
        ax.bar(range(len(sides)), [v for _, v in sides], color=colors)
        ax.set_xticks(range(len(sides)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(row[0].split(" (")[0], fontsize=9)
        ax.set_ylabel("ms / step (lower is better)", fontsize=8)
    fig.suptitle("NVIDIA H100, bf16, one process: ours (orange) against same-run baselines",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def cpu_training(bench_md: str, out: Path) -> None:
    """tokens/s of ours (TP=1) against plain and HF, from the two CPU training tables."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.0, 3.6), dpi=110)
    labels, values = [], {"ours": [], "plain": [], "HF": []}
    for machine, marker in (("A", "**A. AMD EPYC"), ("B", "**B. AVX2 only**")):
        for row in _table_after(bench_md, marker)[1:]:
            if row[2] != "1":
                continue
            labels.append(f"{machine}: {row[0].split(' (')[0]} {row[1]}")
            for key, cell in zip(("ours", "plain", "HF"), row[3:6]):
                values[key].append(float(cell.replace(",", "")))
    width = 0.27
    colors = {"ours": "tab:orange", "plain": "tab:gray", "HF": "tab:blue"}
    for k, (key, vals) in enumerate(values.items()):
        ax.bar([i + (k - 1) * width for i in range(len(vals))], vals, width, label=key,
               color=colors[key])
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log scale)")
    ax.set_title("CPU training, 2 cores, TP=1: pretrain_gpt.py against same-run baselines",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quickstart-log", type=Path, help="output of examples/quickstart.sh")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    bench_md = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    if args.quickstart_log:
        quickstart_loss(args.quickstart_log, args.out / "quickstart_loss.png")
    gpu_speed(bench_md, args.out / "gpu_speed_h100.png")
    cpu_training(bench_md, args.out / "cpu_training.png")


if __name__ == "__main__":
    main()
