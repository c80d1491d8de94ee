"""The HTTP server under the Flask app, bounded against hostile or broken clients.

werkzeug's threaded server starts a thread per connection with no limit and waits on a socket
for as long as the client likes: a client that sends its request a byte a second (or announces
a body it never sends), or that stops reading a stream, holds a thread forever, and enough of
them hold all the memory. :class:`BoundedServer` adds:

* a connection cap: past ``max_connections`` handled at once, a new connection is answered
  ``503`` (JSON, ``Retry-After: 1``) and closed at once, without a thread;
* a request deadline: the request line, headers and body must arrive within
  ``client_timeout_s`` of the connection's turn (an idle keep-alive connection is closed
  then too);
* a send timeout: a write to the client (a streamed token) that cannot proceed for
  ``client_timeout_s`` ends the request, which cancels its generation.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time

from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler


class _DeadlineReader(io.RawIOBase):
    """The handler's socket as a raw stream whose reads fail once the request deadline has
    passed (a per-read timeout alone lets a byte-a-second client go on forever)."""

    def __init__(self, handler: _BoundedHandler) -> None:
        super().__init__()
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        handler = self.handler
        remaining = handler.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the request did not arrive within {handler.client_timeout_s:g} s")
        sock = handler.connection
        sock.settimeout(min(remaining, handler.client_timeout_s))
        try:
            return sock.recv_into(buffer)
        finally:
            sock.settimeout(handler.client_timeout_s)  # what the writes then get


class _BoundedHandler(WSGIRequestHandler):
    client_timeout_s = 30.0  # set per server by BoundedServer
    timeout = client_timeout_s  # StreamRequestHandler: the socket's timeout (reads and writes)

    def setup(self) -> None:
        super().setup()
        self.deadline = time.monotonic() + self.client_timeout_s
        self.rfile = io.BufferedReader(_DeadlineReader(self))

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + self.client_timeout_s
        super().handle_one_request()

    def log_request(self, *args, **kwargs) -> None:
        pass  # no line per request on the server's output (werkzeug's default writes one)


class BoundedServer(ThreadedWSGIServer):
    """werkzeug's threaded WSGI server with a connection cap and client timeouts.

    Args:
        host: address to bind.
        port: port (0: a free one, see ``server_port``).
        app: the WSGI application.
        max_connections: connections handled at once; more are refused with 503.
        client_timeout_s: the request deadline and the send timeout.
    """

    def __init__(self, host: str, port: int, app, *, max_connections: int = 64,
                 client_timeout_s: float = 30.0) -> None:
        handler = type("Handler", (_BoundedHandler,), {"client_timeout_s": client_timeout_s,
                                                       "timeout": client_timeout_s,
                                                       "protocol_version": "HTTP/1.1"})
        super().__init__(host, port, app, handler=handler)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts the thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        """503 and close, from the accepting thread: a small write into an empty socket
        buffer, which cannot block."""
        self.refused += 1
        body = json.dumps(f"too many connections (--max-connections {self.max_connections}); "
                          "retry").encode() + b"\n"
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
        try:
            request.settimeout(1.0)
            request.sendall(head.encode() + body)
        except OSError:
            pass
        self.shutdown_request(request)
