"""tools/generate.py: bad options and a missing checkpoint are refused before any process group
starts or any model is built; a prompt that would outgrow the position embeddings is refused
before the model is built (never cut off); a saved checkpoint is what it generates from."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.text_generation import check_generation_lengths, check_sampling_options
from megatron.text_generation.generation import generate_tokens
from tests.multiprocess import run_distributed
from tools import generate

MODEL = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --max-position-embeddings 16 "
         "--seq-length 16 --tokenizer-type NullTokenizer --vocab-size 50 "
         "--distributed-backend gloo").split()
PROMPT = ["--prompt", "1 2 3", "--num-tokens-to-generate", "5", "--greedy"]


@pytest.fixture()
def no_process_group(monkeypatch):
    """Fail the test if anything starts torch.distributed."""
    import torch.distributed as dist

    def boom(*args, **kwargs):
        raise AssertionError("a process group was started before the flags were checked")

    monkeypatch.setattr(dist, "init_process_group", boom)


@pytest.mark.parametrize("extra,message", [
    ("--random-weights --num-tokens-to-generate -5", "--num-tokens-to-generate (-5) must be >= 0"),
    ("--random-weights --top_k -3", "--top_k (-3) must be >= 0"),
    ("--random-weights --top_p 1.5", "--top_p (1.5) must be in [0, 1]"),
    ("--random-weights --top_p nan", "--top_p (nan) must be in [0, 1]"),
    ("--random-weights --top_k 2 --top_p 0.5",
     "--top_k (2) and --top_p (0.5) are mutually exclusive"),
    ("--random-weights --temperature nan", "--temperature (nan) must be a finite number > 0"),
    ("--random-weights --temperature 0", "--temperature (0.0) must be a finite number > 0"),
    ("--random-weights --temperature -1", "--temperature (-1.0) must be a finite number > 0"),
    ("", "--load is required"),
    ("--load {missing}", "--load {missing}: no such directory"),
    ("--load {empty}", "--load {empty} holds no checkpoint (latest_checkpointed_iteration.txt "
                       "not found)"),
    ("--load {empty} --random-weights", "--random-weights and --load {empty} are mutually "
                                        "exclusive"),
])
def test_refused_before_any_process_group(tmp_path, no_process_group, extra, message):
    paths = {"missing": str(tmp_path / "nope"), "empty": str(tmp_path)}
    with pytest.raises(SystemExit) as exc:
        generate.generate(MODEL + extra.format(**paths).split())
    assert str(exc.value) == f"tools/generate.py: error: {message.format(**paths)}" or \
        str(exc.value).startswith(f"tools/generate.py: error: {message.format(**paths)}"), \
        str(exc.value)


def test_library_checks():
    check_sampling_options(top_k=0, top_p=1.0, temperature=0.5)
    check_generation_lengths([10, 1], 6, 16)
    for kwargs in ({"top_k": -1}, {"top_p": -0.1}, {"temperature": math.inf}):
        with pytest.raises(ValueError):
            check_sampling_options(**kwargs)
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        check_generation_lengths([3, 0], 1, 16)
    with pytest.raises(ValueError, match="prompt 1 has 10 tokens.*makes 17, more than the "
                                         "model's 16 positions"):
        check_generation_lengths([1, 10], 7, 16)


def test_prompt_longer_than_positions_is_refused_not_truncated():
    """Before: the prompt was cut to its last max_sequence_length tokens without a word."""
    model = torch.nn.Identity()  # never called: the check comes first
    with pytest.raises(ValueError, match="prompt 0 has 20 tokens"):
        generate_tokens(model, [list(range(1, 21))], 1, max_sequence_length=16)


# ---------------------------------------------------------------------------------------------
# Through the tool on a world of one rank.

def _distinctive_checkpoint(save_dir: str) -> list[int]:
    """Save a model whose weights differ a lot from any fresh initialization; returns its
    greedy continuation of PROMPT's tokens."""
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import build_tokenizer_from_config, initialize_megatron
    from megatron.training.models import gpt_model_from

    cfg = initialize_megatron(MODEL + ["--save", save_dir, "--save-interval", "1",
                                       "--seed", "7"])
    tokenizer = build_tokenizer_from_config(cfg)
    model = gpt_model_from(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    save_checkpoint(3, [model], None, None, cfg, 0, 0)
    return generate_tokens(model, [[1, 2, 3]], 5, eod=tokenizer.eod,
                           vocab_size=tokenizer.vocab_size, max_sequence_length=16,
                           greedy=True)[0]


def _run_tool(argv: list[str]) -> str | list[str]:
    """The texts, or the SystemExit message; the model builder is watched."""
    from megatron.core import parallel_state

    built = []
    original = generate.gpt_model_from
    generate.gpt_model_from = lambda cfg, **kw: built.append(1) or original(cfg, **kw)
    try:
        return generate.generate(argv)
    except SystemExit as err:
        return f"{err} [models built: {len(built)}]"
    finally:
        generate.gpt_model_from = original
        parallel_state.destroy_model_parallel()


def _tool_cases(rank: int, world_size: int, save_dir: str) -> dict:
    del rank, world_size
    from megatron.core import parallel_state

    expected = _distinctive_checkpoint(save_dir)
    parallel_state.destroy_model_parallel()
    return {
        "expected": " ".join(str(t) for t in expected),
        "loaded": _run_tool(MODEL + ["--load", save_dir, "--seed", "99"] + PROMPT),
        "no_cache": _run_tool(MODEL + ["--load", save_dir, "--seed", "99", "--no-kv-cache"]
                              + PROMPT),
        "random": _run_tool(MODEL + ["--random-weights", "--seed", "99"] + PROMPT),
        "fits": _run_tool(MODEL + ["--random-weights", "--prompt", " ".join(["1"] * 10),
                                   "--num-tokens-to-generate", "6", "--greedy"]),
        "too_long": _run_tool(MODEL + ["--random-weights", "--prompt", " ".join(["1"] * 10),
                                       "--num-tokens-to-generate", "7"]),
        "unbounded": _run_tool(MODEL + ["--random-weights", "--num-tokens-to-generate",
                                        "100000000"]),
    }


def test_generates_from_the_loaded_checkpoint_and_bounds_the_length(tmp_path):
    out = run_distributed(1, _tool_cases, str(tmp_path / "ckpt"))[0]
    assert out["loaded"] == [out["expected"]]
    assert out["no_cache"] == out["loaded"]  # --no-kv-cache recomputes: the same tokens
    # The check above means something: fresh weights continue differently.
    assert out["random"] != [out["expected"]]
    assert len(out["fits"][0].split()) == 16
    assert out["too_long"] == (
        "tools/generate.py: error: prompt 0 has 10 tokens; with --num-tokens-to-generate (7) "
        "that makes 17, more than the model's 16 positions (--max-position-embeddings): shorten "
        "the prompt or generate fewer tokens [models built: 0]")
    assert out["unbounded"].startswith("tools/generate.py: error: prompt 0 has 1 tokens; with "
                                       "--num-tokens-to-generate (100000000)")
    assert out["unbounded"].endswith("[models built: 0]")
