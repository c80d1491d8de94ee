"""Greedy generation speed with the KV cache on one GPU: ours (``megatron.text_generation``)
against transformers' ``GPT2LMHeadModel.generate()`` holding the same weights, one process.

    python bench/gpu_speed_generate.py [--shape gpt2|small|tiny] [--batches 1,8]
        [--repeats N] [--precision bf16|fp32] [--json FILE]

Shapes (vocabulary 50304, learned positions, tied output layer): ``gpt2`` = GPT-2-small, 12 x 768,
12 heads, 1024 positions, prompts of 128 tokens, 256 new tokens; ``small`` = 4 x 256, 4 heads,
same lengths; ``tiny`` = 2 x 64, 16 new tokens after 8 (a smoke test). bf16 on a GPU, fp32 on
the CPU.

* ``ours``: the model the text-generation server builds (``initialize_megatron`` with the
  server's kind of flags, ``gpt_model_from(cfg, inference=True)``, ``--bf16``: bf16 weights;
  random weights), run by ``generate_tokens_and_logprobs``, the generation the server's
  ``run_request`` calls once it has tokenized the prompts: greedy (``top_k=1``), the KV cache,
  the end-of-document stop off (a fixed number of new tokens);
* ``hf``: ``GPT2LMHeadModel`` (``attn_implementation="sdpa"``) with ours' weights copied in
  (``bench/bench_generation.py``'s mapping: QKV rows re-ordered, Conv1D transposed), in the same
  dtype, ``generate(do_sample=False, use_cache=True, min_new_tokens=max_new_tokens=N)``.

Same random prompts (same length, no padding) on both sides, the batch on the device. One
warm-up run of each side, then ``--repeats`` rounds, ours and HF back to back in each; tokens/s
is batch x new tokens over the median wall time of a whole call (the prompt's forward included),
every call between two device synchronisations. The greedy tokens of both sides are compared
(equal in fp32; bf16 rounding may let them part after a near-tie, so the figure says where).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import bench_train  # noqa: E402
import bench_generation  # noqa: E402

from megatron.core import device  # noqa: E402

VOCAB = bench_generation.VOCAB  # 50304 = NullTokenizer's 50303 ids + its EOD


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    positions: int
    prompt: int
    new_tokens: int
    repeats: int


SHAPES = {
    "gpt2": Shape("gpt2", 12, 768, 12, 1024, 128, 256, repeats=3),
    "small": Shape("small", 4, 256, 4, 1024, 128, 256, repeats=3),
    "tiny": Shape("tiny", 2, 64, 4, 64, 8, 16, repeats=1),
}


def ours_model(shape: Shape, bf16: bool) -> torch.nn.Module:
    """The server's model: initialize from flags, ``gpt_model_from(cfg, inference=True)``."""
    from megatron.training.initialize import initialize_megatron
    from megatron.training.models import gpt_model_from

    flags = ["--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
             "--num-attention-heads", str(shape.heads), "--seq-length", str(shape.positions),
             "--max-position-embeddings", str(shape.positions), "--micro-batch-size", "1",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
             "--hidden-dropout", "0", "--attention-dropout", "0",
             "--distributed-backend", device.default_backend(), *(["--bf16"] if bf16 else [])]
    cfg = initialize_megatron(flags)
    model = gpt_model_from(cfg, inference=True).to(device.get_device())
    return model.eval()


def hf_model(model: torch.nn.Module, shape: Shape, dtype: torch.dtype):
    """``GPT2LMHeadModel`` with ``model``'s weights, on the device, in ``dtype``."""
    hf_shape = bench_generation.Shape(shape.layers, shape.hidden, shape.heads, shape.positions,
                                      shape.prompt, shape.new_tokens)
    hf = bench_generation.to_hf(model, hf_shape)
    if hf is None:
        raise SystemExit("transformers is not installed: the HF side cannot run")
    return hf.to(device.get_device(), dtype).eval()


