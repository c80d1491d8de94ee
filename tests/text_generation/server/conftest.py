"""An in-process server around the tiny GPT: the Flask test client, or a real threaded HTTP
server on a free port of 127.0.0.1 (for concurrency, streams cut by the client, the browser)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from megatron.text_generation.api import run_request
from megatron.text_generation.server.app import create_app
from megatron.text_generation.server.engine import GenerationEngine
from tests.text_generation.tiny import MAX_POSITIONS, ByteTokenizer, tiny_model


class Harness:
    """The engine, app, model and tokenizer; ``step_delay`` slows each step (to cut streams
    mid-way); ``fail_next`` makes the next generation raise."""

    def __init__(self, max_queue: int = 16, max_body_bytes: int = 1 << 16) -> None:
        self.model, self.tokenizer = tiny_model(), ByteTokenizer()
        self.step_delay = 0.0
        self.fail_next = False
        self.engine = GenerationEngine(self.run, max_queue=max_queue)
        self.app = create_app(self.engine, self.tokenizer, max_sequence_length=MAX_POSITIONS,
                              max_body_bytes=max_body_bytes)

    def run(self, request, on_step):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")

        def slow_step(report):
            time.sleep(self.step_delay)
            return on_step(report)

        return run_request(self.model, self.tokenizer, request,
                           max_sequence_length=MAX_POSITIONS, on_step=slow_step)

    def direct(self, request):
        return run_request(self.model, self.tokenizer, request,
                           max_sequence_length=MAX_POSITIONS)

    @contextlib.contextmanager
    def serving(self):
        """A real threaded server; yields its base URL."""
        from werkzeug.serving import make_server

        server = make_server("127.0.0.1", 0, self.app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_port}"
        finally:
            server.shutdown()
            thread.join(10)


@pytest.fixture()
def harness():
    h = Harness()
    yield h
    h.engine.close()


@pytest.fixture()
def client(harness):
    return harness.app.test_client()
