"""tools/generate.py and tools/run_text_generation_server.py with an MoE checkpoint:
--use-checkpoint-args takes the MoE architecture (experts, expert size, layer pattern, shared
experts, routing) from the checkpoint, and the tokens are the saved model's greedy
continuation, with and without the KV cache (the server's log-probs too, for a batch of two
prompts of different lengths)."""

from __future__ import annotations

import torch

from megatron.text_generation.generation import generate_tokens
from tests.multiprocess import run_distributed
from tests.tools.test_generate import _run_tool
from tools import generate  # noqa: F401  (the tool under test)

MOE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --max-position-embeddings 16 "
       "--seq-length 16 --tokenizer-type NullTokenizer --vocab-size 50 "
       "--distributed-backend gloo --normalization RMSNorm --swiglu --ffn-hidden-size 32 "
       "--disable-bias-linear --position-embedding-type rope --num-experts 4 "
       "--moe-ffn-hidden-size 12 --moe-layer-freq [0,1] --moe-router-topk 2 "
       "--moe-shared-expert-intermediate-size 8 --moe-shared-expert-gate "
       "--moe-router-pre-softmax").split()
BARE = ("--tokenizer-type NullTokenizer --vocab-size 50 --distributed-backend gloo").split()
PROMPT = ["--prompt", "1 2 3", "--num-tokens-to-generate", "6", "--greedy"]


def _save_moe(save_dir: str, flags: list[str] = MOE):
    """The MoE model of ``flags`` with N(0, 1) weights, saved; returns (tokenizer, model)."""
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import build_tokenizer_from_config, initialize_megatron
    from megatron.training.models import gpt_model_from

    cfg = initialize_megatron(flags + ["--save", save_dir, "--save-interval", "1", "--seed", "7"])
    tokenizer = build_tokenizer_from_config(cfg)
    model = gpt_model_from(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    save_checkpoint(3, [model], None, None, cfg, 0, 0)
    return tokenizer, model.eval()


def _cases(rank: int, world_size: int, save_dir: str) -> dict:
    del rank, world_size
    from megatron.core import parallel_state

    tokenizer, model = _save_moe(save_dir)
    expected = generate_tokens(model.eval(), [[1, 2, 3]], 6, eod=tokenizer.eod,
                               vocab_size=tokenizer.vocab_size, max_sequence_length=16,
                               greedy=True)[0]
    parallel_state.destroy_model_parallel()
    ckpt = ["--load", save_dir, "--use-checkpoint-args", "--seed", "99"]
    return {"expected": " ".join(str(t) for t in expected),
            "cache": _run_tool(BARE + ckpt + PROMPT),
            "no_cache": _run_tool(BARE + ckpt + ["--no-kv-cache"] + PROMPT)}


def test_moe_checkpoint_generates_with_and_without_the_kv_cache(tmp_path):
    out = run_distributed(1, _cases, str(tmp_path / "ckpt"))[0]
    assert out["cache"] == [out["expected"]], out
    assert out["no_cache"] == out["cache"]


def _served(rank: int, world_size: int, save_dir: str) -> dict:
    """The saved model's greedy loop (full forwards), tools/generate.py and the server, each
    with and without the KV cache (the server and its client as in test_llama_serving)."""
    del world_size
    from megatron.core import parallel_state
    from tests.tools import test_llama_serving as serving

    flags = [str(serving.VOCAB) if f == "50" else f for f in MOE]  # the helpers' vocabulary
    _, model = _save_moe(save_dir, flags)
    out = {"reference": [serving._greedy(model, [int(t) for t in p.split()])
                         for p in serving.PROMPTS]}
    parallel_state.destroy_model_parallel()
    for kv_cache in (True, False):
        name = "cache" if kv_cache else "recompute"
        out[f"generate_{name}"] = serving._generate_tool(save_dir, kv_cache)
        out[f"serve_{name}"] = serving._serve(rank, save_dir, kv_cache)
    return out


def test_moe_checkpoint_served_equals_the_models_greedy_tokens(tmp_path):
    out = run_distributed(1, _served, str(tmp_path / "ckpt"))[0]
    expected = [" ".join(str(t) for t in ids) for ids, _ in out["reference"]]
    assert all(len(set(ids)) > 5 for ids, _ in out["reference"]), out["reference"]
    for name in ("cache", "recompute"):
        assert out[f"generate_{name}"] == expected, name
        served = out[f"serve_{name}"]
        assert served.get("status") == 200, served
        assert served["body"]["text"] == expected, name
        for got, (_, logprobs) in zip(served["body"]["logprobs"], out["reference"]):
            assert torch.allclose(torch.tensor(got, dtype=torch.float64),
                                  torch.tensor(logprobs, dtype=torch.float64), atol=1e-4,
                                  rtol=0), name
