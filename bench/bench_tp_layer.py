"""Forward + backward time of one GPT-2-small-shaped transformer layer at TP = 1 vs TP = 2.

TP = 1 runs in one process with one thread; TP = 2 in two gloo processes with one thread each
(the two cores of the machine), so the speed-up is comparable with the paper's 2-GPU
strong-scaling figure. Each TP rank does half the GEMM work and 4 all-reduces of ``[s, b, h]``
per iteration (2 forward, 2 backward), which gloo on 127.0.0.1 carries at ~1 GB/s.

    python bench/bench_tp_layer.py [--micro-batch-size 2] [--iters 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.launch import run_ranks  # noqa: E402

PAPER_2GPU_SPEEDUP = 1.64  # Megatron-LM paper, strong scaling, 2 GPUs


def _worker(rank: int, world: int, args: argparse.Namespace):
    """(median step seconds, 4 all-reduces' seconds, bytes of one) on rank 0; None elsewhere."""
    import torch

    from megatron.core import comm, device, parallel_state
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.core.transformer.config import TransformerConfig
    from megatron.core.transformer.layer import TransformerLayer

    tp_group = None
    if world > 1:
        device.init_distributed(backend="gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        tp_group = parallel_state.get_tensor_model_parallel_group()
    config = TransformerConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                               hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(1234)
    model_parallel_manual_seed(1234, rank)
    layer = TransformerLayer(config, 1, tp_group).train()
    shape = (args.seq_length, args.micro_batch_size, config.hidden_size)
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)

    def step() -> float:
        comm.barrier(tp_group)
        start = time.perf_counter()
        layer(x, None).backward(grad)
        comm.barrier(tp_group)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    times = [step() for _ in range(args.iters)]
    allreduce = None
    if world > 1:  # the same 4 all-reduces of [s, b, h] alone
        buf = torch.randn(shape)
        comm.all_reduce(buf, tp_group)
        start = time.perf_counter()
        for _ in range(4 * args.iters):
            comm.all_reduce(buf, tp_group)
        allreduce = (time.perf_counter() - start) / args.iters
    if rank != 0:
        return None
    return statistics.median(times), allreduce, buf.numel() * 4 if world > 1 else 0


def _run(world: int, args: argparse.Namespace):
    return run_ranks(world, _worker, args, timeout=600)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    t1, _, _ = _run(1, args)
    t2, allreduce, nbytes = _run(2, args)
    speedup = t1 / t2
    tokens = args.seq_length * args.micro_batch_size
    print(f"GPT-2-small layer (h=768, 12 heads, seq {args.seq_length}, mb "
          f"{args.micro_batch_size}, fp32), forward+backward, median of {args.iters}:")
    print(f"  TP=1 (1 process x 1 thread):   {t1 * 1e3:8.1f} ms  ({tokens / t1:,.0f} tok/s)")
    print(f"  TP=2 (2 processes x 1 thread): {t2 * 1e3:8.1f} ms  ({tokens / t2:,.0f} tok/s)")
    print(f"  speed-up {speedup:.2f}x   (paper, 2 GPUs strong scaling: {PAPER_2GPU_SPEEDUP:.2f}x)"
          f"   scaling efficiency {speedup / 2:.0%} (paper {PAPER_2GPU_SPEEDUP / 2:.0%})")
    print(f"  gloo: 4 all-reduces of {nbytes / 2**20:.1f} MiB per iteration take "
          f"{allreduce * 1e3:.1f} ms ({4 * nbytes / allreduce / 1e9:.2f} GB/s algorithmic), "
          f"{allreduce / t2:.0%} of the TP=2 step (gloo on 127.0.0.1: ~1 GB/s for large "
          "messages, 0.6-1.2 ms latency)")
    load = max(load_before, os.getloadavg()[0])
    if load > 2.5:
        print(f"  WARNING: 1-min load average {load:.1f} on {os.cpu_count()} cores: other work "
              "shares the cores, TP=2 (which needs both) is penalised; rerun when idle")


if __name__ == "__main__":
    main()
