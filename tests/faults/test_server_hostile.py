"""The generation server under hostile requests and clients, on 127.0.0.1, bounded in
count and time: it stays up, answers every request with a status, and its memory stays flat.

In-process: the tiny GPT of tests/text_generation behind the real app and the real HTTP server
the tool runs (:class:`~megatron.text_generation.server.serving.BoundedServer`), spoken to over
real sockets (raw ones where the client misbehaves at the HTTP level). The field checks of
tests/text_generation/server/test_app.py (every field's range, plain malformed bodies) are not
repeated. What the injections found, each fixed:

* a client that sent its request a byte at a time, or announced a body it never sent, held a
  server thread for ever, and any number of them could connect (werkzeug's threaded server has
  no limit and no timeout): now a connection cap (503 past it) and a request deadline;
* a chunked body over ``--max-request-bytes`` answered 400 "not valid JSON" instead of 413;
* nesting deeper than Python's recursion limit went through Flask's silent JSON path; a lone
  surrogate (``"\\ud800"``) in a prompt or stop string answered with Python's codec error,
  naming no field;
* a 5000-digit integer (over Python's 4300-digit conversion limit) and 30000-deep nesting
  answered only "not valid JSON": now the field and "too large", resp. "nests too
  deeply".
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron.text_generation.server.serving import BoundedServer
from tests.text_generation.server.conftest import Harness

HANG_S = 60.0  # hang detection only
CLIENT_TIMEOUT_S = 1.5


@contextlib.contextmanager
def _serving(app, **kwargs):
    server = BoundedServer("127.0.0.1", 0, app, **kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


@pytest.fixture(scope="module")
def served():
    harness = Harness(max_body_bytes=1 << 16)
    with _serving(harness.app, max_connections=16, client_timeout_s=CLIENT_TIMEOUT_S) as server:
        yield harness, server
    harness.engine.close()


def _request(server, method: str, path: str, body: bytes,
             headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=HANG_S)
    try:
        conn.request(method, path, body=body,
                     headers=headers or {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _raw(server, data: bytes) -> bytes:
    """Send ``data`` and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=HANG_S) as sock:
        sock.sendall(data)
        return _read_all(sock)


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


_OK_API = b'{"prompts": ["hi"], "tokens_to_generate": 2}'
_DEEP = b'{"prompts": ' + b"[" * 30000 + b"]" * 30000 + b"}"  # under the 64 KiB limit
HOSTILE = [  # (method, path, body, status, text in the answer)
    ("PUT", "/api", b'{"prompts": ["hi"], "tokens_to_generate": NaN}', 400,
     "tokens_to_generate must be an integer"),
    ("PUT", "/api", b'{"prompts": ["hi"], "tokens_to_generate": 2, "temperature": Infinity}',
     400, "temperature must be a finite number"),
    ("PUT", "/api", b'{"prompts": ["hi"], "tokens_to_generate": 1' + b"0" * 5000 + b"}", 400,
     "tokens_to_generate must be an integer in [0, 96]; got a 5001-digit integer, too large "
     "for any field"),
    ("PUT", "/api", b'{"prompts": ["hi"], "tokens_to_generate": 2, "top_k": -' + b"9" * 5000
     + b"}", 400, "top_k must be an integer in [0, 1000]; got a 5000-digit integer"),
    ("PUT", "/api", b'{"prompts": ["hi"], "tokens_to_generate": 2, "top_p": 1e999}', 400,
     "top_p must be a finite number"),
    ("PUT", "/api", b'{"prompts": ["hi"], "tokens_to_generate": -5}', 400,
     "tokens_to_generate must be an integer in [0, 96]; got -5"),
    ("PUT", "/api", b'{"prompts": ["hi"], "tokens_to_generate": 2, "random_seed": -1}', 400,
     "random_seed must be"),
    ("PUT", "/api", _DEEP, 400, "the request body nests arrays/objects too deeply"),
    ("PUT", "/api", b'{"prompts": ["a\\ud800b"], "tokens_to_generate": 2}', 400,
     "prompts[0] holds a lone surrogate U+D800 at character 1"),
    ("PUT", "/api", b'{"prompts": ["\xff\xfe\xc3("], "tokens_to_generate": 2}', 400,
     "not valid JSON"),
    ("PUT", "/api", json.dumps({"prompts": ["\u202e\U0001F4A9\u0000\ufeff\u0301"],
                                "tokens_to_generate": 2}, ensure_ascii=False).encode(),
     200, '"text"'),  # odd but valid text (raw UTF-8, an escaped NUL): answered
    ("PUT", "/api", b'{"prompts": {"a": [1]}, "tokens_to_generate": {}}', 400,
     "prompts is not a list of strings"),
    ("PUT", "/api", b"", 400, "not valid JSON"),
    ("PUT", "/api", b"[" + b"1," * 40000 + b"1]", 413, "larger than 65536 bytes"),
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\udfff"]}',
     400, "stop[0] holds a lone surrogate U+DFFF"),
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "logprobs": -1e308}',
     400, "logprobs must be an integer"),
    ("POST", "/v1/completions", b'{"prompt": [[[[]]]], "max_tokens": 2}', 400,
     "prompt is not a list of strings"),
    ("POST", "/v1/completions", _DEEP.replace(b"prompts", b"prompt"), 400,
     "the request body nests arrays/objects too deeply"),
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "seed": ' + b"7" * 4400
     + b"}", 400, "seed must be"),
]


def _hostile_round(server) -> None:
    for method, path, body, status, text in HOSTILE:
        got, answer = _request(server, method, path, body)
        assert (got, True) == (status, text in answer.decode()), (body[:80], got, answer[:300])


