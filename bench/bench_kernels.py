"""CPU fused kernels against PyTorch eager and torch.compile of the same eager code, same run.

    PYTHONPATH=. .venv/bin/python bench/bench_kernels.py [--seqs 512,1024] [--dtypes fp32,bf16]
        [--threads 2] [--reps 10] [--no-compile]
        [--kernels softmax,layer_norm,cross_entropy,bias_gelu,rms_norm]
        [--untuned-malloc] [--ce-seqs 512] [--rms-shapes 1024x512,4096x1024,...]

GPT-2-small shapes: batch 4, 12 heads, sequence 512 and 1024 (scores ``[4, 12, s, s]``); layer
norm over 768 on ``[s, 4, 768]``; cross entropy over the 50304-word vocabulary on ``[s, 4]``
tokens; bias + tanh GeLU on the MLP's ``[s, 4, 3072]`` with a ``[3072]`` bias. Each row times
forward + backward of the variants below, interleaved (one call of each per round, ``--reps``
rounds after two warm-up rounds, the median per variant), so that a load change on the machine
hits every variant alike. glibc's allocator gets the tuning
``pretrain_gpt.py`` applies on CPU (``--untuned-malloc`` leaves it), so that neither side pays
page faults for its fresh outputs every call, as in training:

* ``fused``: ``megatron.core.fusions`` (the C++ extension ``megatron.fused_kernels._cpu``);
* ``eager``: the PyTorch path the model runs without the fusion (causal: ``masked_fill`` with the
  materialised ``[s, s]`` mask, then ``softmax``; masked: the same with a ``[4, 1, s, s]`` padding
  mask; plain: ``softmax(x * scale)``; layer norm: ``F.layer_norm``; bias-GeLU:
  ``F.gelu(y + b, approximate="tanh")``, what the TorchScript fallback of ``--bias-gelu-fusion``
  also runs on CPU); half precision upcasts to
  fp32 for the softmax as ``--attention-softmax-in-fp32`` does, so both sides compute in fp32;
* ``compile``: ``torch.compile`` of the eager function (inductor's generated C++; skipped with
  ``--no-compile`` or when it fails here).

RMS norm has a table of its own, at the Llama-style models' ``[s * b, h]`` (``--rms-shapes``,
rows x h), with two PyTorch paths beside the kernel: ``megatron``, the model's PyTorch RMSNorm
(``rms_norm_reference``: fp32 upcast, ``x * rsqrt(mean(x^2) + eps)``, cast, ``* weight``), and
ATen's ``F.rms_norm``; the kernel is the default only where it beats the faster of the two.

"saved MiB" is what autograd keeps for the backward (counted with saved-tensor hooks, distinct
storages), the memory a fusion saves during training besides the forward's temporaries.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron.core.device import tune_host_allocator
from megatron.core.fusions import fused_softmax, kernels
from megatron.core.fusions.fused_bias_gelu import bias_gelu
from megatron.core.fusions.fused_layer_norm import fused_layer_norm, fused_rms_norm
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.transformer.layernorm import rms_norm_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def eager_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    scores = x.float() * scale if x.dtype != torch.float32 else x * scale
    if mask is not None:
        scores = scores.masked_fill(mask, -10000.0)
    return torch.softmax(scores, dim=-1).to(x.dtype)


def causal_mask(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for the backward of ``fn()``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def time_interleaved(fns: dict[str, Callable[..., torch.Tensor]], inputs: list[torch.Tensor],
                     grad: torch.Tensor, reps: int) -> dict[str, float]:
    """Median seconds of forward + backward of each of ``fns``, one call of each per round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(reps + 2):
        for name, fn in fns.items():
            for t in inputs:
                t.grad = None
            start = time.perf_counter()
            fn(*inputs).backward(grad)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def softmax_cases(s: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 12, s, s, generator=gen).to(dtype).requires_grad_(True)
    pad = torch.rand(4, 1, 1, s, generator=gen) < 0.1
    pad = pad.expand(4, 1, s, s).contiguous()
    causal = causal_mask(s)
    scale = 0.125
    return [
        ("scaled_upper_triang_masked_softmax", [x],
         lambda t: fused_softmax.fused_scale_mask_softmax(t, None, True, scale),
         lambda t: eager_softmax(t, causal, scale)),
        ("scaled_masked_softmax", [x],
         lambda t: fused_softmax.fused_scale_mask_softmax(t, pad, False, scale),
         lambda t: eager_softmax(t, pad, scale)),
        ("scaled_softmax", [x],
         lambda t: fused_softmax.fused_scale_mask_softmax(t, None, False, scale),
         lambda t: eager_softmax(t, None, scale)),
    ]


