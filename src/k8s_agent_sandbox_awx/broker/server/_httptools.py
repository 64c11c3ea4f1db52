"""uvicorn's httptools protocol with the broker's deadlines and head limit (described in
:mod:`._http`). Imported only by :func:`._http.deadline_protocol`, so ``broker serve`` alone
needs ``httptools`` (the ``[broker]`` extra): the local broker of ``[local]`` (``demo``, ``dev``,
the tests' brokers) serves with uvicorn's h11 protocol and never imports this.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final
from urllib.parse import unquote

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..config import ServerSettings
from ._limits import MAX_HEAD_BYTES

__all__ = ["DeadlineHttpTools"]

_REFUSED: Final = (
    b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


class _HeadTooLarge(Exception):
    """Raised in a parser callback: the head passed :data:`MAX_HEAD_BYTES`."""


class DeadlineHttpTools(HttpToolsProtocol):
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
