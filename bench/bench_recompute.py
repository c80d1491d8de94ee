"""What activation recomputation buys on one pipeline stage: activation memory and step time.

One pipeline stage of GPT-2 small (h 768, 12 heads, s 1024, micro-batch 1; 12 layers / PP 4 =
3 layers per stage) in bf16 with dropout 0.1 (the masks are part of the theory), run forward and
backward with ``--recompute-granularity`` none, ``selective`` and ``full`` (``uniform``, 1 layer).
The stage's transformer layers are this framework's (``megatron.core.transformer.block``), built
from a ``TransformerConfig`` as pretrain does.

Activation memory is what the forward keeps for the backward: every tensor autograd saves
(``torch.autograd.graph.saved_tensors_hooks``), counted once per storage, parameters excluded,
summed at the end of the forward. That is the quantity of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models"), per layer in 16-bit:

    none        s*b*h*(34 + 5*a*s/h)   bytes
    selective   s*b*h*34               (the attention scores, softmax and its dropout mask dropped)
    full        2*s*b*h                (only the layer input kept)

It is measured on the device-independent autograd graph, so the figures are the same on CPU and
GPU for the same kernels; with ``--attention-backend unfused`` (Megatron's ``CoreAttention``,
which the theory describes) and with SDPA (with attention dropout on, torch 2.13 runs SDPA's math
kernel on CPU, which keeps fp32 scores and probabilities: more than the unfused path; its flash
kernel, chosen without dropout, keeps no ``a*s*s`` tensor at all). The step time (forward +
backward of the stage, median of ``--repeats``) is measured in the same run, for each setting:
on an idle machine only (the script prints the load average).

Run (a few minutes on 2 CPU cores; bf16 GEMMs are slow on CPUs without AMX)::

    PYTHONPATH=. .venv/bin/python bench/bench_recompute.py            # GPT-2 small stage
    PYTHONPATH=. .venv/bin/python bench/bench_recompute.py --quick    # s 256, 1 layer: seconds
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

from megatron.core.tensor_parallel.random import model_parallel_manual_seed  # noqa: E402
from megatron.core.transformer.block import TransformerBlock  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402

SETTINGS = {"none": {}, "selective": {"recompute_granularity": "selective"},
            "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                     "recompute_num_layers": 1}}


def theory_bytes_per_layer(setting: str, s: int, b: int, h: int, a: int) -> float:
    """Korthikanti et al. 2022, 16-bit activations, no tensor or sequence parallelism."""
    if setting == "none":
        return s * b * h * (34 + 5 * a * s / h)
    if setting == "selective":
        return s * b * h * 34
    return 2 * s * b * h


class SavedTensorMeter:
    """Bytes autograd keeps for the backward, each storage once, ``skip`` (parameters) not."""

    def __init__(self, skip: list[torch.Tensor]) -> None:
        self.skip = {t.untyped_storage().data_ptr() for t in skip}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def build_stage(setting: str, args) -> TransformerBlock:
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        params_dtype=torch.bfloat16, hidden_dropout=0.1, attention_dropout=0.1,
        attention_backend=args.attention_backend, **SETTINGS[setting])
    torch.manual_seed(0)
    model_parallel_manual_seed(0, 0)  # the TP stream attention dropout draws from
    # A middle stage: its input comes from the previous stage, no embedding, no final norm.
    return TransformerBlock(config, None, pre_process=False, post_process=False)


def measure(setting: str, args) -> tuple[int, float]:
    """(activation bytes kept by the forward, median step seconds) of one stage."""
    stage = build_stage(setting, args)
    stage.train()
    shape = (args.seq, args.micro_batch, args.hidden)  # [s, b, h]
    times, kept = [], 0
    for _ in range(args.repeats):
        x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
        stage.set_input_tensor(x)
        meter = SavedTensorMeter(list(stage.parameters()))
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            out = stage(None, None)  # causal attention without an explicit mask
        kept = meter.total
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
    return kept, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3, help="layers on the stage")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="s 256, 1 layer, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.layers, args.repeats = 256, 1, 1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    s, b, h, a, n = args.seq, args.micro_batch, args.hidden, args.heads, args.layers
    print(f"# one stage: {n} layers, s={s} b={b} h={h} a={a}, bf16, dropout 0.1; "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}")
    print("| attention | recompute | kept MiB (measured) | kept MiB (theory) | measured/theory "
          "| step s | step vs none |")
    print("|---|---|---|---|---|---|---|")
    for backend in ("unfused", "sdpa"):
        args.attention_backend = "unfused" if backend == "unfused" else "auto"
        base = None
        for setting in SETTINGS:
            kept, seconds = measure(setting, args)
            theory = n * theory_bytes_per_layer(setting, s, b, h, a)
            base = base or seconds
            print(f"| {backend} | {setting} | {kept / 2**20:.1f} | {theory / 2**20:.1f} | "
                  f"{kept / theory:.2f} | {seconds:.3f} | {seconds / base:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
