"""What context parallelism buys: activation memory per rank and step time of a Llama-shaped
layer stack at CP = 1, 2, 4, the bytes each ``--cp-comm-type`` moves per layer against the
formula, and the longest sequence that fits a memory budget at each CP size.

A stack of ``--layers`` Llama-shaped layers (RMSNorm, SwiGLU, RoPE, grouped-query attention, no
biases; h ``--hidden``, ``--heads`` query heads, ``--groups`` key/value heads), this framework's
``TransformerBlock`` as a middle pipeline stage, runs forward and backward on ``s / CP`` rows per
rank (gloo processes, one thread each; CUDA when available, one process per GPU). Activation
memory is what the forward keeps for the backward on CP rank 0 (every tensor autograd saves,
each storage once, parameters excluded, as bench/bench_recompute.py counts it); on CUDA also the
allocator's peak. The step time is the median of ``--repeats`` after one warm-up, barriers around
it. The CP = 1 row is the same-run baseline.

Bytes per layer (forward + backward) one rank sends, K = 2 (s/CP) b g hn e the rank's keys and
values, K' the same in the accumulation dtype (fp32), Q = (s/CP) b np hn e its queries:

    p2p         2 (CP - 1) K + CP K'          (keys/values around the ring twice, their
                                               gradients once around and home)
    all_gather  2 (CP - 1) K + (CP - 1) K'    (gathered in forward and again in backward,
                                               gradients reduce-scattered)
    a2a         2 (CP - 1)/CP (2 Q + K)       (q, k, v and the output, forward and backward)

measured by counting the tensors handed to megatron.core.comm's collectives (the logical
volume; a ring all-gather sends the same).

Peak memory per rank is measured, not modelled: off CUDA the kernel's high-water mark of the
process's resident memory (``VmHWM``, reset through ``/proc/self/clear_refs`` after
``malloc_trim`` right before the step, glibc's mmap threshold fixed at 1 MiB so freed blocks go
back to the kernel) minus the resident memory at that moment (weights, gradients, the process):
the activations kept plus every transient of the forward and backward, the largest over the CP
ranks; on CUDA the allocator's peak above the allocation before the step. The longest sequence
that fits ``--budget-gib`` per rank is read off the same measurement at ``--seq / 2`` and
``--seq``: nothing the step holds grows faster than the sequence (the flash kernels hold no
``s x s`` scores and the math path's blocks run in query-row chunks of at most
``context_parallel.MATH_BLOCK_BYTES``), so the peak is the line through the two points, and the
column is where that line meets the budget (weights, gradients and optimizer state come on top;
the next run at that length is the check).

Run::

    PYTHONPATH=. .venv/bin/python bench/bench_cp.py              # s 2048, 2 layers, fp32
    PYTHONPATH=. .venv/bin/python bench/bench_cp.py --quick      # s 512, 1 layer
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_recompute import SavedTensorMeter  # noqa: E402
from bench.launch import run_ranks  # noqa: E402

COMM_TYPES = ("p2p", "all_gather", "a2a")


def longest_sequence(points: list[tuple[int, float]], budget: float, cp: int) -> int:
    """Largest S whose peak, on the line through two measured ``(S, peak bytes)`` points, is
    within ``budget``, rounded down to a multiple of 2 CP (0 when the line never fits)."""
    (s1, p1), (s2, p2) = points
    slope = max((p2 - p1) / (s2 - s1), 1.0)  # per token; a flat line: timing noise, keep >0
    longest = s2 + (budget - p2) / slope
    return max(0, int(longest) // (2 * cp) * (2 * cp))


class PeakMemory:
    """Peak memory of a region above its start: on CUDA the allocator's, elsewhere the
    process's resident high-water mark (Linux ``VmHWM``, reset at the start)."""

    def __init__(self, dev) -> None:
        import ctypes

        self.dev, self.libc = dev, None
        if dev.type != "cuda":
            self.libc = ctypes.CDLL("libc.so.6")
            self.libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: large blocks unmapped on free
        self.base = 0

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {key}")

    def start(self) -> None:
        import torch

        if self.dev.type == "cuda":
            torch.cuda.synchronize()  # cuda-only (guarded)
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        self.libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
        self.base = self._status("VmRSS")

    def peak(self) -> int:
        import torch

        if self.dev.type == "cuda":
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base


def formula_bytes(comm_type: str, cp: int, s: int, b: int, np_: int, g: int, hn: int,
                  elt: int, acc: int = 4) -> float:
    """Bytes one rank sends per layer (forward + backward), see the module docstring."""
    rows = s // cp
    k, k_acc = 2 * rows * b * g * hn * elt, 2 * rows * b * g * hn * acc
    q = rows * b * np_ * hn * elt
    if cp == 1:
        return 0.0
    return {"p2p": 2 * (cp - 1) * k + cp * k_acc,
            "all_gather": 2 * (cp - 1) * k + (cp - 1) * k_acc,
            "a2a": 2 * (cp - 1) / cp * (2 * q + k)}[comm_type]


