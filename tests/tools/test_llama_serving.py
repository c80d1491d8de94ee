"""A Llama-style checkpoint (RMSNorm, SwiGLU, partial RoPE with its own base, grouped-query
attention, no linear biases, untied output layer; and one adding the relatives' extras:
--qk-layernorm, --add-qkv-bias, --rotary-interleaved, --apply-layernorm-1p) served by
tools/run_text_generation_server.py and continued by tools/generate.py, each given only
``--load ckpt --use-checkpoint-args`` as Megatron users run them: the greedy tokens (and the
server's log-probs) equal a greedy loop written here over the saved model's own full forward
passes, with the KV cache and with --no-kv-cache, at TP=1 and at
TP=2 (the checkpoint re-split by tools/checkpoint/convert.py).

The tools run inside the pooled gloo worlds (no new processes): the server's rank 0 serves real
HTTP on 127.0.0.1 while a thread of it sends the requests and then SIGTERMs it, as a user stops
it (the handlers it installed are put back afterwards, for the next pooled test).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import requests
import torch

from bench.launch import free_port
from tests.multiprocess import run_distributed

VOCAB = 60  # NullTokenizer: ids 0..59, end of document 60
SEQ = 24
LLAMA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
         "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
         "--make-vocab-size-divisible-by", "16",
         "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
         "--ffn-hidden-size", "48", "--position-embedding-type", "rope",
         "--rotary-percent", "0.5", "--rotary-base", "500", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
EXTRAS = ["--qk-layernorm", "--add-qkv-bias", "--rotary-interleaved", "--apply-layernorm-1p"]
VARIANTS = {"llama": [], "extras": EXTRAS}
RUN = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--seed", "7",
       "--use-cpu-initialization"]
PROMPTS = ["3 14 15 9", "26 5"]
NEW_TOKENS = 10
SCALE = 3.0  # weights well away from init's N(0, 0.02): a greedy path that moves around
# The flags --use-checkpoint-args must bring back (the run that loads passes none of them).
RESTORED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
            "max_position_embeddings", "normalization", "layernorm_epsilon", "swiglu",
            "position_embedding_type", "add_position_embedding", "rotary_percent",
            "rotary_base", "rotary_interleaved", "group_query_attention", "num_query_groups",
            "add_bias_linear", "add_qkv_bias", "qk_layernorm", "apply_layernorm_1p",
            "untie_embeddings_and_output_weights")


def _config(argv: list[str]):
    from megatron.config.cli import build_parser, parse_flags
    from megatron.config.validate import validate
    from megatron.training.initialize import apply_checkpoint_args

    flags = parse_flags(build_parser(), argv)
    if flags.checkpoint.use_checkpoint_args:
        apply_checkpoint_args(flags)
    return validate(flags, world_size=1)


def _save(root: str, extra: list[str]):
    """A scaled Llama-style model saved by save_checkpoint at TP=1; returns (cfg, model)."""
    import pretrain_gpt
    from megatron.training.checkpointing import save_checkpoint

    cfg = _config([*LLAMA, *extra, *RUN, "--save", root, "--save-interval", "1"])
    torch.manual_seed(7)
    model = pretrain_gpt.model_provider(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(SCALE)
        for name, param in model.named_parameters():
            if "layernorm" in name:  # norms away from their all-ones init
                param.add_(torch.linspace(-0.5, 0.5, param.numel()).view(param.shape))
    save_checkpoint(3, [model], None, None, cfg, 0, 0)
    return cfg, model.eval()


def _convert_to_tp2(src: str, dst: str) -> None:
    from tools.checkpoint import convert

    assert convert.main(["--model-type", "GPT", "--load-dir", src, "--save-dir", dst,
                         "--target-tensor-parallel-size", "2"]) == 0


@torch.no_grad()
def _greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy continuation by full forward passes over the growing sequence (argmax over the
    tokenizer's ids, end of document included, stopping after it); then the log-prob of every
    token after the first from one forward over the result."""
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        tokens = torch.tensor([ids])
        logits = model(tokens, torch.arange(len(ids))[None], None)  # [1, s, V]
        ids.append(int(logits[0, -1, :VOCAB + 1].argmax()))
        if ids[-1] == VOCAB:
            break
    tokens = torch.tensor([ids])
    logits = model(tokens[:, :-1], torch.arange(len(ids) - 1)[None], None)[0].double()
    logprobs = torch.log_softmax(logits, -1).gather(1, tokens[0, 1:, None]).view(-1)
    return ids, logprobs.tolist()


# ---------------------------------------------------------------------------------------------
# Inside the pooled ranks.