def layer_norm_case(s: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(s, 4, 768, generator=gen).to(dtype).requires_grad_(True)
    w = torch.ones(768, dtype=dtype).requires_grad_(True)
    b = torch.zeros(768, dtype=dtype).requires_grad_(True)
    return ("layer_norm (h 768)", [x, w, b],
            lambda x_, w_, b_: fused_layer_norm(x_, w_, b_, 1e-5),
            lambda x_, w_, b_: F.layer_norm(x_, (768,), w_, b_, 1e-5))


def cross_entropy_case(s: int, dtype: torch.dtype, vocab: int = 50304):
    """The loss on ``[s, 4]`` tokens, from the logits to their gradient (a new tensor on both
    sides: the model's in-place variant also saves that allocation)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(s, 4, vocab, generator=gen).to(dtype).requires_grad_(True)
    target = torch.randint(0, vocab, (s, 4), generator=gen)

    def fused(t):
        return vocab_parallel_cross_entropy(t, target, None, loss_dtype=torch.float32,
                                            fused=True)

    def eager(t):
        return F.cross_entropy(t.float().view(-1, vocab), target.view(-1),
                               reduction="none").view(s, 4)

    return (f"cross_entropy (V {vocab})", [x], fused, eager)


def bias_gelu_cases(s: int, dtype: torch.dtype):
    """The MLP's bias + GeLU; a second row sums the bias gradient with autograd's ``.sum``
    after the kernel instead of inside it (the choice fused_bias_gelu.py made, measured)."""
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(s, 4, 3072, generator=gen).to(dtype).requires_grad_(True)
    b = torch.randn(3072, generator=gen).to(dtype).requires_grad_(True)

    def eager(y_, b_):
        return F.gelu(y_ + b_, approximate="tanh")

    return [("bias_gelu (f 3072)", [y, b], bias_gelu, eager),
            ("bias_gelu, grad_bias by .sum", [y, b], _BiasGeLUSumAfter.apply, eager)]


class _BiasGeLUSumAfter(torch.autograd.Function):
    """The kernel without its in-loop bias-gradient sum; autograd reduces grad_y afterwards."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, b)
        return kernels.extension("cpu").bias_gelu_forward(y, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, b = ctx.saved_tensors
        grad_y, _ = kernels.extension("cpu").bias_gelu_backward(grad.contiguous(), y, b,
                                                                sum_bias=False)
        return grad_y, grad_y.sum(tuple(range(grad_y.dim() - 1)))


def bench_case(name, inputs, fused, eager, reps, use_compile, label) -> list[str]:
    grad = torch.randn_like(fused(*inputs))
    fns = {"fused": fused, "eager": eager}
    compiled = "n/a"
    if use_compile:
        try:
            fn = torch.compile(eager, dynamic=False)
            fn(*inputs).backward(grad)  # compile outside the timed rounds
            fns["compile"] = fn
        except Exception as exc:  # no compiler, unsupported op: say so, keep the row
            compiled = f"failed ({type(exc).__name__})"
    row = time_interleaved(fns, inputs, grad, reps)
    if "compile" in row:
        compiled = f"{row['compile'] * 1e3:.1f}"
    mib = 1 / 2**20
    saved_fused = saved_bytes(lambda: fused(*inputs)) * mib
    saved_eager = saved_bytes(lambda: eager(*inputs)) * mib
    speedup = row["eager"] / row["fused"]
    vs_compile = f"{row['compile'] / row['fused']:.2f}x" if "compile" in row else "n/a"
    return [f"| {name} | {label} | {row['fused'] * 1e3:.1f} | {row['eager'] * 1e3:.1f} | "
            f"{compiled} | {speedup:.2f}x | {vs_compile} | {saved_fused:.0f} | {saved_eager:.0f} |"]


RMS_EPS = 1e-5


def rms_norm_row(rows: int, h: int, dname: str, reps: int, use_compile: bool) -> str:
    """One row of the RMS-norm table: the kernel, Megatron's PyTorch RMSNorm and F.rms_norm
    (and torch.compile of the first), forward + backward, interleaved."""
    dtype = DTYPES[dname]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, h, generator=gen).to(dtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).requires_grad_(True)
    grad = torch.randn(rows, h, generator=gen).to(dtype)

    def megatron(x_, w_):
        return rms_norm_reference(x_, w_, RMS_EPS)

    fns = {"fused": lambda x_, w_: fused_rms_norm(x_, w_, RMS_EPS), "megatron": megatron,
           "aten": lambda x_, w_: F.rms_norm(x_, (h,), w_, RMS_EPS)}
    if fns["fused"](x, w) is None:
        raise SystemExit("the RMS-norm kernel did not run (not in kernels.FASTER_THAN_PYTORCH "
                         "or an extension built before it): rebuild, or add it to time it")
    compiled = "n/a"
    if use_compile:
        try:
            torch._dynamo.reset()  # every row compiles anew (else dynamo's recompile limit)
            fn = torch.compile(megatron, dynamic=False)
            fn(x, w).backward(grad)
            fns["compile"] = fn
        except Exception as exc:  # no compiler here: say so, keep the row
            compiled = f"failed ({type(exc).__name__})"
    t = time_interleaved(fns, [x, w], grad, reps)
    if "compile" in t:
        compiled = f"{t['compile'] * 1e3:.2f}"
    best = min(t["megatron"], t["aten"])
    return (f"| [{rows}, {h}] | {dname} | {t['fused'] * 1e3:.2f} | {t['megatron'] * 1e3:.2f} | "
            f"{t['aten'] * 1e3:.2f} | {compiled} | {t['megatron'] / t['fused']:.2f}x | "
            f"{t['aten'] / t['fused']:.2f}x | {best / t['fused']:.2f}x |")


def rms_norm_table(args) -> None:
    print(f"\n# RMS norm, load average {os.getloadavg()[0]:.1f}; ms, forward + backward, median "
          f"of {args.reps} interleaved rounds")
    print("| rows, h | dtype | fused | megatron (PyTorch) | F.rms_norm | compile | "
          "vs megatron | vs F.rms_norm | vs faster PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.rms_shapes.split(","):
        rows, h = (int(v) for v in shape.split("x"))
        for dname in args.dtypes.split(","):
            print(rms_norm_row(rows, h, dname, args.reps, not args.no_compile), flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="512,1024")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--kernels",
                        default="softmax,layer_norm,cross_entropy,bias_gelu,rms_norm")
    # The loss at GPT-2-small's training shape (mb 4 x seq 512 = 2048 tokens) only by default:
    # at s = 1024 the fp32 logits and their gradients alone take 3.3 GB on each side.
    parser.add_argument("--ce-seqs", default="512")
    # RMS norm's rows x h: the Llama-style models' [s * b, h] (h 512-2048, 1k-16k tokens).
    parser.add_argument("--rms-shapes",
                        default="1024x512,4096x512,4096x1024,16384x1024,4096x2048,16384x2048")
    parser.add_argument("--untuned-malloc", action="store_true",
                        help="leave glibc's allocator as it is (fresh pages every call)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tuned = False if args.untuned_malloc else tune_host_allocator()
    if kernels.extension("cpu") is None:
        raise SystemExit("megatron.fused_kernels._cpu is not built: run scripts/bootstrap.sh")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; allocator tuned: {tuned}; load average "
          f"{os.getloadavg()[0]:.1f}; times in ms, forward + backward")
    wanted = args.kernels.split(",")
    if wanted != ["rms_norm"]:
        print("| kernel | shape, dtype | fused | eager | compile | fused vs eager | "
              "fused vs compile | saved MiB fused | saved MiB eager |")
        print("|---|---|---|---|---|---|---|---|---|")
    for s in (int(v) for v in args.seqs.split(",")):
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            cases = (softmax_cases(s, dtype) if "softmax" in wanted else []) + \
                ([layer_norm_case(s, dtype)] if "layer_norm" in wanted else []) + \
                ([cross_entropy_case(s, dtype)] if "cross_entropy" in wanted and
                 str(s) in args.ce_seqs.split(",") else []) + \
                (bias_gelu_cases(s, dtype) if "bias_gelu" in wanted else [])
            for name, inputs, fused, eager in cases:
                label = f"s={s}, {dname}"
                for line in bench_case(name, inputs, fused, eager, args.reps,
                                       not args.no_compile, label):
                    print(line, flush=True)
    if "rms_norm" in wanted:
        rms_norm_table(args)


if __name__ == "__main__":
    main()