class CommMeter:
    """Counts the bytes this rank hands to megatron.core.comm's collectives (patched in)."""

    def __init__(self) -> None:
        from megatron.core import comm

        self.comm, self.total, self.saved = comm, 0, {}
        n = comm.world_size

        def wrap(name, count):
            original = getattr(comm, name)
            self.saved[name] = original

            def counted(*args, **kwargs):
                self.total += count(*args)
                return original(*args, **kwargs)
            setattr(comm, name, counted)

        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        wrap("batch_isend_irecv", lambda ops, group: sum(size(t) for k, t, _ in ops if k == "send"))
        wrap("all_gather_list", lambda t, group: size(t) * (n(group) - 1))
        wrap("reduce_scatter_into", lambda out, t, group, *a: size(t) * (n(group) - 1) // n(group))
        wrap("all_to_all_single", lambda out, t, group, *splits: size(t) * (n(group) - 1) // n(group))

    def close(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.comm, name, fn)


def _block(args, cp: int, comm_type: str, cp_group, dtype):
    import torch

    from megatron.core.transformer.block import TransformerBlock
    from megatron.core.transformer.config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.groups, ffn_hidden_size=args.ffn, params_dtype=dtype,
        normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
        context_parallel_size=cp, cp_comm_type=comm_type)
    torch.manual_seed(0)
    return TransformerBlock(config, None, pre_process=False, post_process=False,
                            cp_group=cp_group).train()


def _step(block, args, seq: int, cp_group, dtype, dev):
    """One forward + backward on this rank's rows: (bytes kept, seconds, comm bytes, peak
    bytes above the start)."""
    import torch

    from megatron.core import comm
    from megatron.core.transformer.context_parallel import split_for_cp
    from megatron.core.transformer.rotary import RotaryEmbedding

    cp, rank = comm.world_size(cp_group), comm.rank(cp_group)
    rope = RotaryEmbedding(args.hidden // args.heads)(seq, device=dev)  # 2 x [S, 1, 1, rot]
    rope = tuple(split_for_cp(t, 0, cp, rank) for t in rope)  # (cos, sin) of this rank's rows
    x = torch.randn(seq // cp, 1, args.hidden, dtype=dtype, device=dev, requires_grad=True)
    block.set_input_tensor(x)
    meter, comms = SavedTensorMeter(list(block.parameters())), CommMeter()
    memory = PeakMemory(dev)
    comm.barrier(cp_group)
    memory.start()
    start = time.perf_counter()
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            out = block(None, None, None, rope)
        out.backward(torch.ones_like(out))
        if dev.type == "cuda":
            torch.cuda.synchronize()  # cuda-only (guarded above)
        seconds, peak = time.perf_counter() - start, memory.peak()
        del out
    finally:
        comms.close()
    comm.barrier(cp_group)
    return meter.total, seconds, comms.total, peak


def _worker(rank: int, world: int, args) -> list[dict] | None:
    import torch

    from megatron.core import device, parallel_state

    from megatron.core.transformer import context_parallel

    context_parallel.FLASH_ON_CPU = args.flash_on_cpu
    if args.math_chunk_mib is not None:
        context_parallel.MATH_BLOCK_BYTES = int(args.math_chunk_mib * 2**20)
    device.init_distributed(backend="gloo")
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    cp_group = parallel_state.get_context_parallel_group()
    dev = device.get_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for comm_type in args.comm if world > 1 else ("none",):
        block = _block(args, world, comm_type if world > 1 else "p2p", cp_group, dtype).to(dev)
        _step(block, args, args.seq // 4, cp_group, dtype, dev)  # warm-up: gradients made
        half = _step(block, args, args.seq // 2, cp_group, dtype, dev)[3]
        times, peaks = [], []
        for _ in range(args.repeats):
            kept, seconds, sent, peak = _step(block, args, args.seq, cp_group, dtype, dev)
            times.append(seconds)
            peaks.append(peak)
        rows.append({"comm": comm_type, "kept": kept, "seconds": statistics.median(times),
                     "sent": sent / args.layers, "peak": max(peaks), "half_peak": half,
                     "elt": torch.tensor([], dtype=dtype).element_size()})
        del block
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm", nargs="+", default=list(COMM_TYPES), choices=COMM_TYPES,
                        help="comm types to run at CP > 1")
    parser.add_argument("--budget-gib", type=float, default=64.0,
                        help="activation memory per rank for the longest-sequence column")
    parser.add_argument("--flash-on-cpu", action="store_true",
                        help="the CP blocks on torch's CPU flash kernel instead of the math path")
    parser.add_argument("--math-chunk-mib", type=float, default=None,
                        help="context_parallel.MATH_BLOCK_BYTES in MiB (the math path's "
                             "query-row chunk budget)")
    parser.add_argument("--quick", action="store_true", help="s 512, 1 layer, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.layers, args.repeats = 512, 1, 1
    s, h, n = args.seq, args.hidden, args.layers
    hn = h // args.heads
    print(f"# {n} Llama-shaped layers, s={s} b=1 h={h} heads={args.heads} groups={args.groups} "
          f"ffn={args.ffn}; CP blocks on the {'flash kernel' if args.flash_on_cpu else 'math path'}"
          f" off CUDA; gloo, 1 thread per rank; load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores")
    print("| CP | comm type | kept MiB/rank | peak MiB/rank | step s | vs CP=1 step | sent "
          "KiB/layer/rank (measured) | formula | longest s in --budget-gib |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for cp in args.cp:
        by_rank = run_ranks(cp, _worker, args, timeout=3600)
        for i, row in enumerate(by_rank[0]):
            peak = max(rows[i]["peak"] for rows in by_rank)  # the fullest CP rank
            half = max(rows[i]["half_peak"] for rows in by_rank)
            base = base or row["seconds"]
            theory = formula_bytes(row["comm"], cp, s, 1, args.heads, args.groups, hn,
                                   row["elt"])
            longest = longest_sequence([(s // 2, half), (s, peak)], args.budget_gib * 2**30, cp)
            print(f"| {cp} | {row['comm']} | {row['kept'] / 2**20:.1f} | {peak / 2**20:.1f} | "
                  f"{row['seconds']:.3f} | {row['seconds'] / base:.2f}x | "
                  f"{row['sent'] / 1024:.0f} | {theory / 1024:.0f} | {longest} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
