"""The pipeline bubble, measured against theory in the same run.

A stack of GPT transformer layers (built directly: no embedding, a mean-square loss on the last
stage) is trained for one global batch of m micro-batches:

* PP=1: one process, one thread, the whole stack, the no-pipelining schedule (the baseline);
* PP=2: two gloo processes with one thread each, half the layers each, 1F1B;
* PP=2 x VPP=2: the same two processes, each holding two chunks of a quarter of the layers,
  the interleaved schedule.

The idle fraction of a stage is the time it spends in pipeline sends/receives (the level-2
``forward-recv``, ``backward-send-forward-recv``... timers: an exchange waits until its peer is
ready, which is the bubble) over the step time. Theory: (p-1)/(m+p-1) for 1F1B and
(p-1)/(v*m+p-1) interleaved. Each exchange also costs gloo's latency (~1 ms on 127.0.0.1, about
1-2 ms for the ~1-4 MiB activations here), so the measured fraction sits a little above theory;
the model is sized so that compute dominates.

    PYTHONPATH=. .venv/bin/python bench/bench_pipeline.py            # the measurement (minutes)
    PYTHONPATH=. .venv/bin/python bench/bench_pipeline.py --quick    # a smoke run (seconds)

Run it on an idle machine (the load average is printed): PP=2 needs both cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.launch import run_ranks  # noqa: E402

P2P_TIMERS = ("forward-recv", "forward-send", "backward-recv", "backward-send",
              "forward-send-backward-recv", "backward-send-forward-recv",
              "forward-send-forward-recv", "backward-send-backward-recv",
              "forward-backward-send-forward-backward-recv")


def _layers_and_chunks(args: argparse.Namespace, pp: int, rank: int, vpp: int):
    """This rank's chunks: virtual stage c*pp + rank holds its share of the global stack."""
    from megatron.core.transformer.config import TransformerConfig
    from megatron.core.transformer.layer import TransformerLayer

    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_heads, hidden_dropout=0.0,
                               attention_dropout=0.0)
    per_chunk = args.num_layers // (pp * vpp)
    chunks = []
    for c in range(vpp):
        stage = c * pp + rank
        torch.manual_seed(1000 + stage)
        layers = [TransformerLayer(config, stage * per_chunk + i + 1, None)
                  for i in range(per_chunk)]
        chunks.append(_Chunk(layers, config, first=stage == 0))
    return chunks


class _Chunk(torch.nn.Module):
    """A few layers behind Megatron's chunk interface (``set_input_tensor``)."""

    def __init__(self, layers: list, config, first: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.config = config  # the schedules read the hidden size and dtype sent between stages
        self.first = first
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, data):
        hidden = data if self.first else self.input_tensor  # [s, b, h]
        for layer in self.layers:
            hidden = layer(hidden, None)
        return hidden


def _forward_step(data_iterator, model):
    data = next(data_iterator)
    output = model(data)

    def loss_func(out):
        loss = (out.float() ** 2).mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _worker(rank: int, world: int, args: argparse.Namespace, m: int, vpp: int):
    """Per-iteration (step seconds, seconds in pipeline exchanges), median over iterations."""
    from megatron.core import comm, device, parallel_state
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.timers import Timers

    pp_group = None
    if world > 1:
        device.init_distributed(backend="gloo")
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=world,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    chunks = _layers_and_chunks(args, world, rank, vpp)
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randn(shape, generator=generator) for _ in range(m)]
    schedule = schedules.get_forward_backward_func()
    steps, idle = [], []
    for it in range(args.warmup + args.iters):
        timers = Timers(log_level=2)
        comm.barrier(pp_group)
        start = time.perf_counter()
        schedule(forward_step_func=_forward_step,
                 data_iterator=[iter(batches) for _ in chunks], model=chunks,
                 num_microbatches=m, seq_length=shape[0], micro_batch_size=shape[1],
                 timers=timers)
        elapsed = time.perf_counter() - start
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        if it >= args.warmup:
            steps.append(elapsed)
            idle.append(sum(timers(name).elapsed() for name in P2P_TIMERS
                            if name in timers.names()))
    return statistics.median(steps), statistics.median(idle)


def _measure(world: int, args: argparse.Namespace, m: int, vpp: int) -> list:
    return run_ranks(world, _worker, args, m, vpp, timeout=1800)


def _table(args: argparse.Namespace) -> list[str]:
    rows = ["| layout | m | theory bubble | stage 0 idle | stage 1 idle | step (s) "
            "| PP=1 step (s) | PP=1 / PP step |",
            "|---|---|---|---|---|---|---|---|"]
    p = 2
    for vpp in (1, 2):
        for m in args.microbatches:
            if vpp > 1 and m % p:
                continue  # the interleaved schedule needs m divisible by p
            (base, _), = _measure(1, args, m, 1)
            stages = _measure(p, args, m, vpp)
            theory = (p - 1) / (vpp * m + p - 1)
            step = max(s for s, _ in stages)
            idle = [i / s for s, i in stages]
            layout = "PP=2" if vpp == 1 else "PP=2 x VPP=2"
            rows.append(f"| {layout} | {m} | {theory:.1%} | {idle[0]:.1%} | {idle[1]:.1%} "
                        f"| {step:.3f} | {base:.3f} | {base / step:.2f}x |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and one iteration: checks the script, measures nothing")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.num_layers, args.hidden_size, args.num_heads = 4, 64, 4
        args.seq_length, args.micro_batch_size = 16, 1
        args.microbatches, args.warmup, args.iters = [2], 0, 1
    load = os.getloadavg()[0]
    print(f"pipeline bubble: {args.num_layers} GPT layers, h {args.hidden_size}, "
          f"seq {args.seq_length}, mb {args.micro_batch_size}, fp32, 1 thread per rank, gloo; "
          f"median of {args.iters} steps after {args.warmup}; 1-min load {load:.1f} on "
          f"{os.cpu_count()} cores")
    rows = _table(args)
    print("\n".join(rows))
    load = max(load, os.getloadavg()[0])
    if load > 2.5:
        print(f"WARNING: 1-min load average {load:.1f}: other work shares the cores and the "
              "idle fractions include its interference; rerun when idle")


if __name__ == "__main__":
    main()