def _generate_tool(ckpt: str, kv_cache: bool) -> list[str]:
    from megatron.core import parallel_state
    from tools import generate

    argv = ["--load", ckpt, "--use-checkpoint-args", "--distributed-backend", "gloo",
            "--greedy", "--num-tokens-to-generate", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    try:
        return generate.generate(argv + ([] if kv_cache else ["--no-kv-cache"]))
    finally:
        parallel_state.destroy_model_parallel()


def _ask(url: str, out: dict) -> None:
    """Rank 0's client thread: wait for the server, send the requests, then stop it."""
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not come up")
            time.sleep(0.05)
        answer = requests.put(f"{url}/api", timeout=60, json={
            "prompts": PROMPTS, "tokens_to_generate": NEW_TOKENS, "top_k": 1,
            "logprobs": True})
        out["status"], out["body"] = answer.status_code, answer.json()
    except Exception as err:  # noqa: BLE001 - reported by the test, the server still stopped
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        signal.raise_signal(signal.SIGTERM)  # as a user stops it: the server's own handler


def _serve(rank: int, ckpt: str, kv_cache: bool) -> dict:
    from megatron.core import parallel_state
    from tools import run_text_generation_server as server

    # Only rank 0 listens; its port is picked here, just before it binds (one picked earlier can
    # be taken meanwhile by the ephemeral ports of gloo's connections).
    port = free_port()
    out: dict = {}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    client = None
    if rank == 0:
        client = threading.Thread(target=_ask, args=(f"http://127.0.0.1:{port}", out),
                                  daemon=True)
        client.start()
    try:
        server.run(["--load", ckpt, "--use-checkpoint-args", "--distributed-backend", "gloo",
                    "--port", str(port)] + ([] if kv_cache else ["--no-kv-cache"]))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        parallel_state.destroy_model_parallel()
    if client is not None:
        client.join(30)
    return out


def _tools(rank: int, world_size: int, ckpt: str) -> dict:
    del world_size
    out = {}
    for kv_cache in (True, False):
        name = "cache" if kv_cache else "recompute"
        out[f"generate_{name}"] = _generate_tool(ckpt, kv_cache)
        out[f"serve_{name}"] = _serve(rank, ckpt, kv_cache)
    return out


# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoints(request, tmp_path_factory):
    """{"cfg", "reference": [(ids, logprobs)] per prompt, "tp1", "tp2"} of one variant."""
    root = tmp_path_factory.mktemp(f"llama_serving_{request.param}")
    cfg, model = _save(str(root / "tp1"), VARIANTS[request.param])
    reference = [_greedy(model, [int(t) for t in p.split()]) for p in PROMPTS]
    _convert_to_tp2(str(root / "tp1"), str(root / "tp2"))
    return {"variant": request.param, "cfg": cfg, "reference": reference,
            "tp1": str(root / "tp1"), "tp2": str(root / "tp2")}


def test_use_checkpoint_args_restores_every_llama_flag(checkpoints):
    cfg = checkpoints["cfg"]
    loaded = _config(["--load", checkpoints["tp1"], "--use-checkpoint-args", *RUN])
    for name in RESTORED:
        assert getattr(loaded.model, name) == getattr(cfg.model, name), name
    # The saved run differs from the defaults in each of them (else the check proves nothing).
    defaults = _config(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
                        "--seq-length", "8", "--max-position-embeddings", "8",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "8", *RUN])
    extras = {"qk_layernorm", "add_qkv_bias", "rotary_interleaved", "apply_layernorm_1p"}
    for name in RESTORED:
        if checkpoints["variant"] == "extras" or name not in extras:
            assert getattr(cfg.model, name) != getattr(defaults.model, name), name


@pytest.mark.parametrize("flag", ["--qk-layernorm", "--apply-layernorm-1p"])
def test_explicit_flags_that_toggle_a_norm_are_refused_naming_it(checkpoints, flag):
    """Without --use-checkpoint-args the flags must match: a --qk-layernorm the checkpoint was
    not saved with (or one missing) is named, not left to the state dict's missing or
    unexpected q/k norm keys; a different --apply-layernorm-1p would silently read the stored
    gamma - 1 as gamma (or the reverse)."""
    import pretrain_gpt
    from megatron.training.checkpointing import CheckpointError, load_checkpoint

    saved = VARIANTS[checkpoints["variant"]]
    flags = [f for f in LLAMA + saved if f != flag]
    if flag not in saved:
        flags.append(flag)
    cfg = _config([*flags, *RUN, "--load", checkpoints["tp1"], "--finetune"])
    theirs = flag in saved
    with pytest.raises(CheckpointError, match=f"{flag}: checkpoint {theirs}, flags "
                                              f"{not theirs}"):
        load_checkpoint([pretrain_gpt.model_provider(cfg)], None, None, cfg)


@pytest.mark.parametrize("tp", [1, 2])
def test_server_and_generate_equal_the_models_greedy_tokens(checkpoints, tp):
    ckpt = checkpoints[f"tp{tp}"]
    results = run_distributed(tp, _tools, ckpt)
    expected = [" ".join(str(t) for t in ids) for ids, _ in checkpoints["reference"]]
    generated = [ids[len(p.split()):] for ids, p in zip(
        (ids for ids, _ in checkpoints["reference"]), PROMPTS)]
    assert all(len(set(g)) > 2 for g in generated), generated  # a path that moves around
    for rank, out in enumerate(results):
        for name in ("cache", "recompute"):
            assert out[f"generate_{name}"] == expected, (rank, name)
    for name in ("cache", "recompute"):
        served = results[0][f"serve_{name}"]
        assert served.get("status") == 200, served
        assert served["body"]["text"] == expected, name
        for got, (_, logprobs) in zip(served["body"]["logprobs"], checkpoints["reference"]):
            assert torch.allclose(torch.tensor(got, dtype=torch.float64),
                                  torch.tensor(logprobs, dtype=torch.float64), atol=1e-4,
                                  rtol=0), name
