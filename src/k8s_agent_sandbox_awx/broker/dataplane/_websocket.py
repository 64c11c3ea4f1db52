"""WebSocket upgrades on port requests, proxied both ways (docs/broker-api.md, "Ports").

The broker's server accepts a WebSocket handshake (an ASGI ``websocket`` scope) when the
``websockets`` library is installed (the ``[broker]`` and ``[local]`` extras: :func:`ws_protocol`).
A handshake that carries ``X-Sandbox-ID`` passes the checks of every port request first
(token, owner, claim binding, scope, the port allowed by the policy, Ready); only then does the
broker open a WebSocket to the port in the sandbox (the caller's ``Authorization``, cookies and
the router headers not sent), and only when that one is open does it accept the caller's: a
refusal is the broker's JSON error (``port_not_listening``...), an answer of the server other
than ``101`` is relayed as the server's. Then messages flow both ways, each direction on its
own (a peer that stops reading holds up only what is sent to it); a close is passed on with
its code and reason (the sandbox's server gets :data:`CLOSE_TIMEOUT` seconds to answer the
broker's close, then its connection is dropped). Flow control, not buffering: a receiver that
stops reading makes the broker stop reading from its sender once a message or two wait
(:data:`UPSTREAM_QUEUE`; the caller's side: uvicorn's), so the sender's sends block; the broker
holds a few messages per direction, never what the sender offers. The bounds
(:mod:`._ws_limits`): a caller holds at most ``websocket_max_per_caller`` WebSockets open at
once (``429 websocket_limit``), a message is at most ``websocket_max_message_bytes`` either
way (1009).

Without ``websockets`` a handshake arrives as a plain request: the broker answers it ``501
websocket_unsupported`` naming the missing library.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import Receive, Scope, Send

from ..backends._interface import RUNTIME_PORT, BackendUnavailable, Route
from ..common._errors import BACKEND_RETRY_AFTER, BROKER_ERROR_HEADER, ApiError
from ..common._gate import origin_form
from ..common._observed import note_error
from ._data_request import DataRequest, router_headers
from ._forward import Forward, forwarded_headers
from ._ports import log_port_request, not_listening
from ._relay import handshake_answered, relayed_headers, unrelayable
from ._target import CODE as TARGET_CODE
from ._target import NonNormalTarget, port_target
from ._unreachable import connect_failure, says_not_connected
from ._ws_limits import CallerSlots, WebSocketLimits, own_close, upstream_connection

UPSTREAM_QUEUE = 1
"""Frames received from the sandbox's server and not yet relayed beyond which the broker stops
reading from it (``websockets``' ``max_queue``; its default, 16, let a caller that reads
nothing make the broker hold 16 messages, up to 256 MiB). The caller's side is bounded by the
broker's server: uvicorn stops reading a caller until its last message was taken."""
CLOSE_TIMEOUT = 2.0
"""Seconds the broker waits for the sandbox's server to answer its close (after the caller
left or closed) before it drops the connection (``websockets``' ``close_timeout``; its default,
10 s, held a stuck server's connection, and the caller's session, that long)."""
_SENT_BY_LIBRARY = (b"sec-websocket-", b"upgrade", b"connection", b"user-agent")


class WebSocketForward:
    """The WebSocket side of :class:`._forward.Forward` (the same checks, the same routes)."""

    def __init__(self, forward: Forward, limits: WebSocketLimits | None = None) -> None:
        self.forward = forward
        self.limits = limits or WebSocketLimits()
        self.slots = CallerSlots(self.limits.max_per_caller)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection = HTTPConnection(scope, receive)
        with contextlib.ExitStack() as slot:  # the caller's, from its checks to the close
            try:
                upstream = await self._open(connection, slot)
            except ApiError as exc:
                await refuse(send, exc)
                return
            except _Answered as answered:
                await _http_answer(send, answered.status, answered.headers, answered.body)
                return
            await _relay(upstream, receive, send)

    async def _open(self, connection: HTTPConnection, slot: contextlib.ExitStack) -> Any:
        """The checks of a port request (and one of the caller's WebSocket slots), then the
        WebSocket to the sandbox's port."""
        try:
            data = _websocket_request(connection)
            caller = await self.forward.gate.authenticate(connection)
            slot.enter_context(self.slots.hold(caller))
            state = await self.forward._ready_sandbox(connection, caller, data)
            route = await self.forward.route(state, data.port)
        except BackendUnavailable as exc:  # as _app answers it for an HTTP request
            retry = {"Retry-After": str(BACKEND_RETRY_AFTER)}
            raise ApiError(503, "backend_unavailable", exc.detail, retry) from None
        log_port_request(state.name, data.port, "WEBSOCKET")
        return await _open(route, data, connection, state.name, self.limits.max_message_bytes)


