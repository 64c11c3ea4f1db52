"""Loopback servers the client tests talk to: a recording HTTPS server, a recording proxy, a
name resolver that maps a test's broker name to 127.0.0.1, CAs made at test time, and a plain
HTTP broker that answers ``whoami`` (``whoami_broker``: the CLI's ``--allow-insecure-http``
tests)."""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import socketserver
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


class RecordingServer:
    """A loopback HTTPS server (plain HTTP without a ``context``) that records every request's
    path and headers and answers 200 with ``body`` (JSON when given), or 307 to ``redirect_to``
    + the path. Request bodies (sized or chunked) are read and dropped."""

    def __init__(
        self, context: ssl.SSLContext | None, redirect_to: str | None, body: bytes = b""
    ) -> None:
        self.seen: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                if self.headers.get("Transfer-Encoding") == "chunked":
                    while True:
                        size = int(self.rfile.readline().strip() or b"0", 16)
                        self.rfile.read(size + 2)
                        if size == 0:
                            break
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                outer.seen.append({"path": self.path, **dict(self.headers.items())})
                if redirect_to is not None:
                    self.send_response(307)
                    self.send_header("Location", redirect_to + self.path)
                else:
                    self.send_response(200)
                    if body:
                        self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if context is not None:
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        self.port = self.httpd.server_address[1]
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Servers:
    """``servers(context, redirect_to=None, body=b"")``: start a :class:`RecordingServer`;
    ``close()`` closes every one started (the ``https_server`` fixture)."""

    def __init__(self) -> None:
        self.started: list[RecordingServer] = []

    def __call__(
        self, context: ssl.SSLContext | None, redirect_to: str | None = None, body: bytes = b""
    ) -> RecordingServer:
        server = RecordingServer(context, redirect_to, body)
        self.started.append(server)
        return server

    def close(self) -> None:
        for server in reversed(self.started):
            server.close()


def server_context(host: str, ca_path: Path) -> ssl.SSLContext:
    """A server-side TLS context with a certificate for ``host`` from a CA made now, whose
    certificate is written to ``ca_path`` (needs trustme: the test skips without it)."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(host).configure_cert(context)
    ca.cert_pem.write_to_path(str(ca_path))
    return context


PROXY_VARIABLES = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "AGENT_SANDBOX_TRUST_ENV_PROXIES",
)


class RecordingProxy:
    """A loopback HTTP proxy that records every request line it gets (``seen``) and whether one
    carried an ``Authorization`` header (``saw_authorization``). ``CONNECT host:port`` is
    tunnelled to ``127.0.0.1:port`` whatever the host (every test server is on this machine);
    any other request (plain-HTTP forwarding) is answered ``502``."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.saw_authorization = False
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                client: socket.socket = self.request
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                lines = head.split(b"\r\n")
                outer.seen.append(lines[0].decode("latin-1"))
                if any(line.lower().startswith(b"authorization:") for line in lines):
                    outer.saw_authorization = True
                method, target = lines[0].split(b" ")[:2]
                if method != b"CONNECT":
                    client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                    return
                port = int(target.rsplit(b":", 1)[1])
                with socket.create_connection(("127.0.0.1", port)) as upstream:
                    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    _pipe(client, upstream)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between two sockets until one side closes."""
    with selectors.DefaultSelector() as selector:
        selector.register(a, selectors.EVENT_READ, b)
        selector.register(b, selectors.EVENT_READ, a)
        while True:
            for key, _ in selector.select(timeout=30):
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                if not data:
                    return
                key.data.sendall(data)


def resolve_to_loopback(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """``add(host)``: from now on name resolution in this process maps ``host`` to 127.0.0.1
    and refuses every other name that is not a loopback one, so that a test using a
    non-loopback broker name never sends a packet off this machine."""
    real = socket.getaddrinfo
    names: set[str] = set()

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name in names:
            name = "127.0.0.1"
        elif name not in ("127.0.0.1", "::1", "localhost"):
            raise socket.gaierror(socket.EAI_NONAME, f"{name!r}: not resolved in tests")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return names.add


@contextlib.contextmanager
def whoami_broker(answer: Mapping[str, Any]) -> Iterator[str]:
    """A plain HTTP broker on 127.0.0.1 whose every ``GET`` gets ``answer`` as JSON: ``200``
    for ``/v1/whoami``, ``404`` for any other path; until the block ends. Yields its URL."""
    body = json.dumps(answer).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/v1/whoami" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
