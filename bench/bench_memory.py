"""Bytes per model parameter held for params + grads + optimizer state, per DP rank.

For each precision (fp16 params & fp16 grads, fp16 params & fp32 grads, fp32 params & fp32 grads)
and each data-parallel size d = 1, 2, 4 (a spawned gloo world each), one rank builds a small MLP,
runs one Adam step (so the moments exist), runs a second backward and copies the model grads to
the main grads (the peak), then counts the bytes of every distinct storage it holds: model
params, DDP grad buffers, fp32 main params and main grads, optimizer moments. Views (fp32 main
params of fp32 models, fp32 main grads aliasing an fp32 buffer) are counted once. The result is
printed beside Megatron-LM's table (non-distributed -> distributed optimizer)::

    fp16 params & fp16 grads   20 -> 4 + 16/d
    fp16 params & fp32 grads   18 -> 6 + 12/d
    fp32 params & fp32 grads   16 -> 8 +  8/d

Run: ``PYTHONPATH=. .venv/bin/python bench/bench_memory.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.launch import run_ranks  # noqa: E402
from megatron.core import device, parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402

HIDDEN, LAYERS = 256, 4
CONFIGS = {  # name: (params dtype, fp32 grads, theory non-distributed, (a, b) for a + b/d)
    "fp16 params & fp16 grads": (torch.float16, False, 20, (4, 16)),
    "fp16 params & fp32 grads": (torch.float16, True, 18, (6, 12)),
    "fp32 params & fp32 grads": (torch.float32, False, 16, (8, 8)),
}


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)]
    return torch.nn.Sequential(*layers).to(dtype)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _held_tensors(ddp, opt) -> list[torch.Tensor]:
    tensors = list(ddp.module.parameters())
    tensors += [buf.data for buf in ddp.grad_buffers.values()]
    for group in opt.optimizer.param_groups:
        for main in group["params"]:
            tensors.append(main)
            if main.grad is not None:
                tensors.append(main.grad)
            tensors += [v for v in opt.optimizer.state[main].values()
                        if torch.is_tensor(v) and v.numel() > 1]
    return tensors


def _backward(ddp, opt, dtype) -> None:
    ddp.zero_grad_buffer()
    opt.zero_grad()
    x = torch.randn(8, HIDDEN, dtype=dtype)
    opt.scale_loss(ddp(x).float().square().mean()).backward()
    finalize_model_grads([ddp])


def _measure(dtype: torch.dtype, fp32_grads: bool, distributed: bool) -> float:
    parallel_state.initialize_model_parallel()
    dp = parallel_state.get_data_parallel_group()
    config = DistributedDataParallelConfig(accumulate_allreduce_grads_in_fp32=fp32_grads,
                                           use_distributed_optimizer=distributed)
    ddp = DistributedDataParallel(_model(dtype), config, dp_group=dp)
    config = OptimizerConfig(lr=1e-3, fp16=dtype == torch.float16, loss_scale=1.0,
                             params_dtype=dtype, use_distributed_optimizer=distributed)
    opt = get_megatron_optimizer(config, [ddp], dp_group=dp,
                                 mp_group=parallel_state.get_model_parallel_group())
    _backward(ddp, opt, dtype)
    assert opt.step()[0], "the measuring step was skipped"
    _backward(ddp, opt, dtype)
    opt._copy_model_grads_to_main_grads()  # the point where main grads exist too
    numel = sum(p.numel() for p in ddp.module.parameters())
    measured = _storage_bytes(_held_tensors(ddp, opt)) / numel
    parallel_state.destroy_model_parallel()  # the next measurement builds its own groups
    return measured


def _measure_all(rank: int, world_size: int) -> dict[tuple[str, bool], float]:
    """Bytes per parameter on this rank, by (config name, distributed optimizer)."""
    del rank, world_size
    device.init_distributed(backend="gloo")
    return {(name, distributed): _measure(dtype, fp32_grads, distributed)
            for name, (dtype, fp32_grads, _, _) in CONFIGS.items()
            for distributed in (False, True)}


def run() -> list[tuple[str, int, float, float, float, float]]:
    """Rows (config, d, theory non-dist, measured non-dist, theory dist, measured dist)."""
    # One world per d (spawning one costs several seconds): it measures every configuration.
    per_d = {d: run_ranks(d, _measure_all) for d in (1, 2, 4)}
    rows = []
    for name, (_, _, plain, (a, b)) in CONFIGS.items():
        for d, per_rank in per_d.items():
            measured_plain = max(r[(name, False)] for r in per_rank)
            measured_dist = max(r[(name, True)] for r in per_rank)
            rows.append((name, d, plain, measured_plain, a + b / d, measured_dist))
    return rows


def format_table(rows) -> str:
    lines = [f"model: {LAYERS} x Linear({HIDDEN}, {HIDDEN}, bias=False) = "
             f"{LAYERS * HIDDEN * HIDDEN:,} params; bytes per parameter on one DP rank "
             "(params + grads + optimizer state)",
             "",
             "| params & grads | d | theory (DDP) | measured (DDP) | theory (dist. opt.) "
             "| measured (dist. opt.) |",
             "|---|---|---|---|---|---|"]
    for name, d, plain, m_plain, dist, m_dist in rows:
        lines.append(f"| {name} | {d} | {plain} | {m_plain:.2f} | {dist:g} | {m_dist:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(format_table(run()) + "\n")
