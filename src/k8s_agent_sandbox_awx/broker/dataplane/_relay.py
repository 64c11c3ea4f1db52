"""The relay: a runtime's answer streamed to the client as it comes, and what happens when a peer
goes away mid-stream.

A broken answer must reach the client broken, never complete: the broker then drops the
client's connection (:class:`DroppedConnection`, raised after the answer started; the server
closes the connection, and :func:`install_log_filter` keeps that expected event out of the
error log as a traceback; it also keeps out the server's complaint after a WebSocket handshake
the broker answered with an HTTP answer: :func:`handshake_answered`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Final, Protocol

import httpx
from starlette.types import Message, Receive, Send

from ..common._errors import BROKER_ERROR_HEADER_RAW, ApiError

log = logging.getLogger("k8s_agent_sandbox_awx.broker")

Deleting = Callable[[], Awaitable[bool]]
"""Whether the sandbox whose answer is relayed is being deleted now (asked when it breaks off)."""

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
"""Headers of one hop, never forwarded (either way)."""


class DroppedConnection(Exception):
    """Raised after the response started, so that the server drops the connection."""


NO_HANDSHAKE: Final = "ASGI callable returned without completing handshake."
"""What uvicorn's ``websockets-sansio`` server (0.54) logs as an ERROR after every handshake
the app answered with an HTTP answer of its own (the ASGI ``websocket.http.response``
extension): it sends the whole answer, then does not count it as the handshake's end."""
_HANDSHAKE_ANSWERED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "k8s_agent_sandbox_awx_handshake_answered", default=False
)


def handshake_answered() -> None:
    """The broker answered this connection's WebSocket handshake with a whole HTTP answer
    (a refusal, or the sandbox's server's answer relayed): its access line says so, and the
    server's :data:`NO_HANDSHAKE` that follows is left out of the error log. Set in the
    connection's own task (the server logs there once the app returned), never reset."""
    _HANDSHAKE_ANSWERED.set(True)


class _DropFilter(logging.Filter):
    """Leaves out of the server's error log what the broker logs itself or answered: the
    traceback of a dropped connection, :data:`NO_HANDSHAKE` after a handshake answered whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.msg == NO_HANDSHAKE and _HANDSHAKE_ANSWERED.get():
            return False
        return not isinstance(exc, DroppedConnection)


def install_log_filter() -> None:
    """Keep the server's "Exception in ASGI application" for a dropped connection out of its
    error log (the relay logs such an event itself, as one line), and its
    :data:`NO_HANDSHAKE` after a handshake the broker answered (its access line has it)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropFilter) for f in logger.filters):
        logger.addFilter(_DropFilter())


_BROKERS_OWN: Final = frozenset({b"date", b"server", b"x-request-id", BROKER_ERROR_HEADER_RAW})
"""Headers of a sandbox's answer that the broker's server sets itself (``Date``, ``Server``),
that the broker's observing layer sets (``X-Request-Id``: the id of the request's access and
audit lines) or that mark the broker's own answers: never relayed."""


def relayed_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers of a sandbox's answer as the client gets them, on every path (HTTP, and a
    WebSocket handshake's answer other than ``101``): no hop-by-hop header, none of
    :data:`_BROKERS_OWN` (the mark of the broker's errors among them, so a sandbox cannot pass
    its answer off as the broker's), names in lower case."""
    return [
        (k.lower(), v)
        for k, v in raw
        if k.decode("latin-1").lower() not in HOP_BY_HOP and k.lower() not in _BROKERS_OWN
    ]


def unrelayable(status: int, sandbox: str) -> ApiError | None:
    """The broker's ``502 sandbox_answer_lost`` for a sandbox's final answer whose status HTTP
    does not have (``200``-``599`` are relayed; the broker's server cannot send another), else
    ``None``."""
    if 200 <= status <= 599:
        return None
    return ApiError(
        502,
        "sandbox_answer_lost",
        f"sandbox {sandbox!r} answered with status {status}, which is no final HTTP status "
        "(200-599): its answer is not relayed, and the request reached the sandbox",
    )


class _AnswerHeaders(Protocol):
    @property
    def raw(self) -> list[tuple[bytes, bytes]]: ...

    def get(self, key: str, default: str = ..., /) -> str: ...


class Answer(Protocol):
    """A runtime's answer as the forward reads it, whichever client carried the request: an
    ``httpx.Response`` or a :class:`.backends._http11.Http11Answer`."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> _AnswerHeaders: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


def answer_headers(response: Answer) -> list[tuple[bytes, bytes]]:
    """The headers of a runtime's answer as the client gets them (:func:`relayed_headers`)."""
    return relayed_headers(response.headers.raw)


async def _client_gone(receive: Receive) -> None:
    """Return when the client disconnects (the request body has been read by then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class Relay:
    """One runtime answer on its way to the client (``what``: its method and route template,
    never its raw path; ``sandbox``: the sandbox's name; ``deleting()``: whether it is being
    deleted now).

    A peer that goes away mid-stream is an expected event, logged as one line without a
    traceback: the client going away (it closed a ``watch_dir`` or an event stream early) stops
    the relay at once (INFO) and the broker stops reading from the runtime; the runtime breaking
    off its answer (killed, or silent past the read timeout) drops the client's connection, so
    that the client sees a broken answer, never a complete one (WARNING; INFO when the sandbox
    is being deleted)."""

    def __init__(
        self, receive: Receive, send: Send, sandbox: str, what: str, deleting: Deleting
    ) -> None:
        self.receive = receive
        self.send = send
        self.sandbox = sandbox
        self.what = what
        self.deleting = deleting

    async def pump(self, chunks: AsyncIterator[bytes]) -> None:
        """Send ``chunks`` as the body, then end it, unless a peer goes away first."""
        loop = asyncio.get_running_loop()
        gone = loop.create_task(_client_gone(self.receive))
        copy = loop.create_task(self._copy(chunks))
        try:
            await asyncio.wait({gone, copy}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            copy.cancel()  # no-op once done; else the client went away (or the broker stops)
        await asyncio.wait({copy})
        if not copy.cancelled():
            await self._raise_for(copy.exception())
            return
        log.info(
            "sandbox %s: the client went away during %s; stopped relaying the runtime's answer",
            self.sandbox,
            self.what,
        )

    async def _copy(self, chunks: AsyncIterator[bytes]) -> None:
        async for chunk in chunks:
            if chunk:
                message: Message = {"type": "http.response.body", "body": chunk, "more_body": True}
                await self.send(message)
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _raise_for(self, exc: BaseException | None) -> None:
        if exc is None:
            return
        if isinstance(exc, httpx.HTTPError):
            deleting = await self.deleting()
            log.log(
                logging.INFO if deleting else logging.WARNING,
                "sandbox %s: the runtime's answer to %s broke off mid-stream (%s: %s)%s; "
                "dropped the client's connection",
                self.sandbox,
                self.what,
                type(exc).__name__,
                str(exc)[:200],
                " as the sandbox is being deleted" if deleting else "",
            )
            raise DroppedConnection(f"the runtime's answer broke off: {exc}") from None
        raise exc
