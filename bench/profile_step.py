"""Where a training step's time goes, with the fusions on and off: torch.profiler tables.

    PYTHONPATH=. .venv/bin/python bench/profile_step.py [--shape small|gpt2] [--bf16]
        [--attention unfused|auto] [--rows 20] [--steps 2] [--only fused|unfused]
        [--ab-steps N [--ab-cross-entropy]] [--untuned-malloc]

One process, 2 threads, the model library directly (no data loader, no optimizer: forward,
loss, backward into DDP-style fp32 ``main_grad`` buffers, so the gradient-accumulation fusion
acts as in training). Two configurations in the same run:

* ``fused``: every fusion on (the default flags) and the C++ kernels;
* ``unfused``: ``--no-masked-softmax-fusion --no-bias-dropout-fusion
  --no-gradient-accumulation-fusion --openai-gelu``, ``F.layer_norm`` and the unfused
  vocab-parallel cross entropy (the PyTorch paths).

glibc's allocator is tuned as ``pretrain_gpt.py`` tunes it on CPU (``--untuned-malloc`` leaves it).
``--only fused|unfused`` profiles one side (e.g. one per process, to compare on a quiet machine).
``--ab-steps N`` skips the profiler and times N steps of each side alternately in one process
(fused, unfused, fused, ...; medians), so that a load change hits both alike; with
``--ab-cross-entropy`` both sides run every other fusion and differ only in the cross entropy.

For each, the profiler's ``key_averages()`` table sorted by self CPU time (the ops' own time), so
the rows show which kernels the fusions replace and what the step spends elsewhere (GEMMs,
cross entropy, embedding). Shapes as ``bench/bench_train.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from megatron.core.device import tune_host_allocator
from megatron.core.fusions import fused_cross_entropy as cross_entropy
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import layernorm
from megatron.core.transformer.config import TransformerConfig

SHAPES = {"small": dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq=256, mb=8),
          "gpt2": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq=512, mb=4)}


def build(shape: dict, fused: bool, dtype: torch.dtype, attention: str) -> GPTModel:
    config = TransformerConfig(
        num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"], padded_vocab_size=50304,
        max_position_embeddings=shape["seq"], params_dtype=dtype, hidden_dropout=0.0,
        attention_dropout=0.0, attention_backend=attention, masked_softmax_fusion=fused,
        bias_dropout_fusion=fused, gradient_accumulation_fusion=fused, openai_gelu=not fused)
    torch.manual_seed(0)
    model = GPTModel(config, None)
    for module in model.modules():
        if isinstance(module, layernorm.LayerNorm):
            module.fused = fused
    for param in model.parameters():  # what the DDP wrapper gives every parameter
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
    return model


def step(model: GPTModel, tokens: torch.Tensor, positions: torch.Tensor) -> None:
    loss = model(tokens, positions, None, labels=tokens)
    loss.float().mean().backward()
    for param in model.parameters():
        if param.grad is not None:  # the DDP hook's job without the fusion
            param.main_grad.add_(param.grad)
            param.grad = None


def use_fused_cross_entropy(fused: bool, kernel_for=cross_entropy.fused_kernel_for) -> None:
    """The cross entropy has no flag (it is fused wherever the kernel is built): switch it here
    for the comparison."""
    cross_entropy.fused_kernel_for = kernel_for if fused else (lambda logits: None)


def time_alternately(models: dict[str, GPTModel], tokens: torch.Tensor, positions: torch.Tensor,
                     steps: int, fused_ce: dict[str, bool]) -> dict[str, float]:
    """Median seconds per step of each model, one step of each per round after one warm-up."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(steps + 1):
        for name, model in models.items():
            use_fused_cross_entropy(fused_ce[name])
            start = time.perf_counter()
            step(model, tokens, positions)
            if i > 0:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=list(SHAPES))
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--attention", default="unfused", choices=["unfused", "auto"])
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", choices=["fused", "unfused"])
    parser.add_argument("--untuned-malloc", action="store_true")
    parser.add_argument("--ab-steps", type=int, default=0)
    parser.add_argument("--ab-cross-entropy", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if not args.untuned_malloc:
        tune_host_allocator()
    shape = SHAPES[args.shape]
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50257, (shape["mb"], shape["seq"]), generator=gen)
    positions = torch.arange(shape["seq"]).expand_as(tokens)
    if args.ab_steps:
        every = args.ab_cross_entropy  # both sides keep the other fusions
        models = {"fused": build(shape, True, dtype, args.attention),
                  "unfused": build(shape, every, dtype, args.attention)}
        result = time_alternately(models, tokens, positions, args.ab_steps,
                                  {"fused": True, "unfused": False})
        what = "cross entropy only" if every else "every fusion"
        print(f"{args.shape}, {dtype}, attention {args.attention}, fused vs unfused ({what}), "
              f"{args.ab_steps} alternating steps: fused {result['fused']:.3f} s, unfused "
              f"{result['unfused']:.3f} s per step: {result['unfused'] / result['fused']:.3f}x")
        return
    for fused in (True, False):
        if args.only and args.only != ("fused" if fused else "unfused"):
            continue
        use_fused_cross_entropy(fused)
        model = build(shape, fused, dtype, args.attention)
        step(model, tokens, positions)  # warm-up: allocations, TorchScript profiling runs
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step(model, tokens, positions)
        name = "fused" if fused else "unfused"
        print(f"\n## {name}: {args.shape}, {dtype}, attention {args.attention}, "
              f"{args.steps} steps\n")
        total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
        print(f"self CPU total {total:.2f} s ({total / args.steps:.2f} s per step)\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
