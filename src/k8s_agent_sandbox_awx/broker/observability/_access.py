"""The observing layer: one broker request followed from its first byte to its last.

:class:`Observed` wraps the broker's ASGI app. For each HTTP request it opens an
:class:`..common._observed.Exchange` (the parts below note who, what and which sandbox into
it), takes the client's ``X-Request-Id`` when it is a sane token (else makes one) and echoes it
in the answer, counts the body bytes each way, and once the answer ended (a stream: at its last
byte, or when a peer went away) hands the record to its sinks: the access log
(:func:`access_record`), the audit log (:mod:`._audit`) and the metrics (:mod:`._metrics`).

How an answer ended (``end``): ``complete``; ``client_gone`` (the client went away first);
``upstream_broke`` (the sandbox's answer broke off mid-stream: the broker dropped the client's
connection); ``error`` (the app failed: the server answers 500); ``incomplete`` (the app
returned without finishing the answer).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from .._app import plane_of
from ..backends._interface import RUNTIME_PORT
from ..common._metadata import DNS_LABEL
from ..common._observed import Exchange, close_exchange, open_exchange
from ..common._route_names import (
    PORT_ROUTE,
    UNMATCHED,
    WEBSOCKET_ROUTE,
    data_route,
    issuer_route,
    logged_method,
    v1_route,
)
from ..dataplane._relay import DroppedConnection
from ._lines import LineWriter, timestamp

__all__ = ["REQUEST_ID_HEADER", "Counts", "Observed", "access_record"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.observability")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER: Final = "X-Request-Id"
_REQUEST_ID_RAW: Final = b"x-request-id"
_SANE_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
"""A client's request id is kept when it is 1-64 of these characters (a UUID, a trace id);
anything else (longer, spaces, quotes, non-ASCII) is replaced by one the broker makes."""


@dataclass
class Counts:
    """What passed through one request: its status, body bytes each way, how it ended."""

    status: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    completed: bool = False
    client_gone: bool = False
    end: str = ""

    def ending(self) -> str:
        if self.end:
            return self.end
        if self.completed:
            return "complete"
        return "client_gone" if self.client_gone else "incomplete"


class Sink(Protocol):
    """What the layer hands each finished request to (the audit log, the metrics)."""

    def record(self, exchange: Exchange, counts: Counts, duration: float) -> None: ...


def request_id(scope: Scope) -> str:
    """The client's ``X-Request-Id`` if it is sane, else a new one (32 hex digits)."""
    for name, value in scope.get("headers") or ():
        if name == _REQUEST_ID_RAW:
            try:
                text: str = bytes(value).decode("ascii")
            except UnicodeDecodeError:
                break
            if _SANE_REQUEST_ID.fullmatch(text):
                return text
            break
    return new_request_id()


_UUID4_CLEAR: Final = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET: Final = (0x4000 << 64) | (0x8000 << 48)


def new_request_id() -> str:
    """A random UUID (version 4) as 32 hex digits: ``uuid.uuid4().hex``, from the same 16
    bytes of ``os.urandom``, without making a ``UUID`` object for it."""
    number = int.from_bytes(os.urandom(16)) & _UUID4_CLEAR | _UUID4_SET
    return f"{number:032x}"


def _name_or_none(value: str | None) -> str | None:
    return value if value and len(value) <= 63 and DNS_LABEL.match(value) else None


def _port_request(value: str | None) -> int | None:
    """The port of a port request (``X-Sandbox-Port`` a valid port other than the runtime's),
    else ``None`` (a runtime request, or a header the broker refuses)."""
    if value is None or not value.isascii() or not value.isdigit():
        return None
    port = int(value)
    return port if 1 <= port <= 65535 and port != RUNTIME_PORT else None


def _data_headers(scope: Scope) -> tuple[str | None, str | None]:
    """The first ``X-Sandbox-Port`` and ``X-Sandbox-ID`` of a request (``None``: absent), as
    ``starlette.datastructures.Headers(scope=scope).get`` reads them, in one pass."""
    port: str | None = None
    sandbox: str | None = None
    for name, value in scope["headers"]:
        if name == b"x-sandbox-port" and port is None:
            port = value.decode("latin-1")
        elif name == b"x-sandbox-id" and sandbox is None:
            sandbox = value.decode("latin-1")
    return port, sandbox


def classify(exchange: Exchange, scope: Scope, protocols: tuple[str, ...]) -> None:
    """The plane, the route template and the sandbox a request names, from its path and
    headers (the ``/rpc`` op is noted by the front-end once it read the body)."""
    path: str = scope["path"]
    plane = plane_of(scope, protocols)
    exchange.plane = plane
    if plane == "data":
        port, sandbox = _data_headers(scope)
        exchange.port = _port_request(port)
        if scope["type"] == "websocket":
            exchange.route = WEBSOCKET_ROUTE
        else:
            exchange.route = PORT_ROUTE if exchange.port is not None else data_route(path)
        exchange.sandbox = _name_or_none(sandbox)
    elif plane == "v1":
        exchange.route = v1_route(path)
        if "{name}" in exchange.route:
            exchange.sandbox = _name_or_none(path.split("/")[3])
    elif plane == "rpc":
        exchange.route = "/rpc"
    elif plane == "issuer":
        exchange.route = issuer_route(path)
    else:
        exchange.route = UNMATCHED


