"""Training speed on one GPU: ours against plain PyTorch and plain + ``torch.compile``, one process.

    python bench/gpu_speed.py --shape gpt2 [--sides plain,compile,ours-compiled,ours,ours-noext]
        [--warmup 5] [--steps 20] [--profile FILE] [--json FILE] [--ours-args "..."]

Shapes (bf16, vocabulary 50304, the GPU-speed issue's): ``gpt2`` = 12 x 768, 12 heads, seq 1024,
micro-batch 16; ``1.3b`` = 24 x 2048, 16 heads, seq 2048, micro-batch 4; ``small`` = 2 x 256
(a smoke test, also on the CPU). Llama-style shapes (RoPE, RMSNorm, SwiGLU, grouped-query
attention, no biases, untied output: ``bench/bench_llama.py``'s flags): ``llama-1b`` = 16 x 2048,
16 heads in 4 groups, ffn 5632, seq 2048, micro-batch 4 (0.93B parameters); ``llama-small``
(the smoke test). A Llama shape's sides are ``ours``, ``ours-compiled`` and ``hf``
(transformers' ``LlamaForCausalLM`` of the same shape: SDPA, fp32 weights under autocast bf16 as
``plain``, the same fused AdamW and clip 1.0). Mixtral shapes are Llama shapes with 8 routed
SwiGLU experts, top-2, in every layer (``--moe-grouped-gemm``, the alltoall dispatcher, no
balancing loss), against transformers' ``MixtralForCausalLM``: ``mixtral-small`` = 8 x 1024, 16
heads in 4 groups, expert ffn 3584, seq 2048, micro-batch 4 (0.83B parameters, 0.30B active);
``mixtral-tiny`` (the smoke test, 4 experts). Their MFU counts the active parameters (a token's
two experts). GPT shapes' sides:

* ``plain``: ``bench/plain_gpt.py`` (nanoGPT style: autocast bf16, SDPA, fused AdamW, clip 1.0);
* ``compile``: the same model under ``torch.compile`` (its compile time is the first step's);
* ``ours``: ``pretrain_gpt.py``'s own pieces and the trainer's ``train_step`` (mock data,
  ``--bf16``: bf16 parameters with fp32 main weights and gradients, as Megatron);
* ``ours-compiled``: ours with ``--compile-layers`` (every transformer layer through
  ``torch.compile``), a model of its own, built after the previous side's is freed; its compile
  time is the first step's less a timed step's;
* ``ours-noext``: the same model with the compiled fused-kernel extension hidden (the PyTorch
  path: what an install without the extension runs);
* ``ours-unfused-ce``: the same model with the compiled cross entropy off
  (``MEGATRON_COMPILED_CROSS_ENTROPY=0``: the loss's unfused PyTorch path), to show its share.

``ours-noext`` and ``ours-unfused-ce`` reuse ``ours``'s model (one build); ``ours-noext`` hides
the extension for good, so it comes last. Every step is timed between two device
synchronisations; the figures are medians of ``--steps`` after ``--warmup``. MFU is 6 N tokens/s
over the bf16 peak given by ``--peak-tflops`` (790: an H200's measured 8192^3 bf16 matmul); N
excludes position embeddings. On a CPU (the smoke tests) every side runs in fp32: without
AVX-512 BF16 a bf16 GEMM there is a reference loop (a [2048, 50304] x [50304, 256] product takes
minutes), and the CPU run checks shapes and plumbing, not speed. ``--profile`` writes
torch.profiler's top device kernels of one step of each side.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import statistics
import sys
import time
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import bench_train  # noqa: E402
import plain_gpt  # noqa: E402

from megatron.core import device  # noqa: E402

# bf16 on an accelerator; fp32 on a CPU, where a bf16 GEMM is a reference loop (module docstring).
BF16 = device.accelerator_available()

VOCAB = 50304
# Sides whose first step compiles their model: the printed line gives the compile time.
COMPILING_SIDES = ("compile", "ours-compiled")
SHAPES = {
    "small": bench_train.Shape("small", 2, 256, 8, 256, 8, warmup=2, steps=3),
    "gpt2": bench_train.Shape("gpt2", 12, 768, 12, 1024, 16, warmup=5, steps=20),
    "1.3b": bench_train.Shape("1.3b", 24, 2048, 16, 2048, 4, warmup=3, steps=10),
    "llama-small": bench_train.Shape("llama-small", 2, 128, 4, 128, 4, warmup=2, steps=3),
    "llama-1b": bench_train.Shape("llama-1b", 16, 2048, 16, 2048, 4, warmup=3, steps=10),
    "mixtral-small": bench_train.Shape("mixtral-small", 8, 1024, 16, 2048, 4, warmup=3,
                                       steps=10),
    "mixtral-tiny": bench_train.Shape("mixtral-tiny", 2, 64, 4, 64, 2, warmup=1, steps=2),
}


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """What a Llama-style shape adds to bench_train's: key/value groups and the SwiGLU width."""

    groups: int
    ffn: int
    """The SwiGLU width (of each routed expert with ``experts``)."""
    experts: int = 0
    """Routed experts in every layer's MLP (Mixtral-style MoE); 0: a dense MLP."""
    topk: int = 2


