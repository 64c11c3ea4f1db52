"""A scripted HTTP endpoint on 127.0.0.1: the stand-in for a platform's token service.

Standard library only (no ``[local]`` extra needed), so a plugin's unit tests can use it even
where the local broker's dependencies are not installed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypedDict, Unpack
from urllib.parse import parse_qs, urlsplit

__all__ = ["RecordedRequest", "Reply", "ScriptedEndpoint"]


@dataclass
class Reply:
    """One scripted answer of a :class:`ScriptedEndpoint`.

    - ``status``, ``body``: the HTTP status and the response body.
    - ``headers``: response headers. ``None`` (the default) means the endpoint's
      ``default_headers``; a mapping (even an empty one) replaces them for this reply.
      ``Content-Length`` is always set from ``body``.
    - ``delay``: seconds to wait before answering (to test your read timeout).
    - ``drop``: close the connection without answering (to test a dropped connection).
    """

    status: int = 200
    body: bytes = b""
    headers: Mapping[str, str] | None = None
    delay: float = 0.0
    drop: bool = False


class ReplyOptions(TypedDict, total=False):
    """The keyword arguments of :meth:`ScriptedEndpoint.add` and :meth:`ScriptedEndpoint.reply`."""

    headers: Mapping[str, str] | None
    delay: float
    drop: bool


@dataclass(frozen=True)
class RecordedRequest:
    """A request the endpoint received, in arrival order in :attr:`ScriptedEndpoint.requests`.

    ``path`` is the request target as sent (path and query string); ``headers`` maps each
    header name, as the client spelled it, to its value; ``at`` is the wall-clock time
    (``time.time()``) the request arrived, comparable with a JWT's ``exp``.
    """

    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""
    at: float = 0.0

    @property
    def url_path(self) -> str:
        """The path without the query string."""
        return urlsplit(self.path).path

    @property
    def query(self) -> dict[str, list[str]]:
        """The query string, parsed (``{"audience": ["https://..."]}``)."""
        return parse_qs(urlsplit(self.path).query, keep_blank_values=True)


Responder = Callable[[RecordedRequest], Reply]


class ScriptedEndpoint:
    """A plain-HTTP server on 127.0.0.1 that answers with scripted :class:`Reply` objects.

    Use it as the stand-in for your platform's token service or metadata server::

        with ScriptedEndpoint() as endpoint:
            endpoint.add(b'{"token": "..."}')             # the next request gets this
            endpoint.add(b"busy", status=503)             # and the one after, this
            ...                                           # point your provider at endpoint.origin
            [first, second] = endpoint.requests           # what your provider sent

    Each request (GET, POST, PUT, DELETE, PATCH) is recorded, then answered by the first queued
    reply (:meth:`add`), else by :attr:`responder` (a function of the :class:`RecordedRequest`,
    called on the server's thread), else by :attr:`default` (404). If the responder raises, the
    request is answered with a 500 and the exception is kept in :attr:`errors`, so a test can
    assert it never happened.

    The server starts in the constructor on a free port and serves each request on its own
    thread; :meth:`close` (or leaving the ``with`` block) stops it. It only ever binds 127.0.0.1.
    """

    def __init__(
        self,
        *,
        default_headers: Mapping[str, str] | None = None,
        responder: Responder | None = None,
    ) -> None:
        self.default_headers: dict[str, str] = dict(default_headers or {})
        """Headers of every reply whose ``headers`` is ``None``."""
        self.responder: Responder | None = responder
        """Answers every request that no queued reply answers."""
        self.default = Reply(status=404, body=b"{}")
        """The answer when nothing is queued and there is no responder."""
        self.errors: list[BaseException] = []
        """Exceptions the responder raised (each answered with a 500)."""
        self._requests: list[RecordedRequest] = []
        self._queue: deque[Reply] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"scripted-endpoint-{self.port}",
            daemon=True,
        )
        self._thread.start()

    # -- addresses -----------------------------------------------------------------------------
    @property
    def origin(self) -> str:
        """``http://127.0.0.1:PORT`` (no trailing slash)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT``, for variables that take host[:port] (``GCE_METADATA_HOST``)."""
        return f"127.0.0.1:{self.port}"

    def url(self, path: str = "/") -> str:
        """The absolute URL of ``path`` (which may carry a query string) on this endpoint."""
        return self.origin + (path if path.startswith("/") else "/" + path)

    # -- script --------------------------------------------------------------------------------
    @staticmethod
    def reply(body: bytes | str = b"", status: int = 200, **options: Unpack[ReplyOptions]) -> Reply:
        """A :class:`Reply` for :meth:`add` or a responder (a ``str`` body is UTF-8 encoded).

        ``options``: ``headers`` (``None``: the endpoint's default headers), ``delay``
        (seconds), ``drop`` (close the connection without answering).
        """
        raw = body.encode() if isinstance(body, str) else body
        return Reply(status, raw, **options)

    def add(
        self, body: bytes | str = b"", status: int = 200, **options: Unpack[ReplyOptions]
    ) -> Reply:
        """Queue one reply (answers the next unanswered request) and return it.

        Same arguments as :meth:`reply`.
        """
        queued = self.reply(body, status, **options)
        with self._lock:
            self._queue.append(queued)
        return queued

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of the requests received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def pending(self) -> int:
        """How many queued replies no request has consumed yet."""
        with self._lock:
            return len(self._queue)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> ScriptedEndpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ScriptedEndpoint(origin={self.origin!r}, requests={len(self.requests)})"

    # -- serving -------------------------------------------------------------------------------
    def _answer(self, request: RecordedRequest) -> Reply:
        with self._lock:
            self._requests.append(request)
            queued = self._queue.popleft() if self._queue else None
        if queued is not None:
            return queued
        responder = self.responder
        if responder is None:
            return self.default
        try:
            return responder(request)
        except Exception as exc:
            with self._lock:
                self.errors.append(exc)
            return Reply(500, f"ScriptedEndpoint responder failed: {type(exc).__name__}".encode())

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length > 0 else b""
                request = RecordedRequest(
                    self.command, self.path, dict(self.headers.items()), body, time.time()
                )
                reply = endpoint._answer(request)
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.drop:
                    self.close_connection = True
                    return
                self.send_response(reply.status)
                headers = endpoint.default_headers if reply.headers is None else reply.headers
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

            def log_message(self, format: str, *args: object) -> None:
                pass  # quiet: the test reads ``requests`` instead

        return Handler
