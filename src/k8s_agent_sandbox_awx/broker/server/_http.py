"""The broker's HTTP/1.1 connections: uvicorn's h11 protocol, with deadlines for a connection
that has not completed a request, and one warning for a malformed request.

- **Idle** (nothing of a request sent yet): ``keep_alive_seconds``, before a connection's first
  request as between requests (uvicorn arms its keep-alive timer only after a response, so a
  connection that completed TLS and sent nothing was held for ever).
- **A request's head** (its request line and headers): ``request_head_seconds`` from its first
  byte; a head begun and not ended then is answered ``408`` and the connection closed (uvicorn
  has no such deadline: a byte now and then cancelled the only timer there was). The TLS
  handshake has the same deadline (:func:`handshake_deadline`; asyncio's default is 60 s).
- **A malformed request** whose app is already running (a broken chunked body, read after
  the head): the app reads a disconnect and its answer goes nowhere, the client gets uvicorn's
  ``400`` and its one warning ("Invalid HTTP request received."); before, the app's answer
  after that ``400`` failed in h11 and was logged at ERROR with a traceback, on demand.

A request being answered (its body read, a long stream sent) has no deadline here: the app's
own timeouts apply.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, Final

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import ServerSettings

__all__ = ["deadline_protocol", "handshake_deadline"]

_TIMED_OUT: Final = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


class _DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with the deadlines of the module (``head_seconds``: set on the
    subclass :func:`deadline_protocol` makes)."""

    head_seconds: float = ServerSettings.request_head_seconds

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
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
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's head arrived: its app answers it
            self._stop_head_timer()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._stop_head_timer()  # the head arrived; the WebSocket protocol owns the connection
        super().handle_websocket_upgrade(event)

    def _stop_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return
        if self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE:
            text = (
                f"the request head did not arrive within {self.head_seconds:g} s "
                "(request_head_seconds)\n"
            ).encode()
            self.transport.write(_TIMED_OUT % (len(text), text))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # its app runs: it reads a disconnect, and its answer goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        try:
            super().send_400_response(msg)
        except h11.LocalProtocolError:  # an answer began already: the connection just ends
            self.transport.close()


def deadline_protocol(head_seconds: float) -> type[H11Protocol]:
    """uvicorn's ``http=`` protocol class with the module's deadlines, ``head_seconds`` for a
    request's head (the idle deadline is the server's ``timeout_keep_alive``)."""
    return type("BrokerH11Protocol", (_DeadlineH11,), {"head_seconds": head_seconds})


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
