"""What one request offers the runtime's endpoints, and the one way to read and answer it.

The runtime's HTTP server (:mod:`._server`) hands each endpoint an :class:`Exchange` (its
request handler). The endpoints read the body with :func:`body_chunks` (``Content-Length`` or
chunked: the one body reader) or :func:`read_json`, and answer with :func:`send_json`,
:func:`send_file` or a chunked NDJSON stream (:func:`start_ndjson`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, BinaryIO, Protocol

from ._paths import Roots

CHUNK_SIZE = 256 * 1024
MAX_JSON_BODY = 1024 * 1024


class Exchange(Protocol):
    """One request and its answer (a ``BaseHTTPRequestHandler`` of the runtime's server), and
    the runtime's settings the endpoints need."""

    path: str
    command: str
    close_connection: bool
    base_dir: str
    exec_timeout: float
    fs_roots: Roots

    @property
    def headers(self) -> Any: ...

    @property
    def rfile(self) -> Any: ...

    @property
    def wfile(self) -> Any: ...

    @property
    def connection(self) -> Any: ...

    def send_response(self, code: int, message: str | None = None) -> None: ...

    def send_header(self, keyword: str, value: str) -> None: ...

    def end_headers(self) -> None: ...


def body_chunks(exchange: Exchange) -> Iterator[bytes]:
    """The request body as it arrives (chunked, or ``Content-Length`` bytes); a body that ends
    early is a ``ConnectionError``, a malformed chunk size a ``ValueError``."""
    rfile = exchange.rfile
    if "chunked" in exchange.headers.get("Transfer-Encoding", "").lower():
        while True:
            line = rfile.readline(65537)
            if not line:
                raise ConnectionError("connection closed inside a chunked body")
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass
                return
            remaining = size
            while remaining:
                data = rfile.read(min(remaining, CHUNK_SIZE))
                if not data:
                    raise ConnectionError("connection closed inside a chunk")
                remaining -= len(data)
                yield data
            rfile.readline(3)
    else:
        remaining = int(exchange.headers.get("Content-Length") or 0)
        while remaining > 0:
            data = rfile.read(min(remaining, CHUNK_SIZE))
            if not data:
                raise ConnectionError("connection closed inside the body")
            remaining -= len(data)
            yield data


def read_json(exchange: Exchange) -> Any:
    """The body as JSON (empty: ``{}``); ``ValueError`` beyond :data:`MAX_JSON_BODY` or when
    it is not JSON, ``ConnectionError`` when it ends early."""
    buf = bytearray()
    for chunk in body_chunks(exchange):
        buf += chunk
        if len(buf) > MAX_JSON_BODY:
            raise ValueError(f"body larger than {MAX_JSON_BODY} bytes")
    return json.loads(buf or b"{}")


def drain(exchange: Exchange) -> None:
    """Read and drop the body (so the client gets the answer, not a reset); a body that cannot
    be read closes the connection after the answer."""
    try:
        for _ in body_chunks(exchange):
            pass
    except (ConnectionError, ValueError):
        exchange.close_connection = True


def send_json(exchange: Exchange, status: int, payload: Any, *, close: bool = False) -> None:
    """Answer ``status`` with ``payload`` as JSON; ``close`` (or a connection already marked to
    close): the connection closes after it, and the answer says so."""
    data = json.dumps(payload).encode()
    if close:
        exchange.close_connection = True
    exchange.send_response(status)
    exchange.send_header("Content-Type", "application/json")
    exchange.send_header("Content-Length", str(len(data)))
    if exchange.close_connection:
        exchange.send_header("Connection", "close")
    send_whole(exchange, data)


def send_whole(exchange: Exchange, data: bytes) -> None:
    """End the answer's head and send ``data``, its whole body, in one write: one segment, so
    that a reader (the broker) gets the answer in one read, not its head and then its body
    (``end_headers`` writes the head on its own)."""
    held = getattr(exchange, "_headers_buffer", None)
    if not isinstance(held, list) or getattr(exchange, "request_version", "") == "HTTP/0.9":
        exchange.end_headers()
        exchange.wfile.write(data)
        return
    held.append(b"\r\n")  # what end_headers adds, then what it writes (flush_headers)
    held.append(data)
    exchange.wfile.write(b"".join(held))
    held.clear()


def send_file(exchange: Exchange, fh: BinaryIO, size: int) -> None:
    """Answer ``200`` with ``size`` bytes of ``fh``, streamed in chunks."""
    exchange.send_response(200)
    exchange.send_header("Content-Type", "application/octet-stream")
    exchange.send_header("Content-Length", str(size))
    exchange.end_headers()
    remaining = size
    while remaining > 0:
        data = fh.read(min(CHUNK_SIZE, remaining))
        if not data:
            break
        exchange.wfile.write(data)
        remaining -= len(data)
    if remaining:  # the file shrank while we sent it: the client sees a short body
        exchange.close_connection = True


def start_ndjson(exchange: Exchange) -> None:
    """The status line and headers of a ``200`` NDJSON stream (chunked; never cached)."""
    exchange.send_response(200)
    exchange.send_header("Content-Type", "application/x-ndjson")
    exchange.send_header("Cache-Control", "no-store")
    exchange.send_header("Transfer-Encoding", "chunked")
    exchange.end_headers()
