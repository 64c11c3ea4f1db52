"""A loopback HTTP/1.1 runtime for the tests of the broker's own connections
(``broker/backends/_http11``): ``handler`` runs per connection; connections are counted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from k8s_agent_sandbox_awx.broker.backends._http11 import Http11Pool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class LoopbackRuntime:
    """A loopback server running ``handler`` per connection; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> LoopbackRuntime:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await self.handler(reader, writer)
            writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    def pool(self, **kw: float) -> Http11Pool:
        return Http11Pool("127.0.0.1", self.port, keep=int(kw.get("keep", 8)),
                          idle_seconds=kw.get("idle_seconds", 15.0))  # fmt: skip
