"""Zero-shot evaluation throughput (``tasks/main.py --task WIKITEXT103``'s evaluation) against
the training forward of the same model, in the same run.

    PYTHONPATH=. .venv/bin/python bench/bench_eval.py [--quick] [--threads 2]

One process, ``--threads`` torch threads, fp32, GPT-2-small shape (12 layers, hidden 768, 12
heads, seq 1024, micro-batch 4, GPT-2's vocabulary padded to 50304); ``--quick``: 2 layers,
hidden 128, seq 128 (a check that it runs, not a figure). Both sides run the same model on
micro-batches of the same shape, one after the other:

* ``train forward``: ``model.train()``, the forward with labels and the mean loss, autograd
  recording (what a training step's forward costs; no backward).
* ``eval``: :func:`tasks.zeroshot_gpt.evaluate.evaluate` over a WikiText-format file written
  from ``../shared/data/corpus`` (streamed, detokenized, tokenized with GPT-2 BPE, windows with
  ``--overlapping-eval 32``), ``no_grad``, the data pipeline included.

Reported: forward tokens/s (sequences x seq_length per second) on both sides, their ratio, and
the evaluation's scored targets/s (each window after the first scores 32 new targets). The
first micro-batch of each side is a warm-up and is not timed. Run it on an idle machine
(the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.config import parse_args  # noqa: E402
from megatron.config.core_configs import transformer_config  # noqa: E402
from megatron.core.models.gpt import gpt_model_stage  # noqa: E402
from megatron.training.initialize import build_tokenizer_from_config  # noqa: E402
from tasks.zeroshot_gpt import datasets  # noqa: E402
from tasks.zeroshot_gpt.evaluate import LmData, evaluate  # noqa: E402

SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
STRIDE = 32


def shape_flags(quick: bool) -> tuple[list[str], int, int, int]:
    """(model flags, seq, micro-batch, timed micro-batches)."""
    layers, hidden, heads, seq, mbs, steps = (2, 128, 4, 128, 4, 4) if quick else \
        (12, 768, 12, 1024, 4, 4)
    flags = (f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} "
             f"--seq-length {seq} --max-position-embeddings {seq} --micro-batch-size {mbs} "
             "--hidden-dropout 0 --attention-dropout 0 --make-vocab-size-divisible-by 128 "
             "--tokenizer-type GPT2BPETokenizer "
             f"--vocab-file {SHARED}/tokenizers/gpt2-vocab.json "
             f"--merge-file {SHARED}/tokenizers/gpt2-merges.txt").split()
    return flags, seq, mbs, steps


def wikitext_file(directory: str, tokens_needed: int) -> str:
    """A word-level file (WikiText's layout) from the shared corpus, long enough to give about
    ``tokens_needed`` GPT-2 tokens."""
    text = open(os.path.join(SHARED, "corpus", "tinyshakespeare.txt"), encoding="utf-8").read()
    text = text[:tokens_needed * 5]
    for mark in ",.;:!?":
        text = text.replace(mark, " " + mark)
    word_level = " \n = Text = \n \n " + text.replace("\n\n", " \n \n ").replace("\n", " \n ")
    path = os.path.join(directory, "wiki.bench.tokens")
    with open(path, "w", encoding="utf-8") as out:
        out.write(word_level + " \n")
    return path


def train_forward_tokens_per_s(model, seq: int, mbs: int, steps: int, vocab: int) -> float:
    model.train()
    gen = torch.Generator().manual_seed(0)
    times = []
    for step in range(steps + 1):
        tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
        position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
        start = time.perf_counter()
        loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).mean()
        elapsed = time.perf_counter() - start
        del loss  # the graph: as a training step holds it until backward
        if step:
            times.append(elapsed)
    return mbs * seq / statistics.median(times)


def eval_tokens_per_s(model, cfg, tokenizer, path: str, seq: int, mbs: int
                      ) -> tuple[float, float, int]:
    """Runs the evaluation twice (the first as a warm-up); returns forward tokens/s, scored
    targets/s and the windows of the timed run."""
    scan = datasets.scan_word_level_file(path, "wiki")
    rates = None
    for _ in range(2):
        data = LmData(path, tokenizer, scan, seq, STRIDE)
        start = time.perf_counter()
        sums = evaluate(data, model, "loss", seq_length=seq, micro_batch_size=mbs,
                        dp_group=None, pp_group=None, log_interval=10**9)
        elapsed = time.perf_counter() - start
        windows = int(sums["sequences"])
        rates = (windows * seq / elapsed, sums["targets"] / elapsed, windows)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags, seq, mbs, steps = shape_flags(args.quick)
    cfg = parse_args(flags, world_size=1)
    tokenizer = build_tokenizer_from_config(cfg)
    torch.manual_seed(0)
    model = gpt_model_stage(transformer_config(cfg), parallel_output=True)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.threads} threads; layers "
          f"{cfg.model.num_layers}, hidden {cfg.model.hidden_size}, seq {seq}, micro-batch {mbs}, "
          f"vocab {cfg.padded_vocab_size}")
    train = train_forward_tokens_per_s(model, seq, mbs, steps, tokenizer.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        # Windows for (steps + 1) micro-batches: T = seq + (windows - 1) * STRIDE tokens.
        path = wikitext_file(tmp, seq + (steps * mbs) * STRIDE)
        model.eval()
        evals, targets, windows = eval_tokens_per_s(model, cfg, tokenizer, path, seq, mbs)
    print(f"train forward: {train:,.0f} tokens/s")
    print(f"eval: {evals:,.0f} forward tokens/s ({windows} windows), {targets:,.0f} scored "
          f"targets/s; eval / train forward = {evals / train:.2f}x")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
