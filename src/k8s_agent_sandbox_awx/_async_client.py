"""``AsyncBrokerSandboxClient``: ``BrokerSandboxClient`` for asyncio applications."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Self

import httpx

from . import _flow as flow
from . import _protocol as proto
from ._async_transport import AsyncBrokerTransport
from ._base import ClientBase

if TYPE_CHECKING:
    from ._async_sandbox import AsyncSandbox

__all__ = ["AsyncBrokerSandboxClient"]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")


class AsyncBrokerSandboxClient(
    ClientBase["AsyncSandbox", AsyncBrokerTransport, Coroutine[Any, Any, "AsyncSandbox"]]
):
    """The async counterpart of :class:`BrokerSandboxClient` (upstream ``AsyncSandboxClient``'s
    method names): the same configuration, credentials (``aget_credential``), errors, retries,
    redirect and timeout rules, and cleanup of a failed or cancelled create. One
    ``httpx.AsyncClient`` is shared by the client and its sandboxes; ``await close()`` (or
    leaving ``async with``, which also deletes the sandboxes it created) closes it. Use it from
    one event loop; any number of tasks may use it at once. Constructor arguments as
    :class:`BrokerSandboxClient` (``http_transport``: an ``httpx.AsyncBaseTransport``).
    """

    def _new_transport(
        self, http_transport: httpx.AsyncBaseTransport | None
    ) -> AsyncBrokerTransport:
        return AsyncBrokerTransport(
            self.connection_config, self.auth, http_transport=http_transport
        )

    async def close(self) -> None:
        """Close the HTTP connections (sandboxes keep running)."""
        self._mark_closed()
        await self._transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.delete_all()
        finally:
            await self.close()

    async def whoami(self) -> dict[str, Any]:
        """The identity the broker verified for the current token."""
        return await self._transport.run(flow.whoami())

    async def healthz(self) -> httpx.Response:
        """``GET /v1/healthz`` without a token."""
        return await self._transport.send(proto.healthz(), authenticate=False)

    async def list_sandboxes(
        self, label_selector: Mapping[str, str] | str | None = None
    ) -> list[proto.SandboxInfo]:
        """My sandboxes as the broker reports them, newest first."""
        return await self._transport.run(flow.list_sandboxes(label_selector))

    async def get_info(self, name: str) -> proto.SandboxInfo:
        """The current state of sandbox ``name`` (no waiting)."""
        return await self._transport.run(flow.get_info(name))

    async def wait_ready(
        self, info: proto.SandboxInfo, ready_timeout: float, *, creating: bool = False
    ) -> proto.SandboxInfo:
        """Long-poll until ``info`` is Ready; raise on Failed or at the timeout."""
        request_timeout = self.connection_config.request_timeout
        op = flow.wait_ready(info, ready_timeout, request_timeout, creating=creating)
        return await self._transport.run(op)

    async def _delete(self, name: str) -> bool:
        """Delete ``name`` (to the end, even if cancelled); ``False`` if it was already gone."""
        return await self._transport.run(flow.delete(name, cleanup=True))

    async def _create(self, plan: flow.CreatePlan) -> AsyncSandbox:
        """``create_sandbox``'s I/O: a failed or cancelled create deletes the claim it made
        before the error (or ``CancelledError``) propagates."""
        from ._async_sandbox import AsyncSandbox

        info = await self._transport.run(flow.create(plan))
        return self._register(AsyncSandbox(self, info))

    async def get_sandbox(
        self, claim_name: str, namespace: str | None = None, resolve_timeout: float = 30
    ) -> AsyncSandbox:
        """Attach to one of my sandboxes by name, waiting up to ``resolve_timeout`` for Ready."""
        from ._async_sandbox import AsyncSandbox

        del namespace  # decided by the broker
        handle = self._existing(claim_name)
        if handle is None:
            info = await self.get_info(claim_name)
            handle = AsyncSandbox(self, await self.wait_ready(info, float(resolve_timeout)))
            return self._register(handle)
        await handle.refresh()
        return handle

    async def list_active_sandboxes(self) -> list[tuple[str, str]]:
        """``(namespace, name)`` of the live handles this client created or attached to."""
        return self._active()

    async def list_all_sandboxes(
        self, namespace: str | None = None, label_selector: Mapping[str, str] | str | None = None
    ) -> list[str]:
        """Names of all my sandboxes at the broker (optionally in ``namespace`` only)."""
        return [
            info.name
            for info in await self.list_sandboxes(label_selector)
            if namespace in (None, info.namespace)
        ]

    async def delete_sandbox(self, claim_name: str, namespace: str | None = None) -> None:
        """Delete a sandbox; a sandbox that is already gone is not an error."""
        del namespace
        handle = self._pop(claim_name)
        await (handle.kill() if handle is not None else self._delete(claim_name))

    async def delete_all(self) -> None:
        """Delete every sandbox this client created or attached to, concurrently. Raises the
        first error after trying all of them."""
        names = self._names_to_delete()
        outcomes = await asyncio.gather(
            *(self.delete_sandbox(name) for name in names), return_exceptions=True
        )
        failures = [(n, o) for n, o in zip(names, outcomes, strict=True) if o is not None]
        for name, failure in failures:
            logger.error("could not delete sandbox %s: %s", name, failure)
        if failures:
            raise failures[0][1]
