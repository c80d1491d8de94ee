"""Batched autoregressive generation with a KV cache (Megatron-LM's
``generate_tokens_probs_and_return_on_first_stage`` and ``score_and_return_on_first_stage``).

The prompts of a batch are right-padded. Generation starts at the shortest prompt's length: the
first forward (prefill) runs every row's first ``min_length`` tokens through the model and fills
the KV cache; each later step feeds one position. A row whose prompt is longer simply keeps its
own prompt token at that position (it has not "started"), so every row only ever attends to its
own real tokens and its tokens and log-probs equal those of generating it alone. Unlike
Megatron-LM, every prompt gets at most ``tokens_to_generate`` new tokens (Megatron lets shorter
prompts of a batch run on to the longest prompt's end).

Every rank of ``mp_group`` (TP x PP) runs the same steps. With pipeline parallelism each step's
activations pass stage to stage (:class:`StageForward`); the last stage's TP ranks gather the
full logits and sample, and the sampled tokens and log-probs are broadcast from the last stage
over the pipeline (Megatron's ``broadcast_from_last_pipeline_stage``). The source rank (which
serves the request) then broadcasts its stop decisions and tokens to every rank, so all agree
on what comes next. ``use_kv_cache=False`` recomputes the whole sequence every step: the
reference the cache is checked against.

Legend: b batch, s sequence, V padded vocabulary, p TP size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatron.core import comm, device
from megatron.core.inference_params import InferenceParams
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.text_generation.sampling import check_sampling_options, decay_top_p, sample

_NEWLINE_BLOCKED = -1e10
"""The logit Megatron gives "\\n" right after ":" with ``prevent_newline_after_colon``."""


@dataclass(frozen=True)
class SamplingOptions:
    """How the next token is picked (Megatron's ``sample``): ``top_k`` 1 is greedy, 0 off;
    ``top_p`` 0 off, multiplied by ``top_p_decay`` after every step but kept at least
    ``top_p_bound`` (both 0 = off); ``temperature`` divides the logits."""

    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    temperature: float = 1.0
    seed: int = 1234

    def __post_init__(self) -> None:
        check_sampling_options(top_k=self.top_k, top_p=self.top_p, temperature=self.temperature)


@dataclass(frozen=True)
class StopConditions:
    """When a row stops (Megatron's termination rules). ``eod`` ends a row unless
    ``stop_on_double_eol``/``stop_on_eol`` replace it (as Megatron: those two modes stop on line
    breaks instead); ``stop_token`` overrides ``eod`` as the terminating id."""

    eod: int | None = None
    eol: int | None = None
    double_eol: int | None = None
    colon: int | None = None
    stop_token: int | None = None
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    stop_on_eod: bool = True
    prevent_newline_after_colon: bool = False


@dataclass
class StepReport:
    """What one step added, for streaming: rows that took a new token, the token, the token's
    log-prob (None unless log-probs are computed) and the most likely tokens there
    (``(ids, log-probs)`` per row; None unless asked for)."""

    rows: list[int]
    tokens: list[int]
    logprobs: list[float] | None
    top: list[tuple[list[int], list[float]]] | None = None


@dataclass
class GenerationOutput:
    """Per row: the prompt plus generated ids (a stop token included), the log-prob of every
    token after the first (``len(tokens) - 1`` values) when asked for, the top log-probs at
    those positions (``[(ids, values)]``) when asked for, and whether it stopped on a stop
    condition (else it ran out of tokens or was cancelled)."""

    tokens: list[list[int]]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[tuple[list[int], list[float]]]] | None = None
    stopped: list[bool] = field(default_factory=list)


@torch.no_grad()
def generate_tokens_and_logprobs(
        model: torch.nn.Module, prompts: list[list[int]], tokens_to_generate: int, *,
        max_sequence_length: int, sampling: SamplingOptions = SamplingOptions(),
        stops: StopConditions = StopConditions(), vocab_size: int | None = None,
        return_logprobs: bool = False, top_logprobs: int = 0, use_kv_cache: bool = True,
        mp_group: ProcessGroup | None = None, pp_group: ProcessGroup | None = None,
        src: int = 0,
        on_step: Callable[[StepReport], list[bool] | None] | None = None) -> GenerationOutput:
    """Generate up to ``tokens_to_generate`` tokens after each prompt (0: score the prompts).

    Args:
        model: a GPT stage (``model(ids, positions, None, inference_params=...)`` returns
            logits ``[b, s, V/p]``).
        prompts: token ids per prompt (lengths may differ).
        max_sequence_length: the model's positions (a prompt plus its tokens must fit).
        sampling, stops: see :class:`SamplingOptions`, :class:`StopConditions`.
        vocab_size: real vocabulary size (padded ids beyond it are never sampled).
        return_logprobs: compute the log-probs of the prompt and generated tokens.
        top_logprobs: also the ``top_logprobs`` most likely tokens at each position.
        use_kv_cache: False recomputes the whole sequence every step (the reference).
        mp_group: the ranks holding the model (TP x PP; the server passes the world, so every
            rank takes part; None = this rank alone).
        pp_group: this rank's pipeline (``model`` is one stage of it; None = one stage).
        src: global rank whose tokens and stop decisions every rank adopts (the one serving
            the request).
        on_step: called on ``src`` after every step; may return per-row "stop now" flags
            (a client disconnected, a stop string appeared).

    Raises:
        ValueError: an empty prompt, a prompt that would outgrow ``max_sequence_length``, or a
            sampling option out of range; before any forward pass.
    """
    check_generation_lengths([len(p) for p in prompts], tokens_to_generate, max_sequence_length)
    model.eval()
    run = _Run(model, prompts, tokens_to_generate, sampling, stops, vocab_size,
               return_logprobs or top_logprobs > 0, top_logprobs, use_kv_cache, mp_group, src,
               pp_group)
    if tokens_to_generate == 0:
        run.score()
    else:
        run.generate(on_step)
    return run.output(return_logprobs, top_logprobs > 0)


class StageForward:
    """One forward through the pipeline (Megatron's ``ForwardStep``): the first stage embeds the
    ids, each stage receives the previous stage's activation ``[s, b, h]`` and sends its own on;
    the last stage returns the logits ``[b, s, V/p]``, the others None. The whole batch passes
    as one micro-batch (the stages take turns; no pipelining within a step)."""

    def __init__(self, model: torch.nn.Module, pp_group: ProcessGroup | None) -> None:
        self.model = model
        self.first = getattr(model, "pre_process", True)
        self.last = getattr(model, "post_process", True)
        self.p2p = None
        if comm.world_size(pp_group) > 1:
            self.p2p = P2PCommunicator(pp_group, dtype=model.config.params_dtype)
            self.hidden = model.config.hidden_size

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 inference_params: InferenceParams | None) -> torch.Tensor | None:
        kwargs = {"inference_params": inference_params} if inference_params is not None else {}
        if not self.first:
            b, s = ids.shape
            self.model.set_input_tensor(self.p2p.recv_forward((s, b, self.hidden)))
            ids = positions = None
        out = self.model(ids, positions, None, **kwargs)
        if not self.last:
            self.p2p.send_forward(out)  # [s, b, h]
            return None
        return out


def last_stage_rank(pp_group: ProcessGroup | None) -> int:
    """Global rank of the last stage of this rank's pipeline (this rank with one stage)."""
    return comm.global_rank(pp_group, comm.world_size(pp_group) - 1) \
        if comm.world_size(pp_group) > 1 else comm.rank(comm.world_group())


class _Run:
    """The state of one batch's generation: padded tokens, per-row lengths, log-probs."""

    def __init__(self, model, prompts, tokens_to_generate, sampling, stops, vocab_size,
                 want_logprobs, top_logprobs, use_kv_cache, mp_group, src, pp_group) -> None:
        self.model, self.sampling, self.stops = model, sampling, stops
        self.vocab_size, self.mp_group, self.src = vocab_size, mp_group, src
        self.want_logprobs, self.top_k_logprobs = want_logprobs, top_logprobs
        self.dev = device.get_device()
        self.prompt_lengths = torch.tensor([len(p) for p in prompts], device="cpu")
        # Each row's end: its own prompt plus tokens_to_generate (shortened by a stop).
        self.final_lengths = self.prompt_lengths + tokens_to_generate
        self.max_length = int(self.final_lengths.max())
        b = len(prompts)
        pad = stops.eod if stops.eod is not None else 0
        self.tokens = torch.full((b, self.max_length), pad, dtype=torch.long, device="cpu")  # [b, s]
        for i, p in enumerate(prompts):
            self.tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long, device="cpu")
        self.logprobs = torch.zeros(b, max(self.max_length - 1, 0), dtype=torch.float64, device="cpu")
        self.top_ids = torch.zeros(b, max(self.max_length - 1, 0), top_logprobs,
                                   dtype=torch.long, device="cpu")
        self.top_values = torch.zeros(b, max(self.max_length - 1, 0), top_logprobs,
                                      dtype=torch.float64, device="cpu")
        self.finished = torch.zeros(b, dtype=torch.bool, device="cpu")
        self.stopped = torch.zeros(b, dtype=torch.bool, device="cpu")
        self.lengths = self.final_lengths.clone()  # shortened where a row stops
        # Without log-probs only the last position's logits are read (sampling).
        self.cache = InferenceParams(
            b, self.max_length, materialize_only_last_token_logits=not want_logprobs) \
            if use_kv_cache else None
        self.generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
        self.tp_group = model_tp_group(model)
        self.forward = StageForward(model, pp_group)
        self.pp_group = pp_group

    # Forward -------------------------------------------------------------------------------
    def logits(self, start: int, end: int) -> torch.Tensor | None:
        """Full-vocabulary logits ``[b, end - start, V]`` (fp32 or wider, on the CPU) of
        positions ``start..end-1`` on the last pipeline stage (None on the others); with the
        cache only those positions are fed."""
        first = start if self.cache is not None else 0
        ids = self.tokens[:, first:end].to(self.dev)  # [b, s]
        positions = torch.arange(first, end, device=self.dev).unsqueeze(0).expand_as(ids)
        out = self.forward(ids, positions, self.cache)  # [b, s, V/p] or None
        if self.cache is not None:
            self.cache.sequence_len_offset = end
        if out is None:
            return None
        out = out[:, start - first:]
        if self.tp_group is not None:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)  # [b, s, V]
        out = out.cpu()
        return out if out.dtype == torch.float64 else out.float()

    def record_logprobs(self, logits: torch.Tensor | None, start: int, end: int) -> None:
        """Log-probs of tokens ``start+1..end`` given their prefixes (Megatron: the raw logits,
        before temperature, after the newline-after-colon block), computed on the last stage
        and sent to the others."""
        if not self.want_logprobs:
            return
        b, s, k = self.tokens.size(0), end - start, self.top_k_logprobs
        packed = torch.zeros(b, s, 1 + 2 * k, dtype=torch.float64, device="cpu")  # [b, s, 1 + 2k]
        if logits is not None:
            log_probs = F.log_softmax(logits, dim=-1)  # [b, s, V]
            targets = self.tokens[:, start + 1:end + 1].unsqueeze(-1)  # [b, s, 1]
            packed[..., 0] = torch.gather(log_probs, 2, targets).squeeze(-1).double()
            if k:
                values, ids = torch.topk(log_probs, k, dim=-1)  # [b, s, k]
                packed[..., 1:1 + k] = ids.double()
                packed[..., 1 + k:] = values.double()
        packed = self.from_last_stage(packed)
        self.logprobs[:, start:end] = packed[..., 0]
        if k:
            self.top_ids[:, start:end] = packed[..., 1:1 + k].long()
            self.top_values[:, start:end] = packed[..., 1 + k:]

    def from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the last pipeline stage has it (Megatron's
        ``broadcast_from_last_pipeline_stage``; as is with one stage)."""
        if comm.world_size(self.pp_group) == 1:
            return tensor
        tensor = tensor.to(self.dev)
        comm.broadcast(tensor, last_stage_rank(self.pp_group), self.pp_group)
        return tensor.cpu()

    # Scoring (tokens_to_generate == 0) -----------------------------------------------------
    def score(self) -> None:
        """One forward over the prompts: the log-prob of every prompt token."""
        if self.max_length > 1:
            self.record_logprobs(self.logits(0, self.max_length - 1), 0, self.max_length - 1)
        self.finished[:] = True

    # Generation ----------------------------------------------------------------------------
    def generate(self, on_step) -> None:
        top_p = self.sampling.top_p
        start = int(self.prompt_lengths.min())
        for context in range(start, self.max_length):
            prev = context - 1 if context > start else 0
            logits = self.logits(prev, context)  # [b, s, V] on the last stage, else None
            new = torch.zeros(self.tokens.size(0), dtype=torch.long, device="cpu")
            if logits is not None:
                self.block_newline_after_colon(logits, context)
                new = sample(logits[:, -1, :], top_k=self.sampling.top_k, top_p=top_p,
                             temperature=self.sampling.temperature, vocab_size=self.vocab_size,
                             generator=self.generator)  # [b]
            new = self.from_last_stage(new)
            top_p = decay_top_p(top_p, self.sampling.top_p_decay, self.sampling.top_p_bound)
            started = (self.prompt_lengths <= context) & ~self.finished
            self.tokens[started, context] = new[started]
            hit_stop = self.stop_hit(new, context) & started
            stop_now = self.agree(started, hit_stop, context, logits, prev, on_step)
            self.finished |= stop_now | (self.final_lengths <= context + 1)
            if bool(self.finished.all()):
                break

    def block_newline_after_colon(self, logits: torch.Tensor, context: int) -> None:
        s = self.stops
        if s.prevent_newline_after_colon and s.colon is not None and s.eol is not None:
            after_colon = self.tokens[:, context - 1] == s.colon
            logits[after_colon, -1, s.eol] = _NEWLINE_BLOCKED

    def stop_hit(self, new: torch.Tensor, context: int) -> torch.Tensor:
        """Rows whose new token ends them (Megatron's three modes)."""
        s = self.stops
        hit = torch.zeros_like(new, dtype=torch.bool)
        if s.stop_on_double_eol or s.stop_on_eol:
            if s.double_eol is not None:
                hit |= new == s.double_eol
            if s.eol is not None:
                if s.stop_on_double_eol:
                    hit |= (new == s.eol) & (self.tokens[:, context - 1] == s.eol)
                else:
                    hit |= new == s.eol
            return hit
        terminal = s.stop_token if s.stop_token is not None else s.eod
        if s.stop_on_eod and terminal is not None:
            hit |= new == terminal
        return hit

    def agree(self, started, hit_stop, context, logits, prev, on_step) -> torch.Tensor:
        """Make every rank take ``src``'s tokens at ``context`` and its stop flags (one
        broadcast), record log-probs and report the step; returns the rows stopping now."""
        stop_now = hit_stop.clone()
        self.record_logprobs(logits, prev, context)
        if on_step is not None and self.is_src():
            rows = [int(i) for i in torch.nonzero(started).view(-1)]
            lps = [float(self.logprobs[i, context - 1]) for i in rows] \
                if self.want_logprobs else None
            top = [(self.top_ids[i, context - 1].tolist(), self.top_values[i, context - 1].tolist())
                   for i in rows] if self.top_k_logprobs else None
            extra = on_step(StepReport(rows, [int(self.tokens[i, context]) for i in rows], lps,
                                       top))
            if extra is not None:
                stop_now |= torch.tensor(extra, dtype=torch.bool, device="cpu") & ~self.finished
        if comm.world_size(self.mp_group) > 1:  # alone, this rank's decisions are final
            shared = torch.cat([self.tokens[:, context], stop_now.long(),
                                hit_stop.long()]).to(self.dev)  # [3b]
            comm.broadcast(shared, self.src, self.mp_group)
            shared = shared.cpu()
            b = self.tokens.size(0)
            self.tokens[:, context] = shared[:b]
            stop_now, hit_stop = shared[b:2 * b].bool(), shared[2 * b:].bool()
        self.stopped |= hit_stop & ~self.finished
        self.lengths[stop_now & ~self.finished] = context + 1
        return stop_now

    def is_src(self) -> bool:
        return self.mp_group is None or comm.rank(comm.world_group()) == self.src

    def output(self, return_logprobs: bool, return_top: bool) -> GenerationOutput:
        lengths = [int(n) for n in self.lengths]
        tokens = [self.tokens[i, :n].tolist() for i, n in enumerate(lengths)]
        out = GenerationOutput(tokens=tokens, stopped=self.stopped.tolist())
        if return_logprobs:
            out.logprobs = [self.logprobs[i, :n - 1].tolist() for i, n in enumerate(lengths)]
        if return_top:
            out.top_logprobs = [
                [(self.top_ids[i, j].tolist(), self.top_values[i, j].tolist())
                 for j in range(n - 1)] for i, n in enumerate(lengths)]
        return out


def model_tp_group(model: torch.nn.Module) -> ProcessGroup | None:
    """The TP group the model's logits are split over (the model's own: a TP=1 model built
    beside TP groups gathers nothing)."""
    return getattr(model, "tp_group", None)


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


def generate_tokens(model: torch.nn.Module, prompts: list[list[int]], tokens_to_generate: int,
                    *, eod: int | None = None, vocab_size: int | None = None,
                    max_sequence_length: int, greedy: bool = False, top_k: int = 0,
                    top_p: float = 0.0, temperature: float = 1.0, seed: int = 1234,
                    stop_on_eod: bool = True, use_kv_cache: bool = True,
                    mp_group: ProcessGroup | None = None, pp_group: ProcessGroup | None = None,
                    src: int = 0) -> list[list[int]]:
    """Extend each prompt by up to ``tokens_to_generate`` tokens (the prompt plus generated ids,
    per prompt, stopped after the end-of-document token); ``greedy`` is ``top_k=1``. See
    :func:`generate_tokens_and_logprobs` (tools/generate.py's simple entry).

    Raises:
        ValueError: an empty prompt, a prompt that would outgrow ``max_sequence_length``, or a
            sampling option out of range; raised before any forward pass.
    """
    check_generation_lengths([len(p) for p in prompts], tokens_to_generate, max_sequence_length)
    sampling = SamplingOptions(top_k=1 if greedy else top_k, top_p=0.0 if greedy else top_p,
                               temperature=temperature, seed=seed)
    out = generate_tokens_and_logprobs(
        model, prompts, tokens_to_generate, max_sequence_length=max_sequence_length,
        sampling=sampling, stops=StopConditions(eod=eod, stop_on_eod=stop_on_eod),
        vocab_size=vocab_size, use_kv_cache=use_kv_cache, mp_group=mp_group, pp_group=pp_group,
        src=src)
    return out.tokens


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
