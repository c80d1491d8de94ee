"""The HTTP side of the text generation server (Flask).

* ``PUT /api``: Megatron-LM's contract: ``{"text", "segments", "logprobs"}`` (beam search:
  ``{"text", "segments", "scores"}``); errors are a JSON string with status 400.
* ``POST /v1/completions`` (and ``/completions``): OpenAI's completions shape; ``"stream": true``
  answers with server-sent events, one per generated token, then ``data: [DONE]``.
* ``GET /``: the web page; ``GET /health``: queue length and counters.

Bodies above ``max_body_bytes`` get 413; a full queue 503; a failure inside generation 500 for
that request only.
"""

from __future__ import annotations

import json
import queue
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from flask import Flask, Response, jsonify, request, send_from_directory
from werkzeug.exceptions import (ClientDisconnected, HTTPException, RequestEntityTooLarge,
                                 RequestTimeout)

from megatron.text_generation.api import GenerationResult, tokenize_prompts
from megatron.text_generation.server.engine import (Cancelled, GenerationEngine, Job,
                                                    QueueFull)
from megatron.text_generation.server.fields import (CompletionRequest, FieldError,
                                                    check_prompt_lengths, decode_json_body,
                                                    parse_api_request, parse_completion_request)
from megatron.text_generation.server.stream import CompletionText, stop_watch

STATIC_DIR = Path(__file__).resolve().parent / "static"
KEEPALIVE_S = 1.0
"""A stream waiting in the queue writes an SSE comment this often: a gone client then fails
the write, and its job is cancelled."""


def create_app(engine: GenerationEngine, tokenizer, *, max_sequence_length: int,
               model_name: str = "megatron-gpt", max_body_bytes: int = 1 << 20,
               request_timeout_s: float = 600.0) -> Flask:
    """The Flask app serving ``engine``.

    Args:
        engine: the queue and generation thread.
        tokenizer: the model's tokenizer (prompt lengths are checked before queueing).
        max_sequence_length: the model's positions.
        model_name: the ``model`` the OpenAI endpoint reports.
        max_body_bytes: larger request bodies get 413.
        request_timeout_s: a request waiting longer for its result gets 504.
    """
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    ctx = _Context(engine, tokenizer, max_sequence_length, model_name, request_timeout_s)

    @app.get("/")
    def index():
        return send_from_directory(STATIC_DIR, "index.html")

    @app.get("/health")
    def health():
        return jsonify(status="ok", queued=engine.queued(), max_queue=engine.max_queue,
                       **engine.stats)

    @app.put("/api")
    def api():
        return ctx.megatron_api()

    @app.post("/v1/completions")
    @app.post("/completions")
    def completions():
        return ctx.completions()

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException):
        message = err.description
        if err.code == 413:
            message = f"request body larger than {max_body_bytes} bytes"
        if request.path.startswith("/api"):
            return jsonify(message), err.code
        return _openai_error(message, err.code)

    return app


def _openai_error(message: str, status: int, kind: str = "invalid_request_error"):
    return jsonify(error={"message": message, "type": kind, "param": None,
                          "code": None}), status


