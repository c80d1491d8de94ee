"""Every compiled fused kernel of one device against float64, forward and backward, in fp32,
fp16 and bf16, and its speed against PyTorch eager and ``torch.compile`` of the same eager code.

    python bench/check_kernels.py [--device cuda|cpu] [--reps 20] [--no-compile] [--small]
        [--json FILE]

The kernels are called through the extension directly (``megatron.fused_kernels._cuda`` or
``_cpu``), whether or not the model's defaults use them (``kernels.FASTER_THAN_PYTORCH``): this
is where those defaults are decided. A kernel passes when its error against a float64
reference is at most twice eager's own error in the same dtype (plus a tiny absolute floor).
Timings are forward + backward, medians over ``--reps`` after warm-up, between device
synchronisations; ``x eager`` > 1 means the kernel is faster. Layer norm also shows the
achieved GB/s (x, dy read; y, dx written: the memory floor) beside a device copy's.

Shapes are the models': GPT-2-small attention scores ``[4, 12, 1024, 1024]`` and layer norm
``[16384, 768]`` and ``[8192, 2048]`` (1.3B); RMS norm (Llama-style) ``[16384, 1024]``,
``[8192, 2048]`` and ``[8192, 4096]``, twice each: against Megatron's PyTorch RMSNorm (the model's
fallback, ``rms_norm_reference``) and against ATen's ``F.rms_norm`` (fused on CUDA), since the
kernel is worth enabling only where it beats both; ``--small`` shrinks them for a CPU smoke test.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.core import device  # noqa: E402
from megatron.core.fusions import kernels  # noqa: E402
from megatron.core.fusions.fused_layer_norm import (_FusedLayerNormAffine,  # noqa: E402
                                                    _FusedRMSNorm)
from megatron.core.fusions.fused_softmax import _ScaledSoftmax  # noqa: E402
from megatron.core.transformer.layernorm import rms_norm_reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def sync(dev: str) -> None:
    if dev == "cuda":
        device.synchronize()


def eager_softmax(x, mask, scale):
    # Half precision computes in fp32 (as --attention-softmax-in-fp32); the reference in fp64.
    scores = (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, -10000.0)
    return torch.softmax(scores, dim=-1).to(x.dtype)


def eager_layer_norm(x, w, b, eps=1e-5):
    return F.layer_norm(x, (x.size(-1),), w, b, eps)


def aten_rms_norm(x, w, eps=1e-5):
    return F.rms_norm(x, (x.size(-1),), w, eps)


def fwd_bwd(fn: Callable, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """Outputs and input gradients of ``fn(*inputs)`` under ``grad``."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves if t.grad is not None]


def max_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Largest error relative to each reference tensor's largest magnitude."""
    worst = 0.0
    for g, r in zip(got, ref):
        scale = float(r.abs().max()) or 1.0
        worst = max(worst, float((g.double() - r).abs().max()) / scale)
    return worst