def test_hostile_bodies_get_a_status_naming_the_problem(served):
    harness, server = served
    _hostile_round(server)
    # A chunked body past the limit: 413 (was 400), read no further than the limit.
    head = (b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunks = b"".join(b"4000\r\n" + b" " * 0x4000 + b"\r\n" for _ in range(8)) + b"0\r\n\r\n"
    answer = _raw(server, head + chunks)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
    # Not HTTP at all: a garbage request line gets 400; a TLS hello (no line end ever) is
    # closed at the request deadline.
    assert b"Error code: 400" in _raw(server, b"\xff\xfeGARBAGE \x00\r\n\r\n")
    assert _raw(server, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(300)) == b""
    status, answer = _request(server, "PUT", "/api", _OK_API)
    assert status == 200 and json.loads(answer)["text"][0].startswith("hi")


def test_slow_and_silent_clients_are_cut_off_while_others_are_served(served):
    harness, server = served
    starts = {
        "a byte at a time": b"PUT /api HTTP/1.1\r\nHost: x\r\n",
        "a body never sent": b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{",
        "silent": b"",
    }
    socks = {}
    for name, data in starts.items():
        sock = socket.create_connection(("127.0.0.1", server.server_port), timeout=HANG_S)
        sock.sendall(data)
        socks[name] = sock
    closed = {}

    def dribble():  # one byte every 0.3 s, for as long as the server listens
        sock = socks["a byte at a time"]
        with contextlib.suppress(OSError):
            for byte in b"X-Slow: " + b"a" * 1000:
                sock.sendall(bytes([byte]))
                time.sleep(0.3)

    slow = threading.Thread(target=dribble, daemon=True)
    slow.start()
    # Meanwhile a well-behaved client is served at once.
    status, _ = _request(server, "PUT", "/api", _OK_API)
    assert status == 200
    for name, sock in socks.items():
        closed[name] = _read_all(sock)  # returns when the server closes the connection
        sock.close()
    slow.join(HANG_S)
    # A request that never arrived whole: closed without an answer, or (a body missing) 408.
    body_missing = closed.pop("a body never sent")
    assert body_missing.startswith(b"HTTP/1.1 408 "), body_missing
    assert b"the request body did not arrive whole in time" in body_missing
    assert closed == {"a byte at a time": b"", "silent": b""}, closed
    assert not slow.is_alive()


def test_a_flood_past_the_connection_cap_is_refused_fast_and_recovers(served):
    harness, server = served
    # Sixteen silent connections take every slot until the request deadline closes them.
    idle = [socket.create_connection(("127.0.0.1", server.server_port), timeout=HANG_S)
            for _ in range(server.max_connections)]
    time.sleep(0.3)  # the accepting thread hands each its slot (polled, no result depends on it)
    refused_before = server.refused
    with ThreadPoolExecutor(48) as pool:
        answers = list(pool.map(lambda _: _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
                                range(48)))
    statuses = [a.split(b" ", 2)[1] if a else b"closed" for a in answers]
    assert set(statuses) <= {b"503", b"200"}, statuses
    assert statuses.count(b"503") >= 40 and server.refused - refused_before >= 40, statuses
    assert b"too many connections (--max-connections 16)" in answers[statuses.index(b"503")]
    for sock in idle:
        assert _read_all(sock) == b""  # closed by the deadline
        sock.close()
    # Slots free again: 64 concurrent clients, each answered (200, or 503 when the generation
    # queue or the cap is full), none left hanging.
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: _request(server, "PUT", "/api", _OK_API)
                                if i % 4 == 0 else _request(server, "GET", "/health", b""),
                                range(64)))
    assert {s for s, _ in results} <= {200, 503}
    assert sum(s == 200 for s, _ in results) >= 16, [s for s, _ in results]


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_memory_stays_flat_over_rounds_of_abuse(served):
    harness, server = served

    def round_of_abuse():
        _hostile_round(server)
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda _: _request(server, "GET", "/health", b""), range(64)))

    round_of_abuse()  # warm-up: caches, thread stacks, allocator pools
    before = _rss_kib()
    for _ in range(3):
        round_of_abuse()
    grown_mib = (_rss_kib() - before) / 1024
    # A leak of a connection's buffers or a request body per request would be 60+ MiB here.
    assert grown_mib < 16, f"RSS grew {grown_mib:.1f} MiB over 3 rounds"


def test_a_client_that_never_reads_its_stream_is_cut_off_by_the_send_timeout():
    """A streamed answer far larger than the socket buffers, to a client that never reads: the
    blocked write fails after the client timeout, the stream is closed (which is what cancels
    a generation) and the slot is free again."""
    closed = threading.Event()

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/event-stream")])

        def chunks():
            try:
                while True:
                    yield b"data: " + b"x" * 65536 + b"\n\n"
            finally:
                closed.set()
        return chunks()

    with _serving(app, max_connections=2, client_timeout_s=CLIENT_TIMEOUT_S) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.server_port))
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        assert closed.wait(HANG_S), "the stream to a client that never reads was never closed"
        sock.close()
        deadline = time.monotonic() + HANG_S
        while server._slots._value != server.max_connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server._slots._value == server.max_connections


@pytest.mark.parametrize("flag, value, message", [
    ("--max-connections", "0", "--max-connections (0) must be >= 1"),
    ("--client-timeout", "0", "--client-timeout (0.0) must be a finite number of seconds > 0"),
    ("--client-timeout", "inf", "--client-timeout (inf) must be a finite number"),
])
def test_the_bounds_flags_are_checked(flag, value, message):
    from megatron.config import parse_args
    from tools import run_text_generation_server as tool

    flags = parse_args([flag, value], validate_config=False, tool_sections=tool.TOOL_SECTIONS)
    with pytest.raises(ValueError, match=re.escape(message)):
        tool.check_server_flags(flags.section(tool.ServerFlags))
