"""Text generation speed (KV cache on/off against HF transformers' ``generate()`` on the same
weights) and the server under load, in one run.

    PYTHONPATH=. .venv/bin/python bench/bench_generation.py [--quick] [--parts gen,server]
        [--threads 2] [--server-seconds 20]

``gen``: a GPT of GPT-2-small's shape (12 layers, hidden 768, 12 heads, vocabulary 50304, fp32,
random weights) generates greedily from prompts of 32 tokens, 64 new tokens each, batch 1 and 8
(same-length prompts, so HF needs no padding): ours with the KV cache, ours recomputing every step
(``use_kv_cache=False``), and ``transformers.GPT2LMHeadModel.generate`` (``use_cache=True``, SDPA)
with our weights copied in (QKV rows re-ordered from Megatron's per-head ``[np, 3, hn]`` to
GPT-2's ``[3, np, hn]``, linear weights transposed for its Conv1D). It also checks that HF's
greedy tokens equal ours. One warm-up run each, then ``--repeats`` rounds in which ours (KV
cache) and HF run back to back; tokens/s is the median over the rounds, and the ratio
ours/HF is the median of the per-round ratios, of wall time and of this process's CPU time
(the CPU-time ratio is the steadier one on a shared machine: time spent waiting for a core
does not count; with ``--threads 1`` it has no idle-spinning threads in it either). The
recomputing run (no cache) is timed once.

``server``: ``tools/run_text_generation_server.py --random-weights`` in its own process; 1, 4
and 16 client threads each send ``PUT /api`` requests back to back for ``--server-seconds``;
requests/s, p50/p99 latency, errors (anything but 200 and 503), 503s, and the server's resident
memory before and after each level (after a warm-up request).

``--quick`` shrinks everything to a 2-layer, hidden-128 model and a few seconds: a check that the
script runs, not a measurement. Measure on an idle machine: the load average is printed first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.launch import free_port  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402
from megatron.text_generation.generation import (SamplingOptions,  # noqa: E402
                                                 StopConditions, generate_tokens_and_logprobs)

VOCAB = 50304


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    positions: int
    prompt: int
    new_tokens: int


GPT2_SMALL = Shape(12, 768, 12, 1024, 32, 64)
QUICK = Shape(2, 128, 4, 128, 8, 8)


def build_model(shape: Shape) -> GPTModel:
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden,
                               num_attention_heads=shape.heads, padded_vocab_size=VOCAB,
                               max_position_embeddings=shape.positions, hidden_dropout=0.0,
                               attention_dropout=0.0)
    return GPTModel(config, None).eval()


def to_hf(model: GPTModel, shape: Shape):
    """``GPT2LMHeadModel`` holding ``model``'s weights (None without transformers)."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    gelu = "gelu_new" if model.config.gelu_tanh_approximation else "gelu"
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=shape.positions, n_embd=shape.hidden,
        n_layer=shape.layers, n_head=shape.heads, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, activation_function=gelu, layer_norm_epsilon=1e-5,
        attn_implementation="sdpa")).eval()
    hf.load_state_dict(hf_state_dict(model, shape), strict=False)
    hf.tie_weights()
    return hf