class _Answered(Exception):
    """The sandbox's server answered the handshake with something else than ``101``."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        super().__init__(status)
        self.status, self.headers, self.body = status, headers, body


def _websocket_request(connection: HTTPConnection) -> DataRequest:
    sandbox_id, namespace, port, timeout = router_headers(connection)
    if port == RUNTIME_PORT:
        raise ApiError(
            400,
            "websocket_not_port",
            f"a WebSocket goes to a port of a server of your own in the sandbox, not to the "
            f"runtime's port {RUNTIME_PORT}: send X-Sandbox-Port with your server's port",
        )
    try:
        target = port_target(origin_form(connection.scope))
    except NonNormalTarget as exc:
        raise ApiError(400, TARGET_CODE, exc.detail) from None
    return DataRequest(sandbox_id, namespace, port, timeout, target)


async def _open(
    route: Route,
    data: DataRequest,
    connection: HTTPConnection,
    name: str,
    max_size: int = WebSocketLimits.max_message_bytes,
) -> Any:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidHandshake, InvalidStatus

    secure = route.scheme == "https"
    uri = websocket_uri(route, data.target.raw)
    headers = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in [*forwarded_headers(connection.headers.raw), *route.headers]
        if not k.lower().startswith(_SENT_BY_LIBRARY)
    ]
    subprotocols = connection.scope.get("subprotocols") or None
    try:
        return await connect(
            uri,
            additional_headers=headers,
            subprotocols=subprotocols,
            user_agent_header=None,
            compression=None,
            proxy=None,
            ssl=route.tls if secure else None,  # verified as the route's HTTP requests are
            open_timeout=min(data.timeout, 30.0),
            ping_interval=None,  # the peers keep their own connection alive
            max_size=max_size,
            max_queue=UPSTREAM_QUEUE,
            close_timeout=CLOSE_TIMEOUT,
            create_connection=upstream_connection(),
        )
    except InvalidStatus as exc:
        raise _answered(exc.response, route, name, data.port) from None
    except (OSError, TimeoutError, InvalidHandshake) as exc:
        failure = connect_failure(route, exc, name, data.port)  # TLS, the router, refused
        raise failure or ApiError(
            502,
            "sandbox_unreachable",
            f"the WebSocket handshake with port {data.port} of sandbox {name!r} failed "
            f"({type(exc).__name__})",
        ) from None


def websocket_uri(route: Route, target: bytes) -> str:
    """The ``ws(s)://`` URI of ``target`` on ``route`` (an IPv6 pod IP in brackets)."""
    host = f"[{route.host}]" if ":" in route.host else route.host
    scheme = "wss" if route.scheme == "https" else "ws"
    return f"{scheme}://{host}:{route.port}{target.decode('ascii')}"


def _answered(answer: Any, route: Route, name: str, port: int) -> Exception:
    """The server's answer other than ``101`` to relay, or the broker's ``port_not_listening``
    when it is the router's answer that it could not connect to the port."""
    body = bytes(answer.body or b"")
    if says_not_connected(route, answer.status_code, body):
        return not_listening(name, port, via_router=True)
    refused = unrelayable(answer.status_code, name)
    if refused is not None:
        return refused
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.raw_items()]
    relayed = [h for h in relayed_headers(raw) if h[0] != b"content-length"]  # the server's own
    return _Answered(answer.status_code, relayed, body)


async def refuse(send: Send, exc: ApiError) -> None:
    """Answer a handshake with the broker's error ``exc`` (its JSON, as on HTTP; the ASGI
    ``websocket.http.response`` extension), its code noted for the access line and the
    metrics."""
    note_error(exc.code, exc.logged)
    await _http_answer(send, exc.status, _error_headers(exc), _error_body(exc))


def _error_headers(exc: ApiError) -> list[tuple[bytes, bytes]]:
    headers = {**exc.headers, BROKER_ERROR_HEADER: exc.code, "content-type": "application/json"}
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _error_body(exc: ApiError) -> bytes:
    import json

    return json.dumps({"detail": exc.detail, "code": exc.code}).encode()


async def _http_answer(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """An HTTP answer to a handshake (the ASGI ``websocket.http.response`` extension)."""
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
    handshake_answered()  # the server's "returned without completing handshake" is noise


async def _relay(upstream: Any, receive: Receive, send: Send) -> None:
    """Accept the caller's WebSocket, then relay both ways until either side closes."""
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
    loop = asyncio.get_running_loop()
    inbound = loop.create_task(_to_upstream(upstream, receive))
    outbound = loop.create_task(_to_caller(upstream, send))
    try:
        await asyncio.wait({inbound, outbound}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (inbound, outbound):
            task.cancel()
        await asyncio.gather(inbound, outbound, return_exceptions=True)
        with contextlib.suppress(Exception):
            await upstream.close()


async def _to_upstream(upstream: Any, receive: Receive) -> None:
    from websockets.exceptions import ConnectionClosed

    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            code = message.get("code") or 1000
            reason = message.get("reason") or ""
            await upstream.close(code=1000 if code in (1005, 1006) else code, reason=reason)
            return
        if message["type"] != "websocket.receive":
            continue
        data = message.get("bytes")
        try:
            await upstream.send(data if data is not None else message.get("text") or "")
        except ConnectionClosed:
            return


async def _to_caller(upstream: Any, send: Send) -> None:
    from websockets.exceptions import ConnectionClosed

    try:
        async for message in upstream:
            key = "bytes" if isinstance(message, bytes) else "text"
            await send({"type": "websocket.send", key: message})
    except ConnectionClosed:
        pass
    code, reason = own_close(upstream) or (upstream.close_code, upstream.close_reason or "")
    code = 1000 if code in (None, 1005) else 1011 if code in (1006, 1015) else code
    with contextlib.suppress(Exception):  # the caller may be gone already
        await send({"type": "websocket.close", "code": code, "reason": reason})
