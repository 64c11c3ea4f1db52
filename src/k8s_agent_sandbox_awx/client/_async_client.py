"""The async shell: ``AsyncBrokerSandboxClient`` and ``AsyncSandbox``
(``async with await AsyncSandbox.create() as sb: await sb.commands.run()``).

The same operations, requests and rules as the sync shell (``_client``), performed with
``await``. The timeout parameters keep the sync API's names and meaning (a time limit the broker
and the runtime enforce too), hence ``noqa: ASYNC109``.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import (
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from typing import Any, Literal, NoReturn, Self, Unpack, overload

import httpx

from .._upstream import ExecutionResult, SandboxNotFoundError
from ._async_code import AsyncCode, AsyncRunsCode
from ._async_commands import AsyncCommandHandle, AsyncCommands
from ._async_files import AsyncFiles
from ._async_ports import AsyncPorts
from ._async_pty import AsyncPty
from ._base import (
    ClassOrInstanceMethod,
    ClientBase,
    ConnectOptions,
    ExcType,
    SandboxBase,
    SandboxCreateOptions,
    Traceback,
    create_spec,
    data_target,
    kill_name,
    make_client,
    timeout_seconds,
)
from ._deleted import mark_deleted
from .core import _flow as flow
from .core import _options as opts
from .http._async_transport import AsyncBrokerTransport
from .wire import _dialects as dialects
from .wire import _protocol as proto
from .wire._dialect import Dialect, Lifetime

__all__ = [
    "AsyncBrokerSandboxClient",
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncUpstreamSandbox",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")


class AsyncBrokerSandboxClient(ClientBase["AsyncSandbox", AsyncBrokerTransport]):
    """The async counterpart of :class:`BrokerSandboxClient` (upstream ``AsyncSandboxClient``'s
    method names): the same configuration, credentials (``aget_credential``), errors, retries,
    redirect and timeout rules, and cleanup of a failed or cancelled create. Its connections
    are the running loop's shared pool for its settings (``http/_async_pool``); ``await
    close()`` (or leaving ``async with``, which also deletes the sandboxes it created) closes its
    own open answers and stops using the pool. Any number of tasks of a loop may use it at
    once. Constructor arguments as :class:`BrokerSandboxClient` (``http_transport``: an
    ``httpx.AsyncBaseTransport``).
    """

    def _new_transport(
        self, http_transport: httpx.AsyncBaseTransport | None
    ) -> AsyncBrokerTransport:
        return AsyncBrokerTransport(
            self.connection_config, self.auth, self._speaking, http_transport=http_transport
        )

    async def _use_dialect(self, *, authenticated: bool = True) -> Dialect:
        """The dialect, found out from the broker first if it is not known yet; an
        ``authenticated`` operation fetches its credential first (see the sync client)."""
        if self._speaking.known is not None:
            return self._speaking.known
        if authenticated:
            audience = self.connection_config.audience
            self._transport.prime(await self.auth.aget_credential(audience))
        url = self.broker_url
        seen = dialects.probes_answered(url)
        lock = dialects.probe_lock(url, asyncio.get_running_loop(), asyncio.Lock)
        async with lock:  # other tasks of this loop wait, then take its answer
            return await self._transport.run(self._speaking.resolve(seen))

    async def close(self) -> None:
        """Close the HTTP connections (sandboxes keep running)."""
        self._mark_closed()
        for handle in self._live_handles():
            await handle._commands._stop_output()  # the tasks that follow output use them
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
        return await self._transport.call((await self._use_dialect()).whoami())

    async def healthz(self) -> proto.BrokerReply:
        """The broker's health check, without a token."""
        spec = (await self._use_dialect(authenticated=False)).healthz().spec
        reply = await self._transport.send(spec, authenticate=False)
        return proto.BrokerReply(reply.status_code, dict(reply.headers), reply.content)

    async def list_sandboxes(
        self, label_selector: Mapping[str, str] | str | None = None
    ) -> list[proto.SandboxInfo]:
        """My sandboxes as the broker reports them, newest first."""
        proto.selector_text(label_selector)  # checked before anything is sent
        call = (await self._use_dialect()).list_sandboxes(label_selector)
        return await self._transport.call(call)

    async def get_info(self, name: str) -> proto.SandboxInfo:
        """The current state of sandbox ``name`` (no waiting)."""
        return await self._transport.call((await self._use_dialect()).get(name))

    async def wait_ready(
        self, info: proto.SandboxInfo, ready_timeout: float, *, creating: bool = False
    ) -> proto.SandboxInfo:
        """Long-poll until ``info`` is Ready; raise on Failed or at the timeout."""
        config = self.connection_config
        op = flow.wait_ready(
            await self._use_dialect(),
            info,
            ready_timeout,
            config.request_timeout,
            creating=creating,
            poll_interval=config.poll_interval,
        )
        return await self._transport.run(op)

    async def delete(self, name: str) -> bool:
        """Delete sandbox ``name`` at the broker (to the end, even if cancelled); ``False`` if it
        was already gone."""
        call = (await self._use_dialect()).delete(name)
        return await self._transport.call(flow.cleanup(call))

    async def extend(self, name: str, seconds: int) -> Lifetime:
        """Move sandbox ``name``'s deadline to now + ``seconds`` (see the sync client)."""
        dialect = await self._use_dialect()
        return await self._transport.call(dialect.extend(name, timeout_seconds(seconds)))

    async def create_sandbox(
        self,
        warmpool: str | None = None,
        namespace: str | None = None,
        sandbox_ready_timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
        **options: Unpack[opts.UpstreamCreateOptions],
    ) -> AsyncSandbox:
        """``BrokerSandboxClient.create_sandbox``, awaited: a cancelled create deletes the
        claim it made before ``CancelledError`` propagates."""
        spec = flow.spec_from_upstream(warmpool, namespace, sandbox_ready_timeout, labels, options)
        return await self._create(spec, upstream=True)

    def _handle(
        self, info: proto.SandboxInfo, *, upstream: bool, keepalive: int | None = None
    ) -> AsyncSandbox:
        return (AsyncUpstreamSandbox if upstream else AsyncSandbox)(self, info, keepalive=keepalive)

    async def _create(self, spec: flow.SandboxSpec, *, upstream: bool) -> AsyncSandbox:
        """``create_sandbox``'s I/O: a failed or cancelled create deletes the claim it made
        before the error (or ``CancelledError``) propagates."""
        plan = flow.plan_create(self.connection_config, await self._use_dialect(), spec)
        info = await self._transport.run(flow.create(plan))
        return self._register(self._handle(info, upstream=upstream, keepalive=plan.keepalive))

    async def _attach(self, name: str, ready_timeout: float, *, upstream: bool) -> AsyncSandbox:
        handle = self._existing(name)
        if handle is None:
            info = await self.get_info(name)
            ready = await self.wait_ready(info, float(ready_timeout))
            return self._register(self._handle(ready, upstream=upstream))
        await handle.refresh()
        return handle

    async def get_sandbox(
        self, claim_name: str, namespace: str | None = None, resolve_timeout: float = 30
    ) -> AsyncSandbox:
        """Attach to one of my sandboxes by name, waiting up to ``resolve_timeout`` for Ready."""
        del namespace  # decided by the broker
        return await self._attach(claim_name, resolve_timeout, upstream=True)

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
        await (handle.kill() if handle is not None else self.delete(claim_name))

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


