"""Text in, text out: one generation request run on every rank (Megatron-LM's
``generate_and_post_process`` / ``beam_search_and_post_process`` and the server's command loop).

The rank serving requests (``src``, global rank 0) owns each request and broadcasts it to the
other ranks of ``mp_group``, which wait in :func:`follow_requests` (Megatron's GENERATE / BEAM
SEARCH command loop); then every rank tokenizes it identically and runs the same generation
steps, so the request's options (the random seed included) are settled before the broadcast.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron.core import comm
from megatron.core.log import get_logger
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.text_generation.beam_search import beam_search
from megatron.text_generation.generation import (SamplingOptions, StepReport, StopConditions,
                                                 generate_tokens_and_logprobs)

logger = get_logger(__name__)


@dataclass
class GenerationRequest:
    """One request's options, named as Megatron's ``PUT /api`` fields (see
    ``megatron/text_generation/server/fields.py`` for their bounds)."""

    prompts: list[str]
    tokens_to_generate: int = 64
    logprobs: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    add_BOS: bool = False
    stop_on_double_eol: bool = False
    stop_on_eol: bool = False
    prevent_newline_after_colon: bool = False
    random_seed: int = -1
    beam_width: int | None = None
    stop_token: int | None = None
    length_penalty: float = 1.0
    top_logprobs: int = 0
    """How many most likely tokens to report at each position (the OpenAI endpoint)."""


@dataclass
class GenerationResult:
    """Per prompt: the text (prompt included), its tokens' texts (``segments``), the ids, the
    log-probs of every token after the first (when asked), how many ids are the prompt's,
    whether a stop condition ended it; beam search adds ``scores`` (one text per hypothesis)."""

    text: list[str]
    segments: list[list[str]]
    tokens: list[list[int]]
    prompt_lengths: list[int]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[tuple[list[int], list[float]]]] | None = None
    stopped: list[bool] = field(default_factory=list)
    scores: list[float] | None = None


def special_tokens(tokenizer) -> dict[str, int | None]:
    """The ids Megatron's stop rules use: end of document, "\\n", "\\n\\n", ":" (None where
    the tokenizer has no single token for them; Megatron hard-codes GPT-2's 198 and 628)."""
    def single(text: str) -> int | None:
        try:
            ids = tokenizer.tokenize(text)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it has no such id
            return None
        return ids[0] if len(ids) == 1 else None

    return {"eod": getattr(tokenizer, "eod", None), "eol": single("\n"),
            "double_eol": single("\n\n"), "colon": single(":")}


def tokenize_prompts(tokenizer, request: GenerationRequest) -> list[list[int]]:
    """Each prompt's ids, the end-of-document id first with ``add_BOS``."""
    bos = [tokenizer.eod] if request.add_BOS else []
    return [bos + list(tokenizer.tokenize(p)) for p in request.prompts]


def settle_seed(request: GenerationRequest) -> GenerationRequest:
    """A request whose ``random_seed`` is fixed (-1 draws one here, on the serving rank, so
    every rank samples alike)."""
    if request.random_seed >= 0:
        return request
    return dataclasses.replace(request, random_seed=random.SystemRandom().randrange(2**31))


def run_request(model: torch.nn.Module, tokenizer, request: GenerationRequest, *,
                max_sequence_length: int, use_kv_cache: bool = True,
                mp_group: ProcessGroup | None = None, pp_group: ProcessGroup | None = None,
                src: int = 0, on_step: Callable[[StepReport], list[bool] | None] | None = None
                ) -> GenerationResult:
    """Run ``request`` (on every rank of ``mp_group``; ``on_step`` is called on ``src`` only).

    Raises:
        ValueError: a prompt too long for the model, an empty prompt, bad options; before any
            forward pass and alike on every rank.
    """
    request = settle_seed(request)
    prompts = tokenize_prompts(tokenizer, request)
    special = special_tokens(tokenizer)
    if request.beam_width is not None:
        return _beam(model, tokenizer, request, prompts, special, max_sequence_length,
                     use_kv_cache, mp_group, pp_group, src)
    out = generate_tokens_and_logprobs(
        model, prompts, request.tokens_to_generate, max_sequence_length=max_sequence_length,
        sampling=SamplingOptions(top_k=request.top_k, top_p=request.top_p,
                                 top_p_decay=request.top_p_decay,
                                 top_p_bound=request.top_p_bound,
                                 temperature=request.temperature, seed=request.random_seed),
        stops=StopConditions(
            eod=special["eod"], eol=special["eol"], double_eol=special["double_eol"],
            colon=special["colon"], stop_token=request.stop_token,
            stop_on_eol=request.stop_on_eol, stop_on_double_eol=request.stop_on_double_eol,
            prevent_newline_after_colon=request.prevent_newline_after_colon),
        vocab_size=tokenizer.vocab_size, return_logprobs=request.logprobs,
        top_logprobs=request.top_logprobs, use_kv_cache=use_kv_cache, mp_group=mp_group,
        pp_group=pp_group, src=src, on_step=on_step)
    return GenerationResult(
        text=[tokenizer.detokenize(t) for t in out.tokens],
        segments=[token_texts(tokenizer, t) for t in out.tokens], tokens=out.tokens,
        prompt_lengths=[len(p) for p in prompts], logprobs=out.logprobs,
        top_logprobs=out.top_logprobs, stopped=out.stopped)


