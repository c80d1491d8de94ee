"""Checkpoint save / load: ``--ckpt-format torch`` vs ``torch_dist`` (synchronous and
``--async-save``), same run, same model, same ranks.

A GPT-2-small-shape model (12 layers, hidden 768, 12 heads, padded vocabulary 50304, fp32
random weights, 124M parameters; ``--quick``: 4 layers, hidden 256) at TP=2 on 2 gloo
processes. Per format: seconds to save and to load (every rank, slowest reported), peak host
memory above the model (``VmRSS`` sampled every 2 ms during the phase), files
and bytes written, and for ``--async-save`` the seconds the caller is blocked (host copy and
hand-off) against the whole write.

Run: ``PYTHONPATH=. .venv/bin/python bench/bench_dist_ckpt.py [--quick]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.launch import run_ranks  # noqa: E402

SHAPES = {"small": dict(layers=12, hidden=768, heads=12),
          "quick": dict(layers=4, hidden=256, heads=4)}


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _phase(fn):
    """(seconds, peak resident bytes above the start, fn's result): RSS sampled every 2 ms."""
    import threading

    from megatron.core import comm
    comm.barrier(comm.world_group())
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    comm.barrier(comm.world_group())
    return seconds, max(peak[0] - base, 0), out


def _bench(rank, world, shape, root):
    import torch
    from megatron.core import comm

    from megatron.checkpointing import load_checkpoint_file, save_file
    from megatron.checkpointing.dist import storage
    from megatron.checkpointing.dist.async_save import SAVER
    from megatron.checkpointing.dist.model import Layout, load_weights, save_weights
    from megatron.core import device
    from megatron.core import parallel_state as ps
    from megatron.core.models.builder import build_model_stage
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.config import TransformerConfig

    device.init_distributed("gloo")
    ps.initialize_model_parallel(world, 1)
    config = TransformerConfig(num_layers=shape["layers"], hidden_size=shape["hidden"],
                               num_attention_heads=shape["heads"], padded_vocab_size=50304,
                               max_position_embeddings=1024)
    torch.manual_seed(0)
    model = build_model_stage(GPTModel, config)
    layout = Layout.from_parallel_state(config.num_layers)
    root = Path(root)
    legacy = root / "torch" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
    dist_dir = root / "torch_dist"
    async_dir = root / "torch_dist_async"
    rows = {}
    rows["torch save"] = _phase(lambda: save_file(
        {"model": model.state_dict_for_save_checkpoint()}, legacy))[:2]
    rows["torch load"] = _phase(lambda: model.load_state_dict(
        load_checkpoint_file(legacy)["model"]))[:2]
    rows["torch_dist save"] = _phase(lambda: save_weights([model], dist_dir, layout, False))[:2]
    rows["torch_dist load"] = _phase(lambda: load_weights([model], dist_dir, layout, False))[:2]

    def start_async():
        from megatron.checkpointing.dist.model import model_objects, model_tensors
        objects = {storage.COMMON_STATE_KEY: {}}
        objects.update(model_objects([model], layout))
        state = storage.stage(model_tensors([model], layout, False, for_save=True), objects,
                              to_host=True)
        SAVER.start(async_dir, state, True, lambda every: storage.finish(async_dir, every))

    blocked, peak, _ = _phase(start_async)
    start = time.perf_counter()
    SAVER.wait()
    rows["torch_dist --async-save (blocked)"] = (blocked, peak)
    rows["torch_dist --async-save (write done)"] = (blocked + time.perf_counter() - start, peak)
    params = sum(p.numel() for p in model.parameters())  # this rank's
    every = comm.all_gather_object(rows, comm.world_group())
    return every, params


def _files(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shape = SHAPES["quick" if args.quick else "small"]
    root = Path(tempfile.mkdtemp(prefix="bench_dist_ckpt_"))
    try:
        (every, params), _ = run_ranks(2, _bench, shape, str(root))
        print(f"GPT {shape['layers']} layers, hidden {shape['hidden']}, vocabulary 50304: "
              f"{params / 1e6:.0f}M parameters per rank at TP=2 (2 gloo processes, fp32)")
        print("| what | seconds (slowest rank) | peak host memory (MiB, max rank) |")
        print("|---|---|---|")
        for name in every[0]:
            seconds = max(rank[name][0] for rank in every)
            peak = max(rank[name][1] for rank in every) / 2**20
            print(f"| {name} | {seconds:.2f} | {peak:.0f} |")
        for fmt in ("torch", "torch_dist", "torch_dist_async"):
            count, size = _files(root / fmt)
            print(f"{fmt}: {count} files, {size / 2**20:.0f} MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
