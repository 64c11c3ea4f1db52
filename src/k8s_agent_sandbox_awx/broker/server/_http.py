"""The broker's HTTP/1.1 connections: uvicorn's httptools protocol (llhttp, the parser of
Node.js, in C: about half the CPU per request of uvicorn's h11 protocol, docs/performance.md),
with deadlines and a size limit for a connection that has not completed a request's head, and
one warning for a malformed request.

- **Idle** (nothing of a request sent yet): ``keep_alive_seconds``, before a connection's first
  request as between requests (uvicorn arms its keep-alive timer only after a response, so a
  connection that completed TLS and sent nothing was held for ever).
- **A request's head** (its request line and headers): ``request_head_seconds`` from its first
  byte; a head begun and not ended then is answered ``408`` and the connection closed (uvicorn
  has no such deadline: a byte now and then cancelled the only timer there was). The TLS
  handshake has the same deadline (:func:`handshake_deadline`; asyncio's default is 60 s).
- **A request's head, its size**: at most :data:`MAX_HEAD_BYTES`, the request line and the
  headers (h11's limit, which the broker had before); a longer one is answered ``431`` and the
  connection closed (llhttp sets no limit, and httptools holds a header's value until it ends).
- **A malformed request** (llhttp refuses it: both framings, a broken chunked body, a bad
  header, a method it does not know): uvicorn's ``400`` and its one warning ("Invalid HTTP
  request received."), the connection closed; an app already running for it reads a
  disconnect and its answer goes nowhere; one whose answer had begun just loses the connection.

A request being answered (its body read, a long stream sent) has no deadline here: the app's
own timeouts apply.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, Final
from urllib.parse import unquote

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..config import ServerSettings

__all__ = ["MAX_HEAD_BYTES", "deadline_protocol", "handshake_deadline"]

MAX_HEAD_BYTES: Final = 16 * 1024
"""The most a request's line and headers may take (as h11's default, which served before)."""

_REFUSED: Final = (
    b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


class _HeadTooLarge(Exception):
    """Raised in a parser callback: the head passed :data:`MAX_HEAD_BYTES`."""


class _DeadlineHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the limit of the module
    (``head_seconds``: set on the subclass :func:`deadline_protocol` makes)."""

    head_seconds: float = ServerSettings.request_head_seconds

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # between a request's first byte and its head's end
        self._given = 0  # this head's URL and headers, as the callbacks get them
        self._fed = 0  # the chunks fed that began and ended inside this head
        self._too_large = False
        # idle until a request's first byte: uvicorn's keep-alive timer (data cancels it)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._between_requests():
            self._head_timer = self.loop.call_later(self.head_seconds, self._head_timed_out)
        inside = self._in_head
        super().data_received(data)
        if inside and self._in_head and not self.transport.is_closing():
            # a chunk that began and ended inside a head is all head: what llhttp holds of a
            # value that has not ended counts too, not only what the callbacks were given
            self._fed += len(data)
            if self._fed > MAX_HEAD_BYTES:
                self._too_large = True
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("")

    # the parser's callbacks: a head's size (its URL and headers), and its end
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._given, self._fed = True, 0, 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()  # the head arrived: its app answers it
        target = self.url
        sent = _as_sent(target)  # before the app's task exists: a bad target is uvicorn's 400
        self.url = b"/"  # what uvicorn parses; the scope gets the target as it came (below)
        try:
            super().on_headers_complete()
        finally:
            self.url = target
        if "raw_path" in self.scope:  # an HTTP request (not a WebSocket's upgrade)
            self.scope.update(sent)  # type: ignore[typeddict-item]

    def _count(self, size: int) -> None:
        self._given += size
        if self._given > MAX_HEAD_BYTES:
            self._too_large = True
            raise _HeadTooLarge  # the parser stops; uvicorn warns and calls send_400_response

    def handle_websocket_upgrade(self) -> None:
        self._stop_head_timer()  # the head arrived; the WebSocket protocol owns the connection
        super().handle_websocket_upgrade()

    def _stop_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return
        text = (
            f"the request head did not arrive within {self.head_seconds:g} s "
            "(request_head_seconds)\n"
        )
        self._refuse(b"408 Request Timeout", text)

    def _refuse(self, status: bytes, text: str) -> None:
        body = text.encode()
        self.transport.write(_REFUSED % (status, len(body), body))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # its app runs: it reads a disconnect, and its answer goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:  # an answer began already: the connection just ends
                self.transport.close()
                return
        if self._too_large:
            text = f"the request head is over {MAX_HEAD_BYTES} bytes (its line and headers)\n"
            self._refuse(b"431 Request Header Fields Too Large", text)
            return
        super().send_400_response(msg)


def _as_sent(target: bytes) -> dict[str, Any]:
    """The scope's path, raw path and query from the request target exactly as it came, as
    uvicorn's h11 protocol made them: httptools' URL parser takes the path out of an absolute
    target (``http://host:port/path``) and drops a fragment, so the request gate could no
    longer refuse what is not origin-form (it must never become the forward's authority)."""
    raw_path, _, query = target.partition(b"?")
    return {"raw_path": raw_path, "path": unquote(raw_path.decode("ascii")), "query_string": query}


def deadline_protocol(head_seconds: float) -> type[HttpToolsProtocol]:
    """uvicorn's ``http=`` protocol class with the module's deadlines, ``head_seconds`` for a
    request's head (the idle deadline is the server's ``timeout_keep_alive``)."""
    return type("BrokerHttpProtocol", (_DeadlineHttpTools,), {"head_seconds": head_seconds})


@contextlib.contextmanager
def handshake_deadline(loop: asyncio.AbstractEventLoop, seconds: float) -> Iterator[None]:
    """While uvicorn's server starts in this block: its TLS listeners' handshakes have
    ``seconds`` (uvicorn passes no ``ssl_handshake_timeout`` to ``loop.create_server``; a
    client that never completed TLS held its connection for asyncio's 60 s)."""
    original = loop.create_server

    async def create_server(*args: Any, **kwargs: Any) -> asyncio.Server:
        if kwargs.get("ssl") is not None:
            kwargs.setdefault("ssl_handshake_timeout", seconds)
        return await original(*args, **kwargs)

    loop.create_server = create_server  # type: ignore[method-assign]
    try:
        yield
    finally:
        del loop.create_server  # the class's method again