async def _kill_named(
    cls: type[AsyncSandbox], name: str | AsyncSandbox, **options: Unpack[ConnectOptions]
) -> bool:
    """``await AsyncSandbox.kill(name)``: delete sandbox ``name`` without a handle (see
    ``Sandbox.kill``)."""
    if isinstance(name, AsyncSandbox):
        return await name.kill()
    target = kill_name(cls, name)
    client = make_client(AsyncBrokerSandboxClient, options, what="kill()", named=("name",))
    mark_deleted(target)  # this process's readers of it end quietly (issue 30)
    try:
        return await client.delete(target)
    finally:
        await client.close()


class AsyncSandbox(SandboxBase[AsyncBrokerSandboxClient, AsyncCommands, AsyncFiles], AsyncRunsCode):
    """One sandbox behind the broker, for asyncio: the async counterpart of :class:`Sandbox`.

    ``await AsyncSandbox.create()`` (waits until Ready; a cancelled create deletes its claim),
    ``await AsyncSandbox.connect(name)``, ``await AsyncSandbox.list()``; ``await
    sandbox.commands.run(...)``, ``await sandbox.files.write/read/read_to/list/exists(...)``;
    ``await sandbox.kill()`` (idempotent). ``async with`` kills it on exit, also when the block
    raises or is cancelled.
    """

    _commands_class: type[AsyncCommands] = AsyncCommands

    def __init__(
        self,
        client: AsyncBrokerSandboxClient,
        info: proto.SandboxInfo,
        *,
        owns_client: bool = False,
        keepalive: int | None = None,
    ) -> None:
        target = data_target(client, info, keepalive)
        transport = client._transport.to(target)  # extends a kept-alive sandbox when due
        parts = self._commands_class(transport, target), AsyncFiles(transport, target)
        super().__init__(client, info, target, *parts, owns_client)
        self._pty = AsyncPty(transport, target)
        self._code = AsyncCode(transport, target)

    @property
    def pty(self) -> AsyncPty:
        """Terminals in the sandbox: ``await sandbox.pty.create(cols, rows)`` → an
        ``AsyncPtyHandle``."""
        self._check_active()
        return self._pty

    @property
    def ports(self) -> AsyncPorts:
        """The sandbox's own servers on its ports, through the broker: ``client(port)``,
        ``url(port, path)``, ``forward(port)`` and ``get_host(port)`` (docs/client.md,
        "Ports")."""
        self._check_active()
        return AsyncPorts(self)

    def get_host(self, port: int) -> NoReturn:
        """E2B's ``sandbox.get_host(port)``: as ``sandbox.ports.get_host``, it always raises
        :class:`~..errors.UnsupportedOperationError` naming what to use instead (a port is
        reached through the broker: ``ports.forward``, ``ports.client``, ``ports.url``)."""
        self.ports.get_host(port)

    async def refresh(self) -> proto.SandboxInfo:
        """Fetch the current state from the broker."""
        self._info = await self._client.get_info(self.name)
        return self._info

    async def get_info(self) -> proto.SandboxInfo:
        """Async :meth:`Sandbox.get_info` (with ``started_at`` and ``expires_at``)."""
        return await self.refresh()

    async def is_running(self) -> bool:
        """Whether the sandbox exists and is Ready."""
        if self._killed:
            return False
        try:
            return self._running(await self.refresh())
        except SandboxNotFoundError:
            return False

    async def set_timeout(self, seconds: float) -> proto.SandboxInfo:
        """Async :meth:`Sandbox.set_timeout`: the broker deletes the sandbox ``seconds`` from
        now."""
        self._check_active()
        return self._extended(await self._client.extend(self.name, timeout_seconds(seconds)))

    async def status(self) -> tuple[str, str]:
        """Upstream-style ``(status, message)``."""
        try:
            info: proto.SandboxInfo | None = await self.refresh()
        except SandboxNotFoundError:
            info = None
        return self._status_of(info, self.name)

    async def close_connection(self) -> None:
        """Stop using this handle; the sandbox keeps running (reattach with connect)."""
        if not self._closed:
            self._closed = True
            await self._commands._stop_output()  # their commands go on; reattach with connect
            if self._owns_client:
                await self._client.close()

    async def _kill_handle(self) -> bool:
        """Delete the sandbox (to the end, even if the task is cancelled meanwhile).
        Idempotent: ``True`` if this call deleted it, ``False`` if it was already gone. Called
        on the class, ``await AsyncSandbox.kill(name, **options)`` deletes sandbox ``name``
        (E2B's spelling; see :meth:`Sandbox.kill`)."""
        if self._killed:
            return False
        halted = self._commands._halt_output()  # no task follows output past the sandbox
        client = self._client
        if self._needs_own_client_to_kill():
            client = AsyncBrokerSandboxClient(client.connection_config, auth=client.auth)
        try:
            deleted = await client.delete(self.name)
        finally:
            if client is not self._client:
                await client.close()
        await self._commands._join_output(halted)
        logger.info("killed sandbox %s", self.name)
        if self._killed_now():
            await self._client.close()
        return deleted

    kill = ClassOrInstanceMethod(_kill_handle, _kill_named)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: ExcType, exc: BaseException | None, tb: Traceback) -> None:
        try:
            await self.kill()
        except Exception as kill_error:
            if exc is None:
                raise
            logger.error("could not kill sandbox %s: %s", self.name, kill_error)
            self._exit_note(exc, kill_error)

    @staticmethod
    async def _owning(
        client: AsyncBrokerSandboxClient, start: Callable[[], Awaitable[AsyncSandbox]]
    ) -> AsyncSandbox:
        """The handle ``start()`` returns, owning ``client`` (closed if ``start`` fails)."""
        try:
            sandbox = await start()
        except BaseException:
            await client.close()
            raise
        sandbox._owns_client = True
        return sandbox

    @classmethod
    async def create(
        cls,
        template: str | None = None,
        labels: Mapping[str, str] | None = None,
        **options: Unpack[SandboxCreateOptions],
    ) -> AsyncSandbox:
        """Async :meth:`Sandbox.create`: the same options, environment and guarantees; a
        cancelled create deletes the claim it made, then re-raises ``CancelledError``."""
        spec = create_spec(template, labels, options)
        client = make_client(AsyncBrokerSandboxClient, options, creating=True)
        return await cls._owning(client, lambda: client._create(spec, upstream=False))

    @classmethod
    async def connect(
        cls, name: str, *, ready_timeout: float = 30, **options: Unpack[ConnectOptions]
    ) -> AsyncSandbox:
        """Async :meth:`Sandbox.connect`."""
        client = make_client(AsyncBrokerSandboxClient, options)
        return await cls._owning(
            client, lambda: client._attach(name, ready_timeout, upstream=False)
        )

    @classmethod
    async def list(
        cls,
        label_selector: Mapping[str, str] | str | None = None,
        **options: Unpack[ConnectOptions],
    ) -> builtins.list[proto.SandboxInfo]:
        """Async :meth:`Sandbox.list`."""
        client = make_client(AsyncBrokerSandboxClient, options)
        try:
            return await client.list_sandboxes(label_selector)
        finally:
            await client.close()


