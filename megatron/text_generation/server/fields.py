"""Request checking for the text generation server: every field's type and range, with a message
that names the field (sent back as a 400).

``PUT /api`` follows Megatron-LM's ``MegatronGenerate.put`` (field names, defaults, messages);
``POST /v1/completions`` follows OpenAI's completions request. Both produce a
:class:`~megatron.text_generation.api.GenerationRequest`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from megatron.text_generation.api import GenerationRequest

MAX_PROMPTS = 128
"""Megatron's limit on prompts per request."""
MAX_TOP_K = 1000
MAX_TEMPERATURE = 100.0
MAX_BEAM_WIDTH = 64
MAX_SEED = 2**63 - 1
MAX_OPENAI_LOGPROBS = 10
MAX_STOP_STRINGS = 4
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class FieldError(ValueError):
    """A request field of the wrong type or out of range (HTTP 400)."""


MAX_INTEGER_DIGITS = 64
"""Longer integer literals are kept as :class:`HugeInteger` (the largest field, random_seed,
has 19 digits). Python refuses to convert more than 4300 digits at all, and converting a long
one costs time quadratic in its length."""


class HugeInteger:
    """An integer literal of the request too long to be any field's value: the field check
    then names the field and says why ("got a 5001-digit integer, too large for any field")."""

    def __init__(self, literal: str) -> None:
        self.digits = len(literal.lstrip("-"))

    def __repr__(self) -> str:
        return f"a {self.digits}-digit integer, too large for any field"


def _integer_literal(literal: str) -> int | HugeInteger:
    return int(literal) if len(literal) <= MAX_INTEGER_DIGITS else HugeInteger(literal)


def decode_json_body(raw: bytes) -> Any:
    """The request body's JSON value.

    Raises:
        FieldError: not JSON, or nested deeper than Python's parser goes (about a thousand
            arrays/objects; a request needs three), each said as such.
    """
    try:
        return json.loads(raw, parse_int=_integer_literal)
    except RecursionError:
        raise FieldError("the request body nests arrays/objects too deeply for the server's "
                         "JSON parser (a request needs at most 3 levels)") from None
    except ValueError:
        raise FieldError("the request body is not valid JSON") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass(frozen=True)
class _Reader:
    """Typed access to a JSON object's fields, raising :class:`FieldError` naming the field."""

    body: dict

    def int(self, name: str, default, lo: int | None = None, hi: int | None = None,
            what: str = "an integer") -> Any:
        if name not in self.body:
            return default
        value = self.body[name]
        if value is None and default is None:  # JSON null: the default
            return None
        if not _is_int(value) or (lo is not None and value < lo) or \
                (hi is not None and value > hi):
            raise FieldError(f"{name} must be {what}{_range(lo, hi)}; got {value!r}")
        return value

    def number(self, name: str, default: float, lo: float | None = None,
               hi: float | None = None, lo_open: bool = False) -> float:
        if name not in self.body:
            return default
        value = self.body[name]
        bad = not _is_number(value) or (hi is not None and value > hi) or \
            (lo is not None and (value <= lo if lo_open else value < lo))
        if bad:
            low = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
            high = "" if hi is None else f"<= {hi}"
            bounds = " and ".join(b for b in (low, high) if b)
            raise FieldError(f"{name} must be a finite number{' ' + bounds if bounds else ''}; "
                             f"got {value!r}")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.body.get(name, default)
        if not isinstance(value, bool):
            raise FieldError(f"{name} must be a boolean value (true or false); got {value!r}")
        return value


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return f" <= {hi}" if hi is not None else ""


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise FieldError("the request body must be a JSON object")
    return body


def _prompts(value: Any, name: str, allow_empty: bool) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise FieldError(f"{name} is not a list of strings")
    if not value:
        raise FieldError(f"{name} is empty")
    if len(value) > MAX_PROMPTS:
        raise FieldError(f"Maximum number of prompts is {MAX_PROMPTS} ({name} has "
                         f"{len(value)})")
    if not allow_empty and any(len(p) == 0 for p in value):
        raise FieldError("Empty prompts require add_BOS=true")
    for i, prompt in enumerate(value):
        _check_unicode(prompt, f"{name}[{i}]")
    return value