LLAMA = {"llama-small": LlamaShape(groups=2, ffn=352),
         "llama-1b": LlamaShape(groups=4, ffn=5632),
         "mixtral-small": LlamaShape(groups=4, ffn=3584, experts=8),
         "mixtral-tiny": LlamaShape(groups=2, ffn=128, experts=4)}
SIDES = {"gpt": ("plain", "compile", "ours", "ours-compiled", "ours-noext", "ours-unfused-ce"),
         "llama": ("ours", "ours-compiled", "hf")}


@dataclasses.dataclass
class Side:
    step: Callable[[], None]
    n_params: int
    first_step_s: float = 0.0
    active_params: int | None = None
    """Parameters one token goes through (MoE: its top-k experts), for MFU; None: all."""


def plain_side(shape: bench_train.Shape, compiled: bool) -> Side:
    dev = device.get_device()
    torch.manual_seed(0)
    cfg = plain_gpt.GPTConfig(shape.layers, shape.hidden, shape.heads, shape.seq, VOCAB)
    model = plain_gpt.GPT(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    opt = plain_gpt.configure_adamw(model)
    run = torch.compile(model) if compiled else model

    def step():
        data = torch.randint(0, VOCAB, (shape.mb, shape.seq + 1), device=dev)
        plain_gpt.train_step(run, opt, data[:, :-1], data[:, 1:], BF16)

    return Side(step, n_params)


def ours_side(shape: bench_train.Shape, extra: list[str]) -> Side:
    sys.path.insert(0, ROOT)
    import profile_train

    step = profile_train.ours_step(shape, BF16, ["--distributed-backend",
                                                 device.default_backend(),
                                                 *extra])
    if shape.name in LLAMA:
        return Side(step, llama_parameters(shape), active_params=llama_parameters(shape, True))
    h, layers = shape.hidden, shape.layers
    n_params = VOCAB * h + layers * (12 * h * h + 13 * h) + 2 * h
    return Side(step, n_params)


def llama_flags(shape: bench_train.Shape) -> list[str]:
    """The pretrain_gpt.py flags of a Llama-style shape (bench_llama.py's); a Mixtral shape's
    MoE flags as examples/pretrain_mixtral.sh sets them (no balancing loss: HF's Mixtral adds
    none unless asked for router logits)."""
    import bench_llama

    llama = LLAMA[shape.name]
    flags = bench_llama.llama_flags(argparse.Namespace(ffn=llama.ffn, groups=llama.groups))
    if llama.experts:
        flags += ["--num-experts", str(llama.experts), "--moe-router-topk", str(llama.topk),
                  "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
                  "--moe-router-load-balancing-type", "none"]
    return flags


def llama_parameters(shape: bench_train.Shape, active: bool = False) -> int:
    """Parameters of a Llama-style shape: q, k/v of the groups, output, SwiGLU's three
    matrices (each expert's and the router with experts), two norms a layer; untied embedding
    and output layer, the final norm. ``active``: a token's top-k experts only."""
    h, head = shape.hidden, shape.hidden // shape.heads
    llama = LLAMA[shape.name]
    mlp = 3 * h * llama.ffn
    if llama.experts:
        mlp = mlp * (llama.topk if active else llama.experts) + llama.experts * h
    layer = h * (h + 2 * llama.groups * head) + h * h + mlp + 2 * h
    return shape.layers * layer + 2 * VOCAB * h + h


def hf_llama_side(shape: bench_train.Shape) -> Side:
    """transformers' LlamaForCausalLM of a Llama shape, trained as ``plain`` trains (fp32
    weights, autocast bf16, fused AdamW, clip 1.0)."""
    import transformers

    transformers.logging.set_verbosity_error()
    dev, llama = device.get_device(), LLAMA[shape.name]
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=shape.hidden, intermediate_size=llama.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=llama.groups, max_position_embeddings=shape.seq, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_dropout=0.0, attn_implementation="sdpa")
    if llama.experts:
        config = transformers.MixtralConfig(**common, num_local_experts=llama.experts,
                                            num_experts_per_tok=llama.topk,
                                            output_router_logits=False)
        model = transformers.MixtralForCausalLM(config).to(dev).train()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).to(dev).train()
    opt = plain_gpt.configure_adamw(model)

    def step():
        data = torch.randint(0, VOCAB, (shape.mb, shape.seq), device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=BF16):
            loss = model(input_ids=data, labels=data).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Side(step, sum(p.numel() for p in model.parameters()),
                active_params=llama_parameters(shape, True) if llama.experts else None)


