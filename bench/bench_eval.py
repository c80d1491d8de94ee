"""Zero-shot evaluation throughput (``tasks/main.py --task WIKITEXT103``'s evaluation) against
the training forward of the same model, in the same run.

    PYTHONPATH=. .venv/bin/python bench/bench_eval.py [--quick] [--threads 2]

One process, ``--threads`` torch threads, fp32, GPT-2-small shape (12 layers, hidden 768, 12
heads, seq 1024, micro-batch 4, GPT-2's vocabulary padded to 50304); ``--quick``: 2 layers,
hidden 128, seq 128 (a check that it runs, not a figure). Two measurements:

* bare forwards, like for like: per step the same random micro-batch through the training
  forward (``model.train()``, the forward with labels and the mean loss while autograd records;
  no backward) and the evaluation forward (``model.eval()``, ``no_grad``), back to back so a
  change in the machine's load touches both alike. Reported: each side's tokens/s (median
  step) and the median per-step ratio eval / train, of wall time and of this process's CPU
  time (the steadier one on a shared machine). The first step is a warm-up.
* :func:`tasks.zeroshot_gpt.evaluate.evaluate` end to end over a WikiText-format file written
  from ``../shared/data/corpus`` (streamed, detokenized, tokenized with GPT-2 BPE, windows with
  ``--overlapping-eval 32``), after a warm-up call: forward tokens/s counting every micro-batch
  the model actually ran (hooks count them; a padded last micro-batch counts whole), the share
  of the time spent inside the forwards, the scored windows and targets/s.

Run it on an idle machine (the load average is printed).
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
from megatron.core.models.builder import build_model_stage  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
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


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bare_forwards(model, seq: int, mbs: int, steps: int, vocab: int) -> dict:
    """Per step, the same random micro-batch through the training forward (``model.train()``,
    autograd recording, loss mean; the graph dropped as a step's backward would) and the
    evaluation forward (``model.eval()``, ``no_grad``), back to back so both see the same load;
    step 0 is a warm-up. Returns the wall and CPU seconds of each side per step."""
    gen = torch.Generator().manual_seed(0)
    times = {"train": ([], []), "eval": ([], [])}
    position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    for step in range(steps + 1):
        tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)

        def train():
            model.train()
            loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).mean()
            del loss

        def evaluation():
            model.eval()
            with torch.no_grad():
                model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).sum()

        for name, fn in (("train", train), ("eval", evaluation)):
            wall, cpu = _timed(fn)
            if step:
                times[name][0].append(wall)
                times[name][1].append(cpu)
    return times


class _ForwardCounter:
    """Counts the model's forward calls and their seconds (hooks), so the evaluation's
    forward tokens are those actually run, padding windows included."""

    def __init__(self, model) -> None:
        self.calls, self.seconds, self._start = 0, 0.0, 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.calls += 1
        self.seconds += time.perf_counter() - self._start


def whole_evaluation(model, tokenizer, path: str, seq: int, mbs: int, counter) -> dict:
    """:func:`evaluate` end to end (a warm-up call first): wall and CPU seconds, forwards
    run, seconds inside them, windows scored, targets."""
    scan = datasets.scan_word_level_file(path, "wiki")
    model.eval()
    result = {}
    for _ in range(2):
        data = LmData(path, tokenizer, scan, seq, STRIDE)
        counter.calls, counter.seconds = 0, 0.0
        sums = {}

        def run():
            sums.update(evaluate(data, model, "loss", seq_length=seq, micro_batch_size=mbs,
                                 dp_group=None, pp_group=None, log_interval=10**9))

        wall, cpu = _timed(run)
        result = {"wall": wall, "cpu": cpu, "forwards": counter.calls,
                  "forward seconds": counter.seconds, "windows": int(sums["sequences"]),
                  "targets": sums["targets"]}
    return result


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
    model = build_model_stage(GPTModel, transformer_config(cfg), parallel_output=True)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.threads} threads; layers "
          f"{cfg.model.num_layers}, hidden {cfg.model.hidden_size}, seq {seq}, micro-batch {mbs}, "
          f"vocab {cfg.padded_vocab_size}")
    tokens = mbs * seq
    bare = bare_forwards(model, seq, mbs, steps, tokenizer.vocab_size)
    (train_wall, train_cpu), (eval_wall, eval_cpu) = bare["train"], bare["eval"]
    print(f"train forward: {tokens / statistics.median(train_wall):,.0f} tokens/s; eval "
          f"forward (no_grad, same batches): {tokens / statistics.median(eval_wall):,.0f} "
          f"tokens/s; eval / train per step: wall "
          f"{statistics.median(t / e for t, e in zip(train_wall, eval_wall)):.2f}x, CPU time "
          f"{statistics.median(t / e for t, e in zip(train_cpu, eval_cpu)):.2f}x")
    counter = _ForwardCounter(model)
    with tempfile.TemporaryDirectory() as tmp:
        # Windows for (steps + 1) micro-batches: T = seq + (windows - 1) * STRIDE tokens.
        path = wikitext_file(tmp, seq + (steps * mbs) * STRIDE)
        run = whole_evaluation(model, tokenizer, path, seq, mbs, counter)
    forward_tokens = run["forwards"] * tokens
    train_rate = tokens / statistics.median(train_wall)
    print(f"evaluate() end to end: {forward_tokens / run['wall']:,.0f} forward tokens/s "
          f"({run['forwards']} micro-batches of {mbs} x {seq} for {run['windows']} scored "
          f"windows; {100 * run['forward seconds'] / run['wall']:.0f}% of the time in the "
          f"forwards), {run['targets'] / run['wall']:,.0f} scored targets/s; against the train "
          f"forward's median: {forward_tokens / run['wall'] / train_rate:.2f}x")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