def _check_unicode(text: str, name: str) -> None:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which are not text: no tokenizer
    can encode them (before: a 400 quoting Python's codec error, naming no field)."""
    match = _LONE_SURROGATE.search(text)
    if match is not None:
        raise FieldError(f"{name} holds a lone surrogate U+{ord(match.group()):04X} at character "
                         f"{match.start()} (half of a UTF-16 pair: not Unicode text)")


def parse_api_request(body: Any, max_sequence_length: int,
                      vocab_size: int | None = None) -> GenerationRequest:
    """Megatron's ``PUT /api`` JSON -> a request; ``vocab_size``: the tokenizer's (a
    ``stop_token`` must be one of its ids).

    Raises:
        FieldError: naming the field, its value and what it must be.
    """
    body = _object(body)
    if "max_len" in body:
        raise FieldError("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in body:
        raise FieldError("sentences is no longer used.  Replace with prompts")
    if "prompts" not in body:
        raise FieldError("prompts argument required")
    r = _Reader(body)
    add_bos = r.bool("add_BOS", False)
    prompts = _prompts(body["prompts"], "prompts", allow_empty=add_bos)
    tokens = r.int("tokens_to_generate", 64, 0, max_sequence_length)
    logprobs = r.bool("logprobs", False)
    if tokens == 0 and not logprobs:
        raise FieldError("tokens_to_generate=0 implies logprobs should be True")
    top_k = r.int("top_k", 0, 0, MAX_TOP_K)
    top_p = r.number("top_p", 0.0, 0.0, 1.0)
    if top_k > 0 and top_p > 0.0:
        raise FieldError("cannot set both top-k and top-p samplings.")
    top_p_decay = r.number("top_p_decay", 0.0, 0.0, 1.0)
    if top_p_decay > 0.0 and top_p == 0.0:
        raise FieldError("top_p_decay cannot be set without top_p")
    top_p_bound = r.number("top_p_bound", 0.0, 0.0, 1.0)
    if top_p_bound > 0.0 and top_p == 0.0:
        raise FieldError("top_p_bound cannot be set without top_p")
    if top_p_bound > top_p:
        raise FieldError(f"top_p_bound ({top_p_bound}) must be <= top_p ({top_p})")
    beam_width = r.int("beam_width", None, 1, MAX_BEAM_WIDTH)
    if beam_width is not None and len(prompts) != 1:
        raise FieldError("When doing beam_search, batch size must be 1")
    if beam_width is not None and tokens == 0:
        raise FieldError("beam_width needs tokens_to_generate >= 1")
    r.bool("no_log", False)
    return GenerationRequest(
        prompts=prompts, tokens_to_generate=tokens, logprobs=logprobs,
        temperature=r.number("temperature", 1.0, 0.0, MAX_TEMPERATURE, lo_open=True),
        top_k=top_k, top_p=top_p, top_p_decay=top_p_decay, top_p_bound=top_p_bound,
        add_BOS=add_bos, stop_on_double_eol=r.bool("stop_on_double_eol", False),
        stop_on_eol=r.bool("stop_on_eol", False),
        prevent_newline_after_colon=r.bool("prevent_newline_after_colon", False),
        random_seed=r.int("random_seed", -1, 0, MAX_SEED, "a non-negative integer"),
        beam_width=beam_width,
        stop_token=r.int("stop_token", None, 0, None if vocab_size is None else vocab_size - 1),
        length_penalty=r.number("length_penalty", 1.0, -10.0, 10.0))


@dataclass(frozen=True)
class CompletionRequest:
    """An OpenAI completions request: the generation, plus how to answer it."""

    request: GenerationRequest
    echo: bool
    stream: bool
    logprobs: int | None
    stop: list[str]
    model: str | None


def parse_completion_request(body: Any, max_sequence_length: int) -> CompletionRequest:
    """OpenAI's ``POST /v1/completions`` JSON -> a request. ``temperature`` 0 is greedy,
    ``top_p`` 1 turns top-p off; ``top_k`` is an extension (Megatron's).

    Raises:
        FieldError: naming the field, its value and what it must be.
    """
    body = _object(body)
    if "prompt" not in body:
        raise FieldError("prompt argument required")
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) else prompt
    prompts = _prompts(prompts, "prompt", allow_empty=False)
    r = _Reader(body)
    if r.int("n", 1, 1, 1, "1 (one completion per prompt)") != 1:
        raise FieldError("n must be 1")
    logprobs = r.int("logprobs", None, 0, MAX_OPENAI_LOGPROBS)
    echo = r.bool("echo", False)
    max_tokens = r.int("max_tokens", 16, 0, max_sequence_length)
    if max_tokens == 0 and not echo:
        raise FieldError("max_tokens=0 returns nothing unless echo is true")
    temperature = r.number("temperature", 1.0, 0.0, 2.0)
    top_p = r.number("top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = r.int("top_k", 0, 0, MAX_TOP_K)
    if top_k > 0 and top_p < 1.0:
        raise FieldError("cannot set both top_k and top_p (< 1)")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldError(f"model must be a string; got {model!r}")
    return CompletionRequest(
        request=GenerationRequest(
            prompts=prompts, tokens_to_generate=max_tokens,
            logprobs=logprobs is not None or echo, temperature=temperature or 1.0,
            top_k=1 if temperature == 0.0 else top_k,
            top_p=0.0 if temperature == 0.0 or top_p == 1.0 else top_p,
            random_seed=r.int("seed", -1, 0, MAX_SEED, "a non-negative integer"),
            top_logprobs=logprobs or 0),
        echo=echo, stream=r.bool("stream", False), logprobs=logprobs,
        stop=_stop_strings(body.get("stop")), model=model)


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or \
            len(stops) > MAX_STOP_STRINGS:
        raise FieldError(f"stop must be a non-empty string or a list of up to "
                         f"{MAX_STOP_STRINGS} non-empty strings; got {value!r}")
    for i, stop in enumerate(stops):
        _check_unicode(stop, f"stop[{i}]")
    return stops


def check_prompt_lengths(prompt_lengths: list[int], tokens_to_generate: int,
                         max_sequence_length: int, field: str, tokens_field: str) -> None:
    """Each prompt (in tokens) plus the tokens to generate fits the model's positions.

    Raises:
        FieldError: naming the prompt and the fields to change.
    """
    for i, n in enumerate(prompt_lengths):
        if n == 0:
            raise FieldError(f"{field}[{i}] has no tokens")
        if n + tokens_to_generate > max_sequence_length:
            raise FieldError(f"{field}[{i}] has {n} tokens; with {tokens_field}="
                             f"{tokens_to_generate} that makes {n + tokens_to_generate}, more "
                             f"than the model's {max_sequence_length} positions: shorten the "
                             f"prompt or lower {tokens_field}")
