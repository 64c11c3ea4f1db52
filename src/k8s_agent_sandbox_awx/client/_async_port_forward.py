"""``sandbox.ports.forward(port)`` of an :class:`~._async_client.AsyncSandbox`: the async
counterpart of ``_port_forward`` (the same forwarder and its threads, started and stopped off
the event loop)."""

from __future__ import annotations

import asyncio
from types import TracebackType

from ._port_forward import ForwardTarget, PortForward

__all__ = ["AsyncPortForward"]


class AsyncPortForward:
    """:class:`PortForward` as an async context manager (``async with``): the same threads,
    started and stopped off the event loop."""

    def __init__(self, target: ForwardTarget, local_port: int = 0) -> None:
        self._target = target
        self._local_port = local_port
        self._forward: PortForward | None = None

    @property
    def port(self) -> int:
        return self._running().port

    @property
    def url(self) -> str:
        return self._running().url

    def _running(self) -> PortForward:
        if self._forward is None:
            raise RuntimeError("the port forward is not running: use it with 'async with'")
        return self._forward

    async def __aenter__(self) -> AsyncPortForward:
        self._forward = PortForward(self._target, self._local_port)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._forward is not None:
            await asyncio.to_thread(self._forward.close)