def hf_state_dict(model: GPTModel, shape: Shape) -> dict[str, torch.Tensor]:
    ours = model.state_dict()
    np_, hn, h = shape.heads, shape.hidden // shape.heads, shape.hidden
    out = {"transformer.wte.weight": ours["language_model.embedding.word_embeddings.weight"],
           "transformer.wpe.weight": ours["language_model.embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": ours["language_model.encoder.final_layernorm.weight"],
           "transformer.ln_f.bias": ours["language_model.encoder.final_layernorm.bias"]}
    for i in range(shape.layers):
        src, dst = f"language_model.encoder.layers.{i}.", f"transformer.h.{i}."
        qkv_w = ours[src + "self_attention.query_key_value.weight"]  # [np*3*hn, h]
        qkv_b = ours[src + "self_attention.query_key_value.bias"]
        # Megatron's rows [np, 3, hn] -> GPT-2's [3, np, hn]; Conv1D stores [in, out].
        out[dst + "attn.c_attn.weight"] = \
            qkv_w.view(np_, 3, hn, h).transpose(0, 1).reshape(3 * h, h).t().contiguous()
        out[dst + "attn.c_attn.bias"] = qkv_b.view(np_, 3, hn).transpose(0, 1).reshape(3 * h)
        pairs = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
        for theirs, mine in pairs.items():
            out[dst + theirs + ".weight"] = ours[src + mine + ".weight"]
            out[dst + theirs + ".bias"] = ours[src + mine + ".bias"]
        linears = {"attn.c_proj": "self_attention.dense", "mlp.c_fc": "mlp.dense_h_to_4h",
                   "mlp.c_proj": "mlp.dense_4h_to_h"}
        for theirs, mine in linears.items():
            out[dst + theirs + ".weight"] = ours[src + mine + ".weight"].t().contiguous()
            out[dst + theirs + ".bias"] = ours[src + mine + ".bias"]
    return out


def decode_weight_bytes(model: GPTModel) -> int:
    """Bytes of weights one decode step reads: every parameter but the position embeddings
    (one row each; the word embeddings are read whole as the output layer)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if "position_embeddings" not in name)


def read_bandwidth_gbs(mib: int = 512) -> float:
    """This machine's memory read bandwidth (GB/s) with torch's threads: ``sum`` over a
    buffer far larger than the caches (a read-only stream, as a GEMV's weights are), best of 5."""
    data = torch.ones(mib * 2**20 // 4)
    best = min(_timed(data.sum)[0] for _ in range(5))
    return data.numel() * 4 / best / 1e9


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _interleaved(contenders: dict, repeats: int) -> dict[str, tuple[list[float], list[float]]]:
    """Every contender once as a warm-up, then ``repeats`` rounds calling each in turn, so a
    change in the machine's load touches every contender alike; per contender the wall and CPU
    seconds of each round."""
    for fn in contenders.values():
        fn()
    times = {name: ([], []) for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            wall, cpu = _timed(fn)
            times[name][0].append(wall)
            times[name][1].append(cpu)
    return times


def bench_generation(shape: Shape, repeats: int) -> list[dict]:
    model = build_model(shape)
    hf = to_hf(model, shape)
    weight_bytes = decode_weight_bytes(model)
    rows = []
    for batch in (1, 8):
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, VOCAB - 100, (batch, shape.prompt), generator=gen)
        n = shape.new_tokens

        def ours(cache: bool):
            return generate_tokens_and_logprobs(
                model, prompts.tolist(), n, max_sequence_length=shape.positions,
                sampling=SamplingOptions(top_k=1), stops=StopConditions(stop_on_eod=False),
                use_kv_cache=cache).tokens

        def hf_generate():
            with torch.no_grad():
                return hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                   max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   use_cache=True, pad_token_id=0)

        contenders = {"ours, KV cache": lambda: ours(True)}
        if hf is not None:
            contenders["HF generate()"] = hf_generate
        times = _interleaved(contenders, repeats)
        # The recomputing reference is 4-12x slower: timed once, after the interleaved rounds.
        no_cache = statistics.median(_interleaved({"": lambda: ours(False)}, 1)[""][0])
        row = {"batch": batch, "new tokens": n}
        for name, (walls, _) in times.items():
            row[name] = batch * n / statistics.median(walls)
        if batch == 1:  # each decoded token reads every weight once: a memory-bound GEMV chain
            for name, (walls, _) in times.items():
                row[f"{name}: weights GB/s"] = weight_bytes * n / statistics.median(walls) / 1e9
        row["ours, no cache"] = batch * n / no_cache
        if hf is not None:
            (ours_wall, ours_cpu), (hf_wall, hf_cpu) = times["ours, KV cache"], \
                times["HF generate()"]
            # Per round: both sides ran back to back, under the same load.
            row["ours/HF (wall)"] = statistics.median(h / o for o, h in zip(ours_wall, hf_wall))
            row["ours/HF (CPU time)"] = statistics.median(h / o for o, h in zip(ours_cpu, hf_cpu))
            row["HF tokens = ours"] = hf_generate().tolist() == ours(True)
        rows.append(row)
    return rows


# Server under load ----------------------------------------------------------------------------
def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bench_server(shape: Shape, seconds: float, tokens: int) -> list[dict]:
    import requests

    port = free_port()
    cmd = [sys.executable, os.path.join(ROOT, "tools", "run_text_generation_server.py"),
           "--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
           "--num-attention-heads", str(shape.heads), "--max-position-embeddings",
           str(shape.positions), "--seq-length", str(shape.positions), "--tokenizer-type",
           "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--random-weights",
           "--distributed-backend", "gloo", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    body = {"prompts": [" ".join(str(i) for i in range(1, shape.prompt + 1))],
            "tokens_to_generate": tokens, "top_k": 1}
    rows = []
    try:
        _wait_up(url, proc)
        requests.put(f"{url}/api", json=body, timeout=600)  # warm-up
        for clients in (1, 4, 16):
            rows.append(_load(url, body, clients, seconds, proc.pid))
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def _wait_up(url: str, proc: subprocess.Popen) -> None:
    import requests

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            requests.get(f"{url}/health", timeout=2)
            return
        except requests.ConnectionError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def _load(url: str, body: dict, clients: int, seconds: float, pid: int) -> dict:
    import requests

    before = _rss_mib(pid)
    latencies, statuses, lock = [], [], threading.Lock()
    stop_at = time.monotonic() + seconds

    def client():
        session = requests.Session()
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            try:
                status = session.put(f"{url}/api", json=body, timeout=600).status_code
            except requests.RequestException:
                status = -1
            with lock:
                latencies.append(time.perf_counter() - start)
                statuses.append(status)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    ok = [lat for lat, s in zip(latencies, statuses) if s == 200]
    ok.sort()
    pct = (lambda q: ok[min(len(ok) - 1, int(q * len(ok)))] * 1000) if ok else (lambda q: 0.0)
    return {"clients": clients, "requests/s": len(ok) / elapsed, "p50 ms": pct(0.5),
            "p99 ms": pct(0.99), "errors": sum(s not in (200, 503) for s in statuses),
            "503s": statuses.count(503), "RSS before MiB": before,
            "RSS after MiB": _rss_mib(pid)}


def _table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(key for row in rows for key in row))  # every row's, in order
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        values = [row.get(key, "-") for key in keys]
        cells = [(f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}") if isinstance(v, float) else str(v)
                 for v in values]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, seconds: a check")
    parser.add_argument("--parts", default="gen,server")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--server-seconds", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else GPT2_SMALL
    print(f"load average: {os.getloadavg()}; torch threads: {torch.get_num_threads()}; "
          f"shape: {shape}")
    parts = args.parts.split(",")
    if "gen" in parts:
        print(f"\nmemory read bandwidth (sum over 512 MiB): {read_bandwidth_gbs():.1f} GB/s; "
              "batch 1 decoding reads every weight once per token, so its tokens/s is bounded "
              "by that bandwidth / the weights' bytes")
        print("\ngeneration tokens/s (greedy, fp32):")
        print(_table(bench_generation(shape, 1 if args.quick else args.repeats)))
    if "server" in parts:
        seconds = 2.0 if args.quick else args.server_seconds
        print(f"\nserver under load ({seconds:.0f} s per level, PUT /api, "
              f"{shape.prompt}-token prompt, {shape.new_tokens} new tokens, greedy):")
        print(_table(bench_server(shape, seconds, shape.new_tokens)))


if __name__ == "__main__":
    main()
