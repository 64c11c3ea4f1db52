"""``sandbox.ports`` of an :class:`~._async_client.AsyncSandbox`: the async counterpart of
``_ports`` (the same requests, an ``httpx.AsyncClient``, an async port forward)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from ._ports import BROKER_ERROR_HEADER, PortsBase, broker_refusal

if TYPE_CHECKING:
    from ._async_port_forward import AsyncPortForward

__all__ = ["AsyncPorts"]


class AsyncPorts(PortsBase):
    """``sandbox.ports`` of an :class:`~._async_client.AsyncSandbox`."""

    def client(self, port: int, **options: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` for ``port`` of this sandbox (see :meth:`Ports.client`)."""
        port = self._checked(port)
        name = self._sandbox.name

        async def refused(response: httpx.Response) -> None:
            if BROKER_ERROR_HEADER in response.headers:
                await response.aread()
                raise broker_refusal(response, port, name)

        settings = self._settings(port, options)
        return httpx.AsyncClient(**settings, event_hooks={"response": [refused]})

    def forward(self, port: int, local_port: int = 0) -> AsyncPortForward:
        """As :meth:`Ports.forward`, as an async context manager (``async with``)."""
        from ._async_port_forward import AsyncPortForward
        from ._port_forward import ForwardTarget

        port = self._checked(port)
        target = ForwardTarget(
            self._config, self.headers(port), self._auth_source, port, self._sandbox.name
        )
        return AsyncPortForward(target, local_port)
