"""Greedy, top-k, top-p (nucleus) and temperature sampling (Megatron's sampling.py semantics)."""

from __future__ import annotations

import math

import torch


def _mask_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _mask_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative > top_p
    # Keep the first token that crosses the threshold (shift the mask right by one).
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = torch.zeros_like(remove).scatter(-1, order, remove)
    return logits.masked_fill(mask, float("-inf"))


def check_sampling_options(*, top_k: int = 0, top_p: float = 0.0,
                           temperature: float = 1.0) -> None:
    """Megatron-LM's limits on the sampling options (its text generation server's checks).

    Raises:
        ValueError: naming the option (as ``tools/generate.py`` spells it), its value and the
            allowed range.
    """
    if top_k < 0:
        raise ValueError(f"--top_k ({top_k}) must be >= 0 (0 turns top-k sampling off, "
                         "1 is greedy)")
    if not 0.0 <= top_p <= 1.0:  # also refuses nan
        raise ValueError(f"--top_p ({top_p}) must be in [0, 1] (0 turns top-p sampling off)")
    if top_k > 0 and top_p > 0.0:
        raise ValueError(f"--top_k ({top_k}) and --top_p ({top_p}) are mutually exclusive: "
                         "set one of them to 0")
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"--temperature ({temperature}) must be a finite number > 0")


def sample(logits: torch.Tensor, *, greedy: bool = False, top_k: int = 0, top_p: float = 0.0,
           temperature: float = 1.0, vocab_size: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token from ``logits`` ``[b, V]``.

    Args:
        greedy: argmax (top_k == 1 means the same).
        top_k: keep the k most likely tokens (0 = off). top_p: nucleus threshold (0 = off);
            top_k and top_p are exclusive, as in Megatron-LM.
        temperature: divide logits by this before sampling.
        vocab_size: real vocabulary size; padded entries beyond it are never sampled.
        generator: RNG (the same seed on every TP rank gives the same tokens everywhere).

    Returns:
        ``[b]`` token ids.

    Raises:
        ValueError: an option out of range (see :func:`check_sampling_options`).
    """
    check_sampling_options(top_k=top_k, top_p=top_p, temperature=temperature)
    logits = logits.float()
    if greedy or top_k == 1:
        # Padded ids (beyond vocab_size) are never picked: argmax over the real ones, no copy.
        return logits[..., :vocab_size].argmax(dim=-1)
    if vocab_size is not None and vocab_size < logits.size(-1):
        # A copy: .float() of fp32 logits is the caller's tensor, whose log-probs (over the
        # whole padded vocabulary, as Megatron's) are still to be read.
        logits = logits.clone()
        logits[..., vocab_size:] = float("-inf")
    logits = logits / temperature
    if top_k > 1:
        logits = _mask_top_k(logits, min(top_k, logits.size(-1)))
    elif top_p > 0.0:
        logits = _mask_top_p(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)


def decay_top_p(top_p: float, top_p_decay: float, top_p_bound: float) -> float:
    """Megatron's per-step top-p schedule: ``top_p * top_p_decay``, kept at least
    ``top_p_bound`` (0 turns either off; top-p off stays off)."""
    if top_p > 0.0 and top_p_decay > 0.0:
        top_p = top_p * top_p_decay
        if top_p_bound > 0.0:
            top_p = max(top_p, top_p_bound)
    return top_p
