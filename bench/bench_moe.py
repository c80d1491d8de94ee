"""MoE speed, memory and communication on CPU, same run.

    PYTHONPATH=. .venv/bin/python bench/bench_moe.py [--steps 6] [--quick]

1. Training step (forward, backward, AdamW) of a small Mixtral-shaped model (8 experts, top-2,
   SwiGLU experts, GQA, RoPE, RMSNorm) in ours and in transformers' ``MixtralForCausalLM`` of
   the same shape and the same weights (HF's random model imported with ``--loader hf``; the
   logits are checked equal first): tokens/s (median of the timed steps after one warm-up) and
   the peak RSS of each side, each side in its own process.
2. Ours with ``--moe-grouped-gemm`` against the SequentialMLP loop (on a CPU the grouped path
   is the loop: the figure says so).
3. The bytes one rank moves in one MoE layer's forward at EP=2 with each dispatcher (gloo, 2
   processes), counted at the collectives, against the formula: allgather
   ``(EP-1) T (h*4 + E*4 + E)`` gathered + ``(EP-1) T h*4`` reduce-scattered; alltoall
   ``E*8 (EP-1)`` gathered counts + ``(N_sent + N_received) * h*4`` (token copies this rank
   routes to the other rank's experts, sent in the dispatch; copies it receives for its own
   experts, whose outputs it sends back in the combine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

SHAPE = dict(vocab=1024, hidden=256, ffn=512, layers=4, heads=8, groups=2, experts=8, topk=2,
             seq=256, batch=4)


def _hf_config(s: dict):
    import transformers
    return transformers.MixtralConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["groups"], num_local_experts=s["experts"],
        num_experts_per_tok=s["topk"], max_position_embeddings=s["seq"],
        tie_word_embeddings=False, router_aux_loss_coef=0.0, rms_norm_eps=1e-5)


def _ours_from(directory: Path, grouped: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.config import TransformerConfig
    from megatron.checkpointing import load_checkpoint_file, shard_files
    from tools.checkpoint import convert

    out = directory / ("ours_g" if grouped else "ours")
    if not out.exists():
        assert convert.main(["--model-type", "GPT", "--load-dir", str(directory / "hf"),
                             "--save-dir", str(out), "--loader", "hf"]) == 0
    sd = load_checkpoint_file(shard_files(out / "iter_0000000")[(0, 0)])
    a = sd["args"]
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads, ffn_hidden_size=a.ffn_hidden_size,
        num_query_groups=a.num_query_groups, padded_vocab_size=a.padded_vocab_size,
        max_position_embeddings=a.max_position_embeddings, position_embedding_type="rope",
        rotary_base=a.rotary_base, normalization="RMSNorm",
        layernorm_epsilon=a.layernorm_epsilon, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
        moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_grouped_gemm=grouped,
        gradient_accumulation_fusion=False)
    model = GPTModel(config, None)
    model.load_state_dict(sd["model"])
    return model


def _side(side: str, directory: Path, steps: int) -> dict:
    """One side's training steps in this process: tokens/s and peak RSS."""
    import transformers
    torch.manual_seed(0)
    s = SHAPE
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(s["seq"]).unsqueeze(0).expand_as(inputs)
    if side == "hf":
        model = transformers.MixtralForCausalLM.from_pretrained(directory / "hf").train()

        def loss_fn():
            logits = model(inputs).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    else:
        model = _ours_from(directory, grouped=side == "ours-grouped").train()

        def loss_fn():
            return model(inputs, positions, labels=labels).mean()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])
    return {"side": side, "tokens_per_s": s["batch"] * s["seq"] / step,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _prepare(directory: Path) -> None:
    import transformers
    torch.manual_seed(5)
    hf = transformers.MixtralForCausalLM(_hf_config(SHAPE)).eval()
    hf.save_pretrained(directory / "hf")
    ours = _ours_from(directory, grouped=False).eval()
    ids = torch.randint(0, SHAPE["vocab"], (1, 32))
    with torch.no_grad():
        diff = (ours(ids, torch.arange(32).unsqueeze(0))[..., :SHAPE["vocab"]]
                - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, f"ours and HF's logits differ by {diff}"
    print(f"same weights: max |logits ours - HF| = {diff:.2e}")


def _count_bytes(rank: int, world: int, dispatcher: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from megatron.core import comm
    from megatron.core.transformer.config import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import ExpertGroups, MoELayer
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    moved = {"bytes": 0}
    real_run, real_a2a = comm._run, comm.all_to_all_single

    def run(name, grp, aop, collective, /, *args, **kwargs):
        output, tensor = args[0], args[1]
        n = comm.world_size(grp)
        big = output if name == "all_gather" else tensor
        moved["bytes"] += big.numel() * big.element_size() * (n - 1) // n
        return real_run(name, grp, aop, collective, *args, **kwargs)

    def a2a(output, tensor, group, out_splits=None, in_splits=None):
        me, n = comm.rank(group), comm.world_size(group)
        splits = in_splits or [len(tensor) // n] * n
        rows = sum(c for r, c in enumerate(splits) if r != me)
        moved["bytes"] += rows * (tensor[0].numel() * tensor.element_size() if len(tensor) else 0)
        return real_a2a(output, tensor, group, out_splits, in_splits)

    comm._run, comm.all_to_all_single = run, a2a
    s = SHAPE
    cfg = TransformerConfig(num_layers=1, hidden_size=s["hidden"], num_attention_heads=s["heads"],
                            ffn_hidden_size=s["ffn"], swiglu=True, add_bias_linear=False,
                            num_moe_experts=s["experts"], moe_router_topk=s["topk"],
                            moe_token_dispatcher_type=dispatcher,
                            gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    every_rank = dist.group.WORLD
    layer = MoELayer(cfg, 1, None, expert_groups=ExpertGroups(
        ep=every_rank, etp=None, tp_ep=every_rank)).eval()
    x = torch.randn(s["seq"], s["batch"], s["hidden"],
                    generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        probs, rmap = layer.router(x)
        layer(x)
    t, h, e, ep = s["seq"] * s["batch"], s["hidden"], s["experts"], world
    local = e // ep
    remote = int(rmap.sum() - rmap[:, rank * local:(rank + 1) * local].sum())
    # Gathered with comm.all_gather_object: an object gather, not counted among the tensors.
    every = comm.all_gather_object(remote, comm.world_group())
    received = sum(every) - remote  # EP=2: the other rank's copies for this rank's experts
    if dispatcher == "allgather":
        formula = (ep - 1) * t * (h * 4 + e * 4 + e) + (ep - 1) * t * h * 4
    else:
        formula = e * 8 * (ep - 1) + (remote + received) * h * 4
    if rank == 0:
        Path(out).write_text(json.dumps({"dispatcher": dispatcher, "measured": moved["bytes"],
                                         "formula": formula, "tokens": t,
                                         "remote_copies": remote}))
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a smaller model, 2 steps")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        SHAPE.update(hidden=64, ffn=128, layers=2, seq=64, batch=2)
        args.steps = 2
    if args.side:  # a child process: one side
        print(json.dumps(_side(args.side, Path(args.dir), args.steps)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "PYTHONPATH": "."}
    print(f"shape: {SHAPE}; {torch.get_num_threads()} threads; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        _prepare(Path(tmp))
        results = []
        for side in ("hf", "ours", "ours-grouped"):
            cmd = [sys.executable, __file__, "--side", side, "--dir", tmp, "--steps",
                   str(args.steps)] + (["--quick"] if args.quick else [])
            line = subprocess.run(cmd, env=env, check=True, capture_output=True,
                                  text=True).stdout.strip().splitlines()[-1]
            results.append(json.loads(line))
        base = results[0]["tokens_per_s"]
        print("| side | tokens/s | vs HF | peak RSS MiB |\n|---|---|---|---|")
        for r in results:
            print(f"| {r['side']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x | "
                  f"{r['peak_rss_mib']:.0f} |")
        print("(ours-grouped on a CPU runs the per-expert loop: --moe-grouped-gemm's "
              "torch._grouped_mm is CUDA bf16 only)")
        print("| dispatcher (EP=2) | bytes moved by rank 0 | formula |\n|---|---|---|")
        import torch.multiprocessing as mp
        for i, dispatcher in enumerate(("allgather", "alltoall")):
            out = str(Path(tmp) / f"{dispatcher}.json")
            mp.spawn(_count_bytes, args=(2, dispatcher, 29650 + i, out), nprocs=2)
            r = json.loads(Path(out).read_text())
            print(f"| {dispatcher} | {r['measured']} | {r['formula']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
