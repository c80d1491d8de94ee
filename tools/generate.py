"""Generate text from a checkpoint: greedy, top-k or top-p sampling.

    torchrun --nproc-per-node 2 tools/generate.py --load ckpt/ --use-checkpoint-args \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --prompt "It was a dark and stormy night" --num-tokens-to-generate 40 --top_p 0.9

The tensor-parallel size must match the checkpoint's (--use-checkpoint-args takes it, and the
architecture, from the checkpoint: launch that many processes). Without a checkpoint the tool
refuses to run, unless --random-weights asks for untrained weights (smoke tests).
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.config.base import spec  # noqa: E402
from megatron.config.cli import parse_command_line  # noqa: E402
from megatron.config.validate import ToolChecks, refuse_context_parallel  # noqa: E402
from megatron.core import comm, device, parallel_state  # noqa: E402
from megatron.core.log import log_rank_0  # noqa: E402
from megatron.text_generation import (  # noqa: E402
    check_generation_lengths, check_sampling_options, generate_tokens)
from megatron.training import fault  # noqa: E402
from megatron.training.checkpointing import load_checkpoint  # noqa: E402
from megatron.training.inference import (  # noqa: E402
    check_checkpoint_to_load, weights_only)
from megatron.training.initialize import (  # noqa: E402
    build_tokenizer_from_config, initialize_from_config)
from megatron.training.models import gpt_model_from  # noqa: E402

_PROG = "tools/generate.py"


@dataclasses.dataclass(kw_only=True)
class GenerationFlags:
    """What to generate and how to sample."""

    prompt: list[str] | None = spec(None, repeat=True)
    """Prompt to continue (repeat the flag for several prompts)."""
    num_tokens_to_generate: int = 30
    """Tokens to generate per prompt (>= 0; the prompt plus these must fit
    --max-position-embeddings)."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_k: int = spec(0, flag="--top_k")
    """Top-k sampling (0 = off, 1 = greedy)."""
    top_p: float = spec(0.0, flag="--top_p")
    """Top-p sampling, in [0, 1] (0 = off; exclusive with --top_k)."""
    greedy: bool = False
    """Greedy decoding."""
    random_seed: int = 1234
    """Sampling seed."""
    kv_cache: bool = True
    """Keep keys and values between steps (--no-kv-cache recomputes the whole sequence every
    step: slower, the reference for checking)."""


TOOL_SECTIONS = [(GenerationFlags, "text generation")]


def check_generation_flags(ex: GenerationFlags, load: str | None, ckpt_step: int | None,
                           random_weights: bool) -> None:
    """The tool's own flags, and that a checkpoint will be loaded, before any process group or
    model exists.

    Args:
        ex: the parsed tool flags.
        load: ``--load``. ckpt_step: ``--ckpt-step``.

    Raises:
        ValueError: naming the flag, the value or path, and what to change.
    """
    if ex.num_tokens_to_generate < 0:
        raise ValueError(f"--num-tokens-to-generate ({ex.num_tokens_to_generate}) must be >= 0")
    check_sampling_options(top_k=ex.top_k, top_p=ex.top_p, temperature=ex.temperature)
    check_checkpoint_flags(load, ckpt_step, random_weights)


def _check_flags_given(flags) -> None:
    ck = flags.checkpoint
    check_generation_flags(flags.section(GenerationFlags), ck.load, ck.ckpt_step,
                           ck.random_weights)


# Run by validate(), before any process group starts; an error exits on one line.
TOOL_CHECKS = ToolChecks(given=[_check_flags_given,
                                refuse_context_parallel("text generation")])


def check_checkpoint_flags(load: str | None, ckpt_step: int | None,
                           random_weights: bool) -> None:
    """A checkpoint will be loaded (or --random-weights asks for none); see
    :func:`~megatron.training.inference.check_checkpoint_to_load`."""
    check_checkpoint_to_load(load, ckpt_step, random_weights, purpose="generate from")


def generate(argv: list[str] | None = None) -> list[str]:
    """Parse, check, load and generate; returns the texts (prompt included), one per prompt.

    Raises:
        SystemExit: a bad flag, a missing checkpoint or a prompt too long for the model, with a
            one-line message, before the model is built.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    flags, parser = parse_command_line(argv, prog=_PROG, tool_sections=TOOL_SECTIONS)
    # Weights only: refuse to start from random weights if the checkpoint vanished meanwhile.
    cfg = initialize_from_config(weights_only(flags), parser, tool_checks=TOOL_CHECKS)
    ex = cfg.section(GenerationFlags)
    tokenizer = build_tokenizer_from_config(cfg)
    prompts = [p if p else tokenizer.detokenize([tokenizer.eod]) for p in ex.prompt or [""]]
    encoded = [tokenizer.tokenize(p) for p in prompts]
    max_positions = cfg.model.max_position_embeddings
    _or_exit(check_generation_lengths, [len(ids) for ids in encoded], ex.num_tokens_to_generate,
             max_positions)
    model = gpt_model_from(cfg, inference=True).to(device.get_device())
    if not cfg.checkpoint.random_weights:
        load_checkpoint([model], None, None, cfg)
    out = generate_tokens(model, encoded, ex.num_tokens_to_generate, eod=tokenizer.eod,
                          vocab_size=tokenizer.vocab_size, max_sequence_length=max_positions,
                          greedy=ex.greedy, top_k=ex.top_k, top_p=ex.top_p,
                          temperature=ex.temperature, seed=ex.random_seed,
                          use_kv_cache=ex.kv_cache, mp_group=comm.world_group(),
                          pp_group=parallel_state.get_pipeline_model_parallel_group())
    texts = [tokenizer.detokenize(ids) for ids in out]
    for prompt, text in zip(prompts, texts):
        log_rank_0(f"--- prompt: {prompt!r}\n{text}\n")
    return texts


def _or_exit(check, *args) -> None:
    try:
        check(*args)
    except ValueError as err:
        raise SystemExit(f"{_PROG}: error: {err}") from None


def main(argv: list[str] | None = None) -> list[str]:
    texts = generate(argv)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return texts


if __name__ == "__main__":
    # Any error ends this rank at once and stops the other ranks (see megatron.training.fault).
    fault.run_rank(main)
