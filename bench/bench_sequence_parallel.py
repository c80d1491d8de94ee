"""What sequence parallelism buys: activation memory of a tensor-parallel layer stack with and
without ``--sequence-parallel``, under none/selective/full recomputation, and the step time.

A stack of GPT-2-small-shaped layers (h 768, 12 heads; ``--layers`` of them, s ``--seq``,
micro-batch 1) in bf16 with dropout 0.1 (the masks are part of the theory) and Megatron's
unfused attention (``CoreAttention``, which the theory describes), this framework's
``TransformerBlock`` as a middle pipeline stage, run forward and backward at TP = 2 and 4 (gloo
processes, one thread each). Activation memory is what the forward keeps for the backward on
TP rank 0: every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``, each
storage once, parameters excluded), as bench/bench_recompute.py counts it. Korthikanti et al.
2022, per layer in 16-bit, t the TP size:

    recompute   without SP                         with SP
    none        s*b*h*(10 + 24/t + 5*a*s/(h*t))    s*b*h/t*(34 + 5*a*s/h)
    selective   s*b*h*(10 + 24/t)                  s*b*h/t*34
    full        2*s*b*h                            2*s*b*h/t  (the layer input, split)

The step time (forward + backward of the stack, median of ``--repeats`` after one warm-up, barriers
around it) of
both arrangements is measured in the same run: SP swaps each all-reduce of ``[s, b, h]`` for an
all-gather and a reduce-scatter of the same volume and re-gathers the column-parallel inputs in
the backward. On a loaded machine (the script prints the load average) the times mean little.

Run (bf16 GEMMs are slow on CPUs without AMX)::

    PYTHONPATH=. .venv/bin/python bench/bench_sequence_parallel.py            # s 512, 2 layers
    PYTHONPATH=. .venv/bin/python bench/bench_sequence_parallel.py --quick    # s 256, 1 layer
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_recompute import SETTINGS, SavedTensorMeter  # noqa: E402
from bench.launch import run_ranks  # noqa: E402


def theory_bytes_per_layer(setting: str, sp: bool, s: int, b: int, h: int, a: int,
                           t: int) -> float:
    """Korthikanti et al. 2022 (tables 2 and 3 of the paper), 16-bit activations."""
    attention = 5 * a * s / h
    if sp:
        per = {"none": 34 + attention, "selective": 34, "full": 2}[setting]
        return s * b * h / t * per
    per = {"none": 10 + (24 + attention) / t, "selective": 10 + 24 / t, "full": 2}[setting]
    return s * b * h * per


def _block(setting: str, sp: bool, args, tp_group, rank: int):
    import torch

    from megatron.core.tensor_parallel.random import model_parallel_manual_seed
    from megatron.core.transformer.block import TransformerBlock
    from megatron.core.transformer.config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        params_dtype=torch.bfloat16, hidden_dropout=0.1, attention_dropout=0.1,
        attention_backend="unfused", sequence_parallel=sp, **SETTINGS[setting])
    torch.manual_seed(0)
    model_parallel_manual_seed(0, rank)
    # A middle stage: its input comes from the previous stage, no embedding, no final norm.
    return TransformerBlock(config, tp_group, pre_process=False, post_process=False).train()


def _measure(block, sp: bool, args, tp_group) -> tuple[int, float]:
    """(bytes the forward keeps on this rank, median step seconds)."""
    import torch

    from megatron.core import comm

    t = comm.world_size(tp_group)
    shape = (args.seq // t if sp else args.seq, args.micro_batch, args.hidden)  # [s(/t), b, h]
    times, kept = [], 0
    for _ in range(args.repeats + 1):  # the first is a warm-up
        x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
        block.set_input_tensor(x)
        meter = SavedTensorMeter(list(block.parameters()))
        comm.barrier(tp_group)
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            out = block(None, None)  # causal attention without an explicit mask
        kept = meter.total
        out.backward(torch.ones_like(out))
        comm.barrier(tp_group)
        times.append(time.perf_counter() - start)
    return kept, statistics.median(times[1:])


def _worker(rank: int, world: int, args) -> list[tuple] | None:
    from megatron.core import device, parallel_state

    device.init_distributed(backend="gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    rows = []
    for setting in SETTINGS:
        for sp in (False, True):
            kept, seconds = _measure(_block(setting, sp, args, tp_group, rank), sp, args,
                                     tp_group)
            rows.append((setting, sp, kept, seconds))
    return rows if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true", help="s 256, 1 layer, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.layers, args.repeats = 256, 1, 1
    s, b, h, a, n = args.seq, args.micro_batch, args.hidden, args.heads, args.layers
    print(f"# {n} layers, s={s} b={b} h={h} a={a}, bf16, dropout 0.1, unfused attention; "
          f"gloo, 1 thread per rank; load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores")
    print("| TP | recompute | SP | kept MiB/rank (measured) | kept MiB (theory) | "
          "measured/theory | step s | SP step / no-SP step |")
    print("|---|---|---|---|---|---|---|---|")
    for t in args.tp:
        rows = run_ranks(t, _worker, args, timeout=1800)[0]
        no_sp = {setting: seconds for setting, sp, _, seconds in rows if not sp}
        for setting, sp, kept, seconds in rows:
            theory = n * theory_bytes_per_layer(setting, sp, s, b, h, a, t)
            ratio = f"{seconds / no_sp[setting]:.2f}x" if sp else ""
            print(f"| {t} | {setting} | {'yes' if sp else 'no'} | {kept / 2**20:.1f} | "
                  f"{theory / 2**20:.1f} | {kept / theory:.2f} | {seconds:.3f} | {ratio} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