# --------------------------------------------------------------------------------------------
# Upstream's spellings, only on the handles AsyncBrokerSandboxClient returns


class AsyncUpstreamCommands(AsyncCommands):
    """``commands`` of a handle from ``AsyncBrokerSandboxClient``: upstream's
    ``command_timeout`` and ``env`` too (see ``UpstreamCommands``)."""

    @overload
    async def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,  # noqa: ASYNC109
        command_timeout: float | None = None,
        *,
        background: Literal[True],
        **options: Unpack[opts.RunOptions],
    ) -> AsyncCommandHandle: ...

    @overload
    async def run(
        self,
        command: str | Sequence[str],
        timeout: float = 60,  # noqa: ASYNC109
        command_timeout: float | None = None,
        *,
        background: Literal[False] = False,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult: ...

    @overload
    async def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,  # noqa: ASYNC109
        command_timeout: float | None = None,
        *,
        background: bool,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | AsyncCommandHandle: ...

    async def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,  # noqa: ASYNC109
        command_timeout: float | None = None,
        *,
        background: bool = False,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | AsyncCommandHandle:
        limit = opts.upstream_timeout(timeout, command_timeout)
        return await super().run(command, limit, background=background, **options)


class AsyncUpstreamSandbox(AsyncSandbox):
    """The handle ``AsyncBrokerSandboxClient`` returns: an :class:`AsyncSandbox` with upstream
    ``AsyncSandbox``'s spellings too (``claim_name``, ``await terminate()``,
    ``command_timeout=``)."""

    _commands_class = AsyncUpstreamCommands

    @property
    def claim_name(self) -> str:
        return self.name

    async def terminate(self) -> None:
        await self.kill()
