"""HTTP mode: the MCP server over streamable HTTP at ``http://HOST:PORT/mcp``, served by uvicorn.

Each MCP session (the ``Mcp-Session-Id`` the SDK's session manager gives a client that opens
with ``initialize``) has its own default sandbox. :class:`SessionTracker`, in front of the SDK's
app, sees every request of a session go by and ends the session, deleting its default
sandbox, when the client ends it (``DELETE``), when the SDK no longer knows it (its answer is
``404``: it expired), when it had no request in flight for the idle timeout (the SDK's, plus
:data:`IDLE_GRACE`), and when the server stops (SIGTERM, SIGINT, SIGHUP: in-flight requests get
:data:`SHUTDOWN_GRACE` seconds, then every session ends). A request of the sessionless
2026-07-28 protocol has no session, hence no default sandbox (``NoSession``).

A non-loopback address is the operator's explicit choice (``--allow-remote``): the server has
no authentication of its own, and whoever reaches it acts with its identity. On loopback the
SDK's DNS-rebinding protection checks ``Host`` and ``Origin``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from mcp.server.context import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.routing import Route

from ._address import ListenError, is_loopback
from ._server import SIGNALS, McpApp, build_server
from ._sessions import NoSession, Session, Sessions

__all__ = ["DEFAULT_IDLE_TIMEOUT", "SessionTracker", "serve_http"]

logger = logging.getLogger("k8s_agent_sandbox_awx.mcp")

DEFAULT_IDLE_TIMEOUT = 1800.0
"""Seconds a session may go without a request in flight before it ends (the SDK's default)."""
IDLE_GRACE = 5.0
"""Seconds past the idle timeout before the tracker ends a session the SDK has let expire."""
SHUTDOWN_GRACE = 5.0
"""Seconds in-flight requests get when a signal stops the server."""
SESSION_HEADER = b"mcp-session-id"


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class SessionTracker:
    """The ASGI app in front of the SDK's: which sessions exist, which are busy, which ended
    (see the module)."""

    def __init__(self, inner: Any, sessions: Sessions, idle_timeout: float) -> None:
        self._inner = inner
        self._sessions = sessions
        self._idle_timeout = idle_timeout
        self._busy: dict[str, int] = {}
        self._seen: dict[str, float] = {}
        self._ending: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._inner(scope, receive, send)
            return
        sid = _header(scope["headers"], SESSION_HEADER)
        answer: dict[str, Any] = {}

        async def watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["sid"] = _header(message.get("headers", ()), SESSION_HEADER)
            await send(message)

        if sid is not None:
            self._busy[sid] = self._busy.get(sid, 0) + 1
        try:
            await self._inner(scope, receive, watch)
        finally:
            self._done(sid, scope["method"], answer)

    def _done(self, sid: str | None, method: str, answer: dict[str, Any]) -> None:
        now, status = time.monotonic(), answer.get("status")
        if sid is not None:
            self._busy[sid] -= 1
            self._seen[sid] = now
        opened = answer.get("sid")
        if sid is None and opened is not None and status is not None and status < 400:
            self._seen[opened] = now  # a new session
        if sid is not None and (
            status == 404 or (method == "DELETE" and status is not None and status < 400)
        ):
            self.end(sid)

    def end(self, sid: str) -> None:
        """End session ``sid`` in a task of its own (a cancelled request does not cut the
        deletion of its default sandbox short)."""
        self._seen.pop(sid, None)
        if not self._busy.get(sid):
            self._busy.pop(sid, None)
        task = asyncio.ensure_future(self._sessions.end(sid))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def reap(self) -> None:
        """End the sessions idle past the timeout (see :data:`IDLE_GRACE`), forever."""
        every = min(max(self._idle_timeout / 10, 0.5), 30.0)
        while True:
            await asyncio.sleep(every)
            limit = time.monotonic() - self._idle_timeout - IDLE_GRACE
            for sid, seen in list(self._seen.items()):
                if not self._busy.get(sid) and seen < limit:
                    logger.info("session %s: idle for %gs, ended", sid[:8], self._idle_timeout)
                    self.end(sid)

    async def finish(self) -> None:
        """Wait for the sessions being ended."""
        if self._ending:
            await asyncio.wait(set(self._ending))


def _session_of(ctx: ServerRequestContext[Any], sessions: Sessions, none: Session) -> Session:
    request = ctx.request
    sid = getattr(request, "headers", {}).get("mcp-session-id") if request is not None else None
    return sessions.get(sid) if sid else none


def _security(host: str) -> TransportSecuritySettings:
    if not is_loopback(host):
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
        allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
    )


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (``serve_http`` handles the signals: SIGHUP
    too, and the process exits 0) and with our start-up line."""

    def __init__(self, config: uvicorn.Config, url: str) -> None:
        super().__init__(config)
        self._url = url

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            logger.info(
                "serving the Model Context Protocol at %s (streamable HTTP, pid %d); each "
                "session's default sandbox is deleted when the session ends; SIGTERM or Ctrl-C "
                "stops it",
                self._url,
                os.getpid(),
            )

    def stop(self) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def listen(host: str, port: int) -> socket.socket:
    """The listening socket (:class:`ListenError` naming the address, e.g. already in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ListenError(f"cannot listen on {host}:{port}: {why}") from None


async def serve_http(
    app: McpApp, host: str, port: int, idle_timeout: float = DEFAULT_IDLE_TIMEOUT
) -> int:
    """Serve until a signal (see the module); the exit code."""
    sock = listen(host, port)
    sessions = Sessions(app.sandboxes)
    none = NoSession(app.sandboxes, "sessionless")
    server = build_server(app, lambda ctx: _session_of(ctx, sessions, none))
    manager = StreamableHTTPSessionManager(
        app=server, security_settings=_security(host), session_idle_timeout=idle_timeout
    )
    tracker = SessionTracker(StreamableHTTPASGIApp(manager), sessions, idle_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        reaper = asyncio.ensure_future(tracker.reap())
        try:
            async with manager.run():
                yield
        finally:
            reaper.cancel()
            await tracker.finish()
            await app.close(sessions.end_all)

    starlette = Starlette(routes=[Route("/mcp", endpoint=tracker)], lifespan=lifespan)
    config = uvicorn.Config(
        starlette, log_level="warning", timeout_graceful_shutdown=int(SHUTDOWN_GRACE)
    )
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    uv = _Uvicorn(config, f"http://{shown}:{bound_port}/mcp")
    loop = asyncio.get_running_loop()
    for signum in SIGNALS:
        loop.add_signal_handler(signum, uv.stop)
    await uv.serve(sockets=[sock])
    return 0