def ours_generate(model, prompts: torch.Tensor, shape: Shape) -> list[list[int]]:
    from megatron.text_generation.generation import (SamplingOptions, StopConditions,
                                                     generate_tokens_and_logprobs)

    return generate_tokens_and_logprobs(
        model, prompts.tolist(), shape.new_tokens, max_sequence_length=shape.positions,
        sampling=SamplingOptions(top_k=1), stops=StopConditions(stop_on_eod=False),
        use_kv_cache=True).tokens


def hf_generate(hf, prompts: torch.Tensor, shape: Shape) -> list[list[int]]:
    ids = prompts.to(device.get_device())
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=shape.new_tokens, min_new_tokens=shape.new_tokens,
                          do_sample=False, use_cache=True, pad_token_id=0)
    return out.tolist()


def timed(fn) -> tuple[float, list[list[int]]]:
    device.synchronize()
    t0 = time.perf_counter()
    tokens = fn()
    device.synchronize()
    return time.perf_counter() - t0, tokens


def measure(contenders: dict, repeats: int) -> dict[str, tuple[list[float], list]]:
    """One warm-up call of each, then ``repeats`` rounds calling each in turn: per contender the
    wall seconds of each round and its last tokens."""
    for fn in contenders.values():
        timed(fn)
    out = {name: ([], None) for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            sec, tokens = timed(fn)
            out[name] = (out[name][0] + [sec], tokens)
    return out


def agreement(ours: list[list[int]], theirs: list[list[int]], prompt: int) -> str:
    """How many rows' new tokens are equal, and where the first row that differs parts."""
    same = sum(a == b for a, b in zip(ours, theirs))
    parts = [next((i for i, (x, y) in enumerate(zip(a[prompt:], b[prompt:])) if x != y), None)
             for a, b in zip(ours, theirs)]
    first = min((p for p in parts if p is not None), default=None)
    where = "" if first is None else f", first difference at new token {first}"
    return f"{same}/{len(ours)} rows equal{where}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="gpt2", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                        help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    repeats = args.repeats if args.repeats is not None else shape.repeats
    precision = args.precision or ("bf16" if device.accelerator_available() else "fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    print(f"# {shape}; {precision}; device {device.get_device()}; load {bench_train.load()}",
          flush=True)
    model = ours_model(shape, precision == "bf16")
    hf = hf_model(model, shape, dtype)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        gen = torch.Generator(device="cpu").manual_seed(batch)
        prompts = torch.randint(0, VOCAB - 1, (batch, shape.prompt), generator=gen,
                                device="cpu")
        times = measure({"ours": lambda: ours_generate(model, prompts, shape),
                         "hf": lambda: hf_generate(hf, prompts, shape)}, repeats)
        row = {"batch": batch, "new_tokens": shape.new_tokens, "prompt": shape.prompt}
        for name, (secs, tokens) in times.items():
            lengths = {len(t) for t in tokens}
            if lengths != {shape.prompt + shape.new_tokens}:
                raise SystemExit(f"{name}: rows of {sorted(lengths)} tokens, not "
                                 f"{shape.prompt} + {shape.new_tokens}")
            row[name] = {"tokens_per_s": batch * shape.new_tokens / statistics.median(secs),
                         "seconds": secs}
        row["ours/HF"] = statistics.median(
            h / o for o, h in zip(times["ours"][0], times["hf"][0]))
        row["agreement"] = agreement(times["ours"][1], times["hf"][1], shape.prompt)
        results.append(row)
        print(f"{shape.name} batch {batch}: ours {row['ours']['tokens_per_s']:.1f} tokens/s, "
              f"HF generate() {row['hf']['tokens_per_s']:.1f} tokens/s, ours/HF "
              f"{row['ours/HF']:.2f}x; greedy tokens: {row['agreement']}", flush=True)
    print(f"# load at end {bench_train.load()}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": dataclasses.asdict(shape), "precision": precision,
                       "results": results}, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # the process group: nothing left to tear down gracefully


if __name__ == "__main__":
    main()
