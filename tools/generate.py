"""Generate text from a checkpoint: greedy, top-k or top-p sampling.

    torchrun --nproc-per-node 2 tools/generate.py --load ckpt/ --use-checkpoint-args \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --prompt "It was a dark and stormy night" --num-tokens-to-generate 40 --top_p 0.9

The tensor-parallel size must match the checkpoint's (--use-checkpoint-args takes it, and the
architecture, from the checkpoint: launch that many processes).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.core import device  # noqa: E402
from megatron.core.log import log_rank_0  # noqa: E402
from megatron.core.models.gpt import gpt_model_from  # noqa: E402
from megatron.text_generation import generate_text  # noqa: E402
from megatron.training.checkpointing import load_checkpoint  # noqa: E402
from megatron.training.initialize import (  # noqa: E402
    build_tokenizer_from_config, initialize_megatron)


def add_generation_args(parser):
    group = parser.add_argument_group("text generation")
    group.add_argument("--prompt", action="append", default=None,
                       help="Prompt to continue (repeat the flag for several prompts).")
    group.add_argument("--num-tokens-to-generate", type=int, default=30,
                       help="Tokens to generate per prompt.")
    group.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    group.add_argument("--top_k", type=int, default=0, help="Top-k sampling (0 = off, 1 = greedy).")
    group.add_argument("--top_p", type=float, default=0.0, help="Top-p sampling (0 = off).")
    group.add_argument("--greedy", action="store_true", help="Greedy decoding.")
    group.add_argument("--random-seed", type=int, default=1234, help="Sampling seed.")
    return parser


def main(argv: list[str] | None = None) -> list[str]:
    cfg = initialize_megatron(argv, extra_args_provider=add_generation_args)
    cfg.checkpoint.no_load_optim = cfg.checkpoint.no_load_rng = True
    if cfg.checkpoint.load is None:
        raise SystemExit("tools/generate.py: error: --load is required")
    tokenizer = build_tokenizer_from_config(cfg)
    model = gpt_model_from(cfg).to(device.get_device())
    load_checkpoint([model], None, None, cfg)
    ex = cfg.extra
    prompts = ex.prompt or [""]
    prompts = [p if p else tokenizer.detokenize([tokenizer.eod]) for p in prompts]
    texts = generate_text(model, tokenizer, prompts, ex.num_tokens_to_generate,
                          max_sequence_length=cfg.data.seq_length or
                          cfg.model.max_position_embeddings,
                          greedy=ex.greedy, top_k=ex.top_k, top_p=ex.top_p,
                          temperature=ex.temperature, seed=ex.random_seed)
    for prompt, text in zip(prompts, texts):
        log_rank_0(f"--- prompt: {prompt!r}\n{text}\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return texts


if __name__ == "__main__":
    main()
