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
- **A request's trailers** (after a chunked body's last chunk): at most
  :data:`MAX_HEAD_BYTES` too (``431``), and never among the request's headers (uvicorn added
  them to its headers: a token in a trailer authenticated; h11 dropped them).
- **Pipelined requests**: at most :data:`._limits.MAX_PIPELINED` waiting behind the one being
  answered; one more, and the last of them is the connection's last answer, what follows is
  not read (llhttp parses all a read brings, and uvicorn held each with its scope: a few MiB
  of pipelined requests held GiB). A caller that leaves is seen gone by the request being
  answered, not only by the newest one pipelined (uvicorn's). A WebSocket handshake pipelined
  behind a request not yet answered is a malformed request (uvicorn switched the connection
  to its WebSocket protocol at once, which answered before that request).
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
from typing import TYPE_CHECKING, Any

from ._limits import MAX_HEAD_BYTES

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["MAX_HEAD_BYTES", "deadline_protocol", "handshake_deadline"]


def deadline_protocol(head_seconds: float) -> type[HttpToolsProtocol]:
    """uvicorn's ``http=`` protocol class with the module's deadlines, ``head_seconds`` for a
    request's head (the idle deadline is the server's ``timeout_keep_alive``). It imports
    ``httptools`` (the ``[broker]`` extra) here, not at the module's import: the local broker
    of ``[local]`` imports this package and serves with uvicorn's h11 protocol."""
    from ._httptools import DeadlineHttpTools

    return type("BrokerHttpProtocol", (DeadlineHttpTools,), {"head_seconds": head_seconds})


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