def hide_extension() -> None:
    """Make the fused-kernel extension of this device look unbuilt from now on."""
    from megatron.core.fusions import kernels

    kernels._loaded[device.get_device().type] = None


def time_side(side: Side, warmup: int, steps: int) -> dict:
    if device.accelerator_available():
        torch.cuda.reset_peak_memory_stats()  # cuda-only
    device.synchronize()
    t0 = time.perf_counter()
    side.step()
    device.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        side.step()
    times = []
    for _ in range(steps):
        device.synchronize()
        t0 = time.perf_counter()
        side.step()
        device.synchronize()
        times.append(time.perf_counter() - t0)
    peak_mib = device.memory_stats().get("mem-max-allocated-MiB")
    peak = None if peak_mib is None else peak_mib / 1024
    median = statistics.median(times)
    return {"ms": 1000 * median, "first_step_s": first, "compile_s": first - median,
            "peak_GiB": peak, "spread_ms": [1000 * min(times), 1000 * max(times)]}


def release(side: Side) -> None:
    """Free a side's model and optimizer before the next side builds its own (two 1.3B models
    with their fp32 main weights and Adam state do not fit an 80 GB card together)."""
    del side.step
    gc.collect()  # whatever reference cycles the side's objects still make
    device.empty_cache()


def profile_table(side: Side, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    sort = "self_cpu_time_total"
    if device.accelerator_available():
        activities.append(ProfilerActivity.CUDA)
        sort = "self_cuda_time_total"
    with profile(activities=activities) as prof:
        side.step()
        device.synchronize()
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="gpt2", choices=sorted(SHAPES))
    parser.add_argument("--sides", default="plain,compile,ours,ours-noext")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--ours-args", default="", help="extra pretrain_gpt.py flags for ours")
    parser.add_argument("--profile", default=None, help="write one profiled step per side here")
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    warmup = args.warmup if args.warmup is not None else shape.warmup
    steps = args.steps if args.steps is not None else shape.steps
    tokens = shape.mb * shape.seq
    sides = [s for s in args.sides.split(",") if s]
    arch = "llama" if shape.name in LLAMA else "gpt"
    unknown = set(sides) - set(SIDES[arch])
    if unknown:
        parser.error(f"--sides: {sorted(unknown)} not sides of --shape {shape.name} "
                     f"(its sides: {', '.join(SIDES[arch])})")
    ours_args = shlex.split(args.ours_args) + (llama_flags(shape) if arch == "llama" else [])
    results, tables = {}, []
    ours = None
    for name in sides:
        if name == "hf":
            side = hf_llama_side(shape)
        elif name in ("plain", "compile"):
            side = plain_side(shape, compiled=name == "compile")
        elif name == "ours-compiled":
            os.environ["MEGATRON_COMPILED_CROSS_ENTROPY"] = "1"
            side = ours_side(shape, [*ours_args, "--compile-layers"])
        else:
            if ours is None:
                ours = ours_side(shape, ours_args)
            if name == "ours-noext":
                hide_extension()
            # Each side sets its own switch (a later side does not inherit an earlier one's).
            os.environ["MEGATRON_COMPILED_CROSS_ENTROPY"] = "0" if name == "ours-unfused-ce" \
                else "1"
            side = ours
        res = time_side(side, warmup, steps)
        res["n_params"] = side.n_params
        res["tokens_per_s"] = tokens / (res["ms"] / 1000)
        active = side.active_params or side.n_params
        res["active_params"] = active
        res["mfu"] = 6 * active * res["tokens_per_s"] / (args.peak_tflops * 1e12)
        results[name] = res
        compiles = f", compile {res['compile_s']:.1f} s" if name in COMPILING_SIDES else ""
        print(f"{shape.name} {name}: {res['ms']:.1f} ms/step, {res['tokens_per_s'] / 1e3:.1f}k "
              f"tokens/s, MFU {100 * res['mfu']:.1f}%, peak "
              f"{res['peak_GiB'] if res['peak_GiB'] is None else round(res['peak_GiB'], 2)} GiB"
              f"{compiles}, first step {res['first_step_s']:.1f} s", flush=True)
        if args.profile:
            tables.append(f"## {shape.name} {name}: one step, top kernels\n\n"
                          + profile_table(side, args.rows))
        if name in ("plain", "compile", "ours-compiled", "hf"):
            release(side)
            del side
    if args.profile:
        with open(args.profile, "w") as f:
            f.write("\n\n".join(tables) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape.name, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