class _Context:
    def __init__(self, engine, tokenizer, max_sequence_length, model_name, timeout_s) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.max_sequence_length, self.model_name = max_sequence_length, model_name
        self.timeout_s = timeout_s

    def body(self):
        try:
            raw = request.get_data(cache=True)  # a 413 past the limit (werkzeug) ...
        except ClientDisconnected:  # the server's request deadline passed, or the client left
            raise RequestTimeout("the request body did not arrive whole in time") from None
        limit = request.max_content_length
        if request.content_length is None and limit is not None and len(raw) >= limit:
            # ... except for a chunked body, which werkzeug cuts at the limit without a word
            # (it then answered 400 "not valid JSON").
            raise RequestEntityTooLarge()
        return decode_json_body(raw)

    # PUT /api ------------------------------------------------------------------------------
    def megatron_api(self):
        try:
            req = parse_api_request(self.body(), self.max_sequence_length,
                                    self.tokenizer.vocab_size)
            lengths = [len(ids) for ids in tokenize_prompts(self.tokenizer, req)]
            check_prompt_lengths(lengths, req.tokens_to_generate, self.max_sequence_length,
                                 "prompts", "tokens_to_generate")
            result = self.engine.submit(Job(req)).result(self.timeout_s)
        except (FieldError, ValueError) as err:
            return jsonify(str(err)), 400
        except QueueFull as err:
            return jsonify(str(err)), 503
        except queue.Empty:
            return jsonify("timed out waiting for the generation"), 504
        except (Cancelled, RuntimeError) as err:
            return jsonify(str(err)), 500
        if req.beam_width is not None:
            return jsonify(text=result.text, segments=result.segments, scores=result.scores)
        return jsonify(text=result.text, segments=result.segments, logprobs=result.logprobs)

    # POST /v1/completions ------------------------------------------------------------------
    def completions(self):
        try:
            creq = parse_completion_request(self.body(), self.max_sequence_length)
            prompts = tokenize_prompts(self.tokenizer, creq.request)
            check_prompt_lengths([len(p) for p in prompts], creq.request.tokens_to_generate,
                                 self.max_sequence_length, "prompt", "max_tokens")
            texts = [CompletionText(self.tokenizer, p, creq.stop) for p in prompts]
            job = Job(creq.request, stream=creq.stream,
                      watch=stop_watch(self.tokenizer, prompts, creq.stop)
                      if creq.stop else None)
            self.engine.submit(job)
        except (FieldError, ValueError) as err:
            return _openai_error(str(err), 400)
        except QueueFull as err:
            return _openai_error(str(err), 503, "server_busy")
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": creq.model or self.model_name}
        if creq.stream:
            return Response(self.stream(job, creq, texts, meta), mimetype="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            result = job.result(self.timeout_s)
        except ValueError as err:
            return _openai_error(str(err), 400)
        except queue.Empty:
            job.cancel()
            return _openai_error("timed out waiting for the generation", 504, "timeout")
        except (Cancelled, RuntimeError) as err:
            return _openai_error(str(err), 500, "server_error")
        return jsonify(self.completion_body(result, creq, texts, meta))

    def completion_body(self, result: GenerationResult, creq: CompletionRequest,
                        texts: list[CompletionText], meta: dict) -> dict:
        choices, generated = [], 0
        for i, text in enumerate(texts):
            text.finish(result.tokens[i], result.stopped[i])
            generated += len(result.tokens[i]) - result.prompt_lengths[i]
            choice = {"text": text.visible(creq.echo), "index": i,
                      "logprobs": None, "finish_reason": text.finish_reason}
            if creq.logprobs is not None:
                choice["logprobs"] = text.logprobs_object(result, i, creq.echo, creq.logprobs)
            choices.append(choice)
        prompt_tokens = sum(result.prompt_lengths)
        return {**meta, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                          "total_tokens": prompt_tokens + generated}}

    def step_logprobs(self, report, j: int, token: int, offset: int, top: int) -> dict:
        """One streamed token's OpenAI ``logprobs`` object."""
        tops = None
        if top > 0 and report.top is not None:
            ids, values = report.top[j]
            tops = [{self.tokenizer.detokenize([t]): v for t, v in zip(ids, values)}]
        return {"tokens": [self.tokenizer.detokenize([token])],
                "token_logprobs": [report.logprobs[j] if report.logprobs else None],
                "top_logprobs": tops, "text_offset": [offset]}

    def stream(self, job: Job, creq: CompletionRequest, texts: list[CompletionText],
               meta: dict) -> Iterator[str]:
        """Server-sent events: the echoed prompts, one chunk per generated token, a last chunk
        per prompt with its finish reason, ``[DONE]``. Closing the stream (the client left)
        cancels the job, which frees its place."""
        def event(payload) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def chunk(i: int, text: str, finish: str | None = None, logprobs=None) -> str:
            return event({**meta, "choices": [{"text": text, "index": i, "logprobs": logprobs,
                                               "finish_reason": finish}]})

        try:
            if creq.echo:
                for i, text in enumerate(texts):
                    yield chunk(i, text.prompt_text)
            waited = 0.0
            while True:
                try:
                    kind, value = job.events.get(timeout=KEEPALIVE_S)
                except queue.Empty:
                    waited += KEEPALIVE_S
                    if waited > self.timeout_s:
                        yield event({"error": {"message": "timed out", "type": "timeout"}})
                        return
                    yield ": waiting\n\n"
                    continue
                if kind == "step":
                    for j, (row, token) in enumerate(zip(value.rows, value.tokens)):
                        offset = len(texts[row].prompt_text) + texts[row].sent
                        delta = texts[row].add(token)
                        extra = None
                        if creq.logprobs is not None:
                            extra = self.step_logprobs(value, j, token, offset, creq.logprobs)
                        if delta or extra is not None:
                            yield chunk(row, delta, logprobs=extra)
                elif kind == "done":
                    for i, text in enumerate(texts):
                        rest = text.finish(value.tokens[i], value.stopped[i])
                        yield chunk(i, rest, finish=text.finish_reason)
                    yield "data: [DONE]\n\n"
                    return
                else:
                    kind_name = "invalid_request_error" if isinstance(value, ValueError) \
                        else "server_error"
                    yield event({"error": {"message": str(value), "type": kind_name}})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancel()