def access_record(exchange: Exchange, counts: Counts, duration: float) -> dict[str, Any]:
    """The access log's line for one request (``"log": "access"``): never a token, a header
    value, a query or a raw path."""
    caller = exchange.caller
    return {
        "time": timestamp(),
        "log": "access",
        "request_id": exchange.request_id,
        "method": logged_method(exchange.method),
        "route": exchange.route,
        "plane": exchange.plane or None,
        "status": counts.status,
        "duration_ms": round(duration * 1000, 3),
        "end": counts.ending(),
        "issuer": caller.issuer if caller else None,
        "subject": caller.subject if caller else None,
        "provider": caller.provider if caller else None,
        "sandbox": exchange.sandbox,
        "claim": exchange.claim,
        "port": exchange.port,
        "bytes_in": counts.bytes_in,
        "bytes_out": counts.bytes_out,
        "error": exchange.error[0] if exchange.error else None,
    }


class Observed:
    """``app`` observed: each HTTP request's record goes to ``access`` (a line per request;
    ``None``: no access log) and to every one of ``sinks``; ``protocols``: the dialects the app
    serves (for its routes)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        access: LineWriter | None,
        sinks: tuple[Sink, ...] = (),
        protocols: tuple[str, ...] = ("v1", "rpc"),
    ) -> None:
        self.app = app
        self.access = access
        self.sinks = sinks
        self.protocols = protocols

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        websocket = scope["type"] == "websocket"
        method = "GET" if websocket else scope["method"]  # a WebSocket handshake is a GET
        exchange = Exchange(request_id=request_id(scope), method=method)
        classify(exchange, scope, self.protocols)
        counts = Counts()
        token = open_exchange(exchange)
        if websocket:
            receive, send = _ws_receive(receive, counts), _ws_send(send, counts, exchange)
        else:
            receive, send = _counted_receive(receive, counts), _counted_send(send, counts, exchange)
        try:
            await self.app(scope, receive, send)
        except DroppedConnection:
            counts.end = "upstream_broke"
            raise
        except BaseException:
            counts.end = "client_gone" if counts.client_gone else "error"
            counts.status = counts.status or 500
            raise
        finally:
            close_exchange(token)
            self._finish(exchange, counts, time.perf_counter() - exchange.started)

    def _finish(self, exchange: Exchange, counts: Counts, duration: float) -> None:
        try:
            if self.access is not None:
                self.access.write(access_record(exchange, counts, duration))
            for sink in self.sinks:
                sink.record(exchange, counts, duration)
        except Exception:  # observing must never fail the request; the bug is logged
            log.exception("could not record request %s", exchange.request_id)


def _counted_receive(receive: Receive, counts: Counts) -> Receive:
    async def counted() -> Message:
        message = await receive()
        if message["type"] == "http.request":
            counts.bytes_in += len(message.get("body", b""))
        elif message["type"] == "http.disconnect" and not counts.completed:
            counts.client_gone = True
        return message

    return counted


def _counted_send(send: Send, counts: Counts, exchange: Exchange) -> Send:
    rid = exchange.request_id.encode("ascii")

    async def counted(message: Message) -> None:
        if message["type"] == "http.response.start":
            counts.status = int(message["status"])
            headers = [
                (k, v) for k, v in message.get("headers", ()) if k.lower() != _REQUEST_ID_RAW
            ]
            message = {**message, "headers": [*headers, (_REQUEST_ID_RAW, rid)]}
        elif message["type"] == "http.response.body":
            counts.bytes_out += len(message.get("body", b""))
            if not message.get("more_body", False):
                counts.completed = True
        await send(message)

    return counted


def _ws_receive(receive: Receive, counts: Counts) -> Receive:
    """A WebSocket's receive, counted: the caller's messages are its ``bytes_in``; the caller
    gone without a close (codes 1005, 1006) ends it ``client_gone``."""

    async def counted() -> Message:
        message = await receive()
        if message["type"] == "websocket.receive":
            counts.bytes_in += _payload_size(message)
        elif message["type"] == "websocket.disconnect" and not counts.completed:
            if message.get("code") in (1005, 1006):
                counts.client_gone = True
            else:
                counts.completed = True  # the caller closed the WebSocket
        return message

    return counted


def _ws_send(send: Send, counts: Counts, exchange: Exchange) -> Send:
    """A WebSocket's send, counted: the status of the handshake's answer (``101`` once
    accepted, a refusal's own, ``403`` for a close before the handshake, as the server answers
    it), ``X-Request-Id`` added to it; the messages sent are ``bytes_out``."""
    rid = (_REQUEST_ID_RAW, exchange.request_id.encode("ascii"))

    async def counted(message: Message) -> None:
        kind = message["type"]
        if kind in ("websocket.accept", "websocket.http.response.start"):
            counts.status = 101 if kind == "websocket.accept" else int(message["status"])
            headers = [h for h in message.get("headers", ()) if h[0].lower() != _REQUEST_ID_RAW]
            message = {**message, "headers": [*headers, rid]}
        elif kind == "websocket.send":
            counts.bytes_out += _payload_size(message)
        elif kind == "websocket.close":
            counts.status = counts.status or 403
            counts.completed = True
        elif kind == "websocket.http.response.body" and not message.get("more_body", False):
            counts.completed = True
        await send(message)

    return counted


def _payload_size(message: Message) -> int:
    data = message.get("bytes")
    if data is not None:
        return len(data)
    return len((message.get("text") or "").encode())