def _beam(model, tokenizer, request, prompts, special, max_sequence_length, use_kv_cache,
          mp_group, pp_group, src) -> GenerationResult:
    if len(prompts) != 1:
        raise ValueError(f"beam search takes one prompt; got {len(prompts)}")
    stop = request.stop_token if request.stop_token is not None else special["eod"]
    out = beam_search(model, prompts[0], request.tokens_to_generate,
                      beam_width=request.beam_width, max_sequence_length=max_sequence_length,
                      stop_token=stop, length_penalty=request.length_penalty,
                      num_return=request.beam_width, vocab_size=tokenizer.vocab_size,
                      colon=special["colon"], eol=special["eol"],
                      prevent_newline_after_colon=request.prevent_newline_after_colon,
                      use_kv_cache=use_kv_cache, mp_group=mp_group, pp_group=pp_group, src=src)
    return GenerationResult(
        text=[tokenizer.detokenize(t) for t in out.tokens],
        segments=[token_texts(tokenizer, t) for t in out.tokens], tokens=out.tokens,
        prompt_lengths=[len(prompts[0])] * len(out.tokens),
        stopped=[t[-1] == stop for t in out.tokens], scores=out.scores)


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (Megatron's ``segments``)."""
    return [tokenizer.detokenize([i]) for i in ids]


# The command loop ---------------------------------------------------------------------------
_SHUTDOWN = None


def lead_request(model: torch.nn.Module, tokenizer, request: GenerationRequest, *,
                 max_sequence_length: int, use_kv_cache: bool = True,
                 mp_group: ProcessGroup | None = None, pp_group: ProcessGroup | None = None,
                 src: int = 0, on_step: Callable[[StepReport], list[bool] | None] | None = None
                 ) -> GenerationResult:
    """On ``src``: settle the seed, send the request to the other ranks (waiting in
    :func:`follow_requests`) and run it with them.

    Raises:
        ValueError: as :func:`run_request` (the other ranks meet the same error and go on
            waiting).
    """
    request = settle_seed(request)
    comm.broadcast_object(request, src, mp_group)
    return run_request(model, tokenizer, request, max_sequence_length=max_sequence_length,
                       use_kv_cache=use_kv_cache, mp_group=mp_group, pp_group=pp_group,
                       src=src, on_step=on_step)


def stop_followers(mp_group: ProcessGroup | None, src: int = 0) -> None:
    """On ``src``: end the other ranks' :func:`follow_requests` loops."""
    comm.broadcast_object(_SHUTDOWN, src, mp_group)


def follow_requests(model: torch.nn.Module, tokenizer, *, max_sequence_length: int,
                    use_kv_cache: bool = True, mp_group: ProcessGroup | None = None,
                    pp_group: ProcessGroup | None = None, src: int = 0) -> int:
    """On the ranks other than ``src``: run every request ``src`` sends until it sends the
    shutdown; returns the number of requests run."""
    count = 0
    while True:
        request = comm.broadcast_object(None, src, mp_group)
        if request is _SHUTDOWN:
            return count
        count += 1
        try:
            run_request(model, tokenizer, request, max_sequence_length=max_sequence_length,
                        use_kv_cache=use_kv_cache, mp_group=mp_group, pp_group=pp_group, src=src)
        except ValueError as err:  # the serving rank reports it to the client
            logger.debug("request refused: %s", err)
