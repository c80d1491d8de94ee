"""Generate continuations with a GPT model whose logits may be split over TP ranks.

The full forward pass is recomputed for every new token (no KV cache): simple and exact, and
fast enough for the small models this is used with on CPUs. Every TP rank gathers the full
logits and samples with the same seeded generator, so all ranks pick the same tokens. As in
Megatron-LM, a prompt plus the tokens to generate must fit the position embeddings: nothing is
silently cut off the front of a prompt.
"""

from __future__ import annotations

import torch

from megatron.core import device, parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.text_generation.sampling import check_sampling_options, sample


@torch.no_grad()
def generate_tokens(model: torch.nn.Module, prompts: list[list[int]], tokens_to_generate: int,
                    *, eod: int | None = None, vocab_size: int | None = None,
                    max_sequence_length: int, greedy: bool = False, top_k: int = 0,
                    top_p: float = 0.0, temperature: float = 1.0, seed: int = 1234,
                    stop_on_eod: bool = True) -> list[list[int]]:
    """Extend each prompt by up to ``tokens_to_generate`` tokens.

    Returns:
        The prompt plus generated ids, per prompt (stopped after the end-of-document token).

    Raises:
        ValueError: an empty prompt, a prompt that would outgrow ``max_sequence_length``, or a
            sampling option out of range; raised before any forward pass.
    """
    check_generation_lengths([len(p) for p in prompts], tokens_to_generate, max_sequence_length)
    check_sampling_options(top_k=top_k, top_p=top_p, temperature=temperature)
    model.eval()
    dev = device.get_device()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tp_group = parallel_state.get_tensor_model_parallel_group() \
        if parallel_state.model_parallel_is_initialized() else None
    outputs = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(tokens_to_generate):
            ids = torch.tensor([tokens], dtype=torch.long, device=dev)  # [1, s]
            positions = torch.arange(len(tokens), device=dev).unsqueeze(0)  # [1, s]
            logits = model(ids, positions, None)  # [1, s, V/p]
            last = logits[:, -1, :]  # [1, V/p]
            if tp_group is not None:
                last = gather_from_tensor_model_parallel_region(last, tp_group)  # [1, V]
            nxt = int(sample(last.cpu(), greedy=greedy, top_k=top_k, top_p=top_p,
                             temperature=temperature, vocab_size=vocab_size,
                             generator=generator)[0])
            tokens.append(nxt)
            if stop_on_eod and eod is not None and nxt == eod:
                break
        outputs.append(tokens)
    return outputs


def check_generation_lengths(prompt_lengths: list[int], tokens_to_generate: int,
                             max_sequence_length: int) -> None:
    """Megatron-LM's length checks: every prompt has a token, and the prompt plus the tokens
    to generate fit the position embeddings (nothing is cut off the front of a prompt).

    Raises:
        ValueError: naming the prompt (by its number), the lengths and the options to change.
    """
    if tokens_to_generate < 0:
        raise ValueError(f"--num-tokens-to-generate ({tokens_to_generate}) must be >= 0")
    if not prompt_lengths:
        raise ValueError("no prompt to continue")
    for i, length in enumerate(prompt_lengths):
        if length == 0:
            raise ValueError(f"prompt {i} has no tokens: every prompt needs at least one")
        if length + tokens_to_generate > max_sequence_length:
            raise ValueError(
                f"prompt {i} has {length} tokens; with --num-tokens-to-generate "
                f"({tokens_to_generate}) that makes {length + tokens_to_generate}, more than the "
                f"model's {max_sequence_length} positions (--max-position-embeddings): shorten "
                "the prompt or generate fewer tokens")


def generate_text(model: torch.nn.Module, tokenizer, prompts: list[str], tokens_to_generate: int,
                  *, max_sequence_length: int, **sampling) -> list[str]:
    """Tokenize, generate, detokenize (prompt included).

    Raises:
        ValueError: as :func:`generate_tokens`.
    """
    encoded = [tokenizer.tokenize(p) for p in prompts]
    out = generate_tokens(model, encoded, tokens_to_generate, eod=tokenizer.eod,
                          vocab_size=tokenizer.vocab_size, max_sequence_length=max_sequence_length,
                          **sampling)
    return [tokenizer.detokenize(ids) for ids in out]
