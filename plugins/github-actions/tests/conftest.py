"""Fixtures: a real HTTP server on 127.0.0.1 standing in for the Actions token service."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    drop: bool = False  # close the connection without answering


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    at: float = 0.0  # wall-clock time the request arrived


class LoopbackEndpoint:
    """An HTTP server on 127.0.0.1 answering GETs with queued replies (then the default one)."""

    def __init__(self) -> None:
        self.requests: list[Seen] = []
        self.replies: deque[Reply] = deque()
        self.default = Reply(status=404, body=b"{}")
        self.responder: Callable[[Seen], Reply] | None = None
        """When set, answers every request that no queued reply answers."""
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                seen = Seen(self.path, dict(self.headers.items()), time.time())
                with endpoint._lock:
                    endpoint.requests.append(seen)
                    queued = endpoint.replies.popleft() if endpoint.replies else None
                if queued is not None:
                    reply = queued
                elif endpoint.responder is not None:
                    reply = endpoint.responder(seen)
                else:
                    reply = endpoint.default
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.drop:
                    self.close_connection = True
                    return
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def reply(body: bytes = b"", status: int = 200, **options: Any) -> Reply:
        """A reply (options: headers, delay, drop), for ``add`` or a ``responder``."""
        return Reply(status, body, **options)

    def add(self, body: bytes = b"", status: int = 200, **options: Any) -> None:
        """Queue one reply."""
        self.replies.append(self.reply(body, status, **options))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[LoopbackEndpoint]:
    server = LoopbackEndpoint()
    try:
        yield server
    finally:
        server.close()


def make_jwt(claims: dict[str, object] | None = None) -> str:
    """An unsigned-looking JWT (header.payload.signature) for unit tests of the transport."""

    def part(obj: object) -> str:
        raw = json.dumps(obj, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    now = int(time.time())
    payload = {"iss": "https://token.actions.githubusercontent.com", "exp": now + 300, "iat": now}
    payload.update(claims or {})
    return f"{part({'alg': 'RS256', 'typ': 'JWT'})}.{part(payload)}.c2lnbmF0dXJl"


@pytest.fixture
def jwt_factory() -> Callable[..., str]:
    return make_jwt