def median_ms(fn: Callable, inputs, grad, reps: int, dev: str) -> float:
    for _ in range(3):
        fwd_bwd(fn, inputs, grad)
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fwd_bwd(fn, inputs, grad)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def cases(ext, dev: str, dtype: torch.dtype, small: bool):
    """(name, fused fn, eager fn, inputs, grad, bytes moved by fwd+bwd or None)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    b, np_, s = (2, 4, 128) if small else (4, 12, 1024)
    scale = 1.0 / math.sqrt(64)
    scores = torch.randn(b, np_, s, s, generator=gen, device=dev).mul_(4).to(dtype)
    dy = torch.randn(b, np_, s, s, generator=gen, device=dev).to(dtype)
    causal = torch.ones(s, s, dtype=torch.bool, device=dev).triu(1).view(1, 1, s, s)
    pad = torch.zeros(b, 1, s, s, dtype=torch.bool, device=dev)
    pad[:, :, :, s - s // 4:] = True  # the last quarter of the keys is padding
    yield ("softmax_causal", lambda x: _ScaledSoftmax.apply(ext, "causal", x, None, scale),
           lambda x: eager_softmax(x, causal, scale), [scores], dy, None)
    yield ("softmax_masked", lambda x: _ScaledSoftmax.apply(ext, "masked", x, pad, scale),
           lambda x: eager_softmax(x, pad, scale), [scores], dy, None)
    yield ("softmax_plain", lambda x: _ScaledSoftmax.apply(ext, "plain", x, None, scale),
           lambda x: eager_softmax(x, None, scale), [scores], dy, None)
    for rows, h in ([(256, 768)] if small else [(16384, 768), (8192, 2048)]):
        x = torch.randn(rows, h, generator=gen, device=dev).to(dtype)
        w = (1 + 0.1 * torch.randn(h, generator=gen, device=dev)).to(dtype)
        bias = (0.1 * torch.randn(h, generator=gen, device=dev)).to(dtype)
        g = torch.randn(rows, h, generator=gen, device=dev).to(dtype)
        moved = 4 * rows * h * x.element_size()  # read x, dy; write y, dx
        yield (f"layer_norm[{rows},{h}]",
               lambda x_, w_, b_: _FusedLayerNormAffine.apply(ext, x_, w_, b_, 1e-5),
               eager_layer_norm, [x, w, bias], g, moved)
    if not hasattr(ext, "rms_norm_forward"):  # an extension built before the kernel
        return
    for rows, h in ([(256, 512)] if small else [(16384, 1024), (8192, 2048), (8192, 4096)]):
        x = torch.randn(rows, h, generator=gen, device=dev).to(dtype)
        w = (1 + 0.1 * torch.randn(h, generator=gen, device=dev)).to(dtype)
        g = torch.randn(rows, h, generator=gen, device=dev).to(dtype)
        moved = 4 * rows * h * x.element_size()  # read x, dy; write y, dx
        for suffix, eager in (("", lambda x_, w_: rms_norm_reference(x_, w_, 1e-5)),
                              (" vs F.rms_norm", aten_rms_norm)):
            yield (f"rms_norm[{rows},{h}]{suffix}",
                   lambda x_, w_: _FusedRMSNorm.apply(ext, x_, w_, 1e-5), eager, [x, w], g,
                   moved)


def fusion_checks(dev: str, small: bool, reps: int) -> list[dict]:
    """The two fusions that are PyTorch code rather than extension kernels: the compiled cross
    entropy (``fusions/fused_cross_entropy.py``) against the unfused path, and the fp32
    weight-gradient accumulation (``tensor_parallel/layers.py``) against ``mm`` then ``add_``;
    each against float64, and timed (forward + backward for the loss)."""
    from megatron.core.fusions import fused_cross_entropy
    from megatron.core.tensor_parallel import cross_entropy, layers

    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    tokens, vocab = (256, 4096) if small else (16384, 50304)
    logits = (4 * torch.randn(tokens, vocab, generator=gen, device=dev)).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), generator=gen, device=dev)
    grad = torch.rand(tokens, generator=gen, device=dev)
    compiled = fused_cross_entropy.CompiledKernels()

    def via(provider):
        def loss_fn(x):
            return fused_cross_entropy._FusedVocabParallelCrossEntropy.apply(
                provider, x, target, None, 0.0, False)
        return loss_fn

    def unfused(x):
        return cross_entropy.vocab_parallel_cross_entropy(x, target, None, fused=False,
                                                          loss_dtype=torch.float32)

    ref = fwd_bwd(unfused, [logits.double()], grad.double())
    row = {"kernel": "cross_entropy(compiled)", "dtype": "bf16", "used": dev == "cuda",
           "err": max_error(fwd_bwd(via(compiled), [logits], grad), ref),
           "eager_err": max_error(fwd_bwd(unfused, [logits], grad), ref)}
    row["ok"] = row["err"] <= 2 * row["eager_err"] + torch.finfo(torch.bfloat16).eps
    row["fused_ms"] = median_ms(via(compiled), [logits], grad, reps, dev)
    row["eager_ms"] = median_ms(unfused, [logits], grad, reps, dev)
    rows.append(row)
    n, k = (256, 512) if small else (3072, 16384)
    a = torch.randn(n, k, generator=gen, device=dev).to(torch.bfloat16)
    b = torch.randn(k, 768, generator=gen, device=dev).to(torch.bfloat16)
    start = torch.randn(n, 768, generator=gen, device=dev)
    want = start.double() + a.double() @ b.double()
    fused_out = start.clone()
    used = layers._accumulate_in_fp32(fused_out, a, b)
    eager_out = start.clone().add_(a.mm(b))
    row = {"kernel": "wgrad_accumulate_fp32", "dtype": "bf16", "used": used,
           "err": float((fused_out.double() - want).abs().max() / want.abs().max())
           if used else float("nan"),
           "eager_err": float((eager_out.double() - want).abs().max() / want.abs().max())}
    row["ok"] = (not used) or row["err"] <= 2 * row["eager_err"] + 1e-6

    def timed(fn):
        for _ in range(3):
            fn()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(dev)
        return 1000 * (time.perf_counter() - t0) / reps
    row["fused_ms"] = timed(lambda: layers._accumulate_in_fp32(fused_out, a, b)) if used \
        else float("nan")
    row["eager_ms"] = timed(lambda: eager_out.add_(a.mm(b)))
    rows.append(row)
    for r in rows:
        print(format_row(r), flush=True)
    return rows


def copy_gbps(dev: str, small: bool) -> float:
    """Bytes read + written per second by a device copy of 1 GiB (256 MiB with --small)."""
    n = (64 if small else 256) * 2**20
    src = torch.empty(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(dev)
    return 2 * 4 * n * 10 / (time.perf_counter() - t0) / 1e9


def check(ext, dev: str, small: bool, reps: int, use_compile: bool,
          compile_dtypes: set[str]) -> list[dict]:
    rows = []
    for dname, dtype in DTYPES.items():
        for name, fused, eager, inputs, grad, moved in cases(ext, dev, dtype, small):
            ref = fwd_bwd(eager, [t.double() for t in inputs], grad.double())
            err_fused = max_error(fwd_bwd(fused, inputs, grad), ref)
            err_eager = max_error(fwd_bwd(eager, inputs, grad), ref)
            # Correct to rounding: within twice eager's error plus one ulp of the dtype (a
            # backward from the rounded output differs from eager's by about that).
            ok = err_fused <= 2 * err_eager + torch.finfo(dtype).eps
            row = {"kernel": name, "dtype": dname, "ok": ok, "err": err_fused,
                   "eager_err": err_eager, "used": kernels.FASTER_THAN_PYTORCH.get(
                       dev, frozenset()).__contains__(name.split("[")[0])}
            row["fused_ms"] = median_ms(fused, inputs, grad, reps, dev)
            row["eager_ms"] = median_ms(eager, inputs, grad, reps, dev)
            if use_compile and dname in compile_dtypes:
                try:
                    row["compile_ms"] = median_ms(torch.compile(eager, dynamic=False), inputs,
                                                  grad, reps, dev)
                except Exception as exc:  # noqa: BLE001 - report, keep checking the others
                    row["compile_error"] = f"{type(exc).__name__}: {exc}"[:200]
            if moved is not None:
                row["fused_GBps"] = moved / row["fused_ms"] / 1e6
                row["eager_GBps"] = moved / row["eager_ms"] / 1e6
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    text = (f"{row['kernel']:<36} {row['dtype']:<5} {'ok ' if row['ok'] else 'BAD'} "
            f"{'used  ' if row['used'] else 'unused'} "
            f"err {row['err']:.1e} (eager {row['eager_err']:.1e})  fused {row['fused_ms']:.3f} ms"
            f"  eager {row['eager_ms']:.3f} ms  x eager {row['eager_ms'] / row['fused_ms']:.2f}")
    if "compile_ms" in row:
        text += f"  compile {row['compile_ms']:.3f} ms  x compile " \
                f"{row['compile_ms'] / row['fused_ms']:.2f}"
    if "fused_GBps" in row:
        text += f"  GB/s fused {row['fused_GBps']:.0f} eager {row['eager_GBps']:.0f}"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=device.get_device().type,
                        choices=["cuda", "cpu"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--compile-dtypes", default="bf16",
                        help="dtypes to time torch.compile in (each case compiles anew)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    name = f"megatron.fused_kernels._{args.device}"
    try:
        ext = importlib.import_module(name)
    except ImportError as exc:
        print(f"SKIP: {name} is not built ({exc})")
        return 0
    copy = copy_gbps(args.device, args.small)
    print(f"device copy: {copy:.0f} GB/s (read + write)", flush=True)
    rows = check(ext, args.device, args.small, args.reps, not args.no_compile,
                 set(args.compile_dtypes.split(",")))
    rows += fusion_checks(args.device, args.small, args.reps)
    bad = [f"{r['kernel']} {r['dtype']}" for r in rows if not r["ok"]]
    slower = [f"{r['kernel']} {r['dtype']}" for r in rows if r["fused_ms"] > r["eager_ms"]]
    # A kernel the defaults do not use on this device (kernels.FASTER_THAN_PYTORCH) is still
    # checked and reported, but only a used one fails the check.
    used_bad = [r for r in rows if not r["ok"] and r["used"]]
    used_slower = [r for r in rows if r["used"] and r["fused_ms"] > r["eager_ms"]]
    print(f"summary: {len(rows) - len(bad)}/{len(rows)} correct "
          f"(wrong: {', '.join(bad) or 'none'}); slower than eager: {', '.join(slower) or 'none'}"
          f"; used by default and wrong or slower: {len(used_bad) + len(used_slower)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "copy_GBps": copy, "rows": rows}, f, indent=1)
    # --small shapes (a smoke test) are too small for timings to decide anything.
    return 1 if used_bad or (used_slower and not args.small) else 0


if __name__ == "__main__":
    sys.exit(main())
