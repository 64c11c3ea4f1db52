"""``AsyncSandbox``: ``async with await AsyncSandbox.create() as sb: await sb.commands.run()``.

The timeout parameters keep the sync API's names and meaning (a time limit the broker and the
runtime enforce too), hence ``noqa: ASYNC109``.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Mapping
from typing import Any, BinaryIO, Self, Unpack

from . import _flow as flow
from . import _protocol as proto
from ._async_client import AsyncBrokerSandboxClient
from ._async_transport import AsyncBrokerTransport, AsyncUploadStream
from ._base import ExcType, FilesBase, SandboxBase, SandboxPart, Traceback, make_client
from ._exchange import DownloadMeter, plan_upload
from ._files import partial_file, writer_or_path
from ._upstream import ExecutionResult, FileEntry, SandboxNotFoundError

__all__ = ["AsyncCommands", "AsyncFiles", "AsyncSandbox"]

logger = logging.getLogger("k8s_agent_sandbox_awx.sandbox")

AsyncContent = bytes | bytearray | memoryview | str | BinaryIO | AsyncIterable[bytes]


class AsyncCommands(SandboxPart[AsyncBrokerTransport]):
    """Runs commands in one sandbox. Returned by ``AsyncSandbox.commands``."""

    async def run(
        self,
        command: str,
        timeout: float = 60,  # noqa: ASYNC109
        **options: Unpack[flow.RunOptions],
    ) -> ExecutionResult:
        """Async ``Sandbox.commands.run``: the same time limits, errors and results; never
        retried."""
        plan = flow.plan_command(self._router, command, timeout, options)
        return await self._transport.run(flow.run_command(self._router, plan))


def _awaiting_writer(out: Any) -> Callable[[bytes], Awaitable[Any]]:
    """``out.write`` as a coroutine function, whether ``write`` is sync or async."""

    async def write(data: bytes) -> Any:
        written = out.write(data)
        return await written if inspect.isawaitable(written) else written

    return write


class AsyncFiles(FilesBase[AsyncBrokerTransport, AsyncGenerator[bytes, None]]):
    """File operations in one sandbox. Returned by ``AsyncSandbox.files``."""

    async def write(
        self,
        path: str,
        content: AsyncContent,
        timeout: float | None = None,  # noqa: ASYNC109
        allow_unsafe_paths: bool = False,
    ) -> None:
        """Async ``Sandbox.files.write``, streamed: ``content`` is bytes, str, a binary file
        (read in a worker thread) or an async iterable of bytes (sent once, never retried)."""
        dest = flow.file_path(path, allow_unsafe_paths)
        source = content if isinstance(content, AsyncIterable) else None
        spec, body = plan_upload(self._router, dest, content, timeout, streamed=bool(source))
        await self._transport.send(spec, body=AsyncUploadStream(body, source))

    async def read(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        allow_unsafe_paths: bool = False,
    ) -> bytes:
        """The bytes of the file at ``path`` (use :meth:`read_to` or :meth:`iter_bytes` for
        large files)."""
        op = flow.read_file(self._router, path, timeout, allow_unsafe_paths)
        return await self._transport.run(op)

    async def read_to(
        self,
        path: str,
        destination: str | os.PathLike[str] | Any,
        timeout: float | None = None,  # noqa: ASYNC109
        allow_unsafe_paths: bool = False,
        max_bytes: int | None = None,
    ) -> int:
        """Async ``Sandbox.files.read_to``: stream into a local path (a temporary file renamed
        into place when complete; written from a worker thread) or a writer whose ``write`` is
        sync or async. Returns the bytes written."""
        src, spec = flow.download_spec(self._router, path, timeout, allow_unsafe_paths)
        meter = DownloadMeter(spec, src, max_bytes)
        if not writer_or_path(destination):
            return await self._transport.download(spec, meter, _awaiting_writer(destination))
        with partial_file(destination) as out:

            async def write(data: bytes) -> int:
                return await asyncio.to_thread(out.write, data)

            return await self._transport.download(spec, meter, write)

    async def list(self, path: str = ".", timeout: float | None = None) -> list[FileEntry]:  # noqa: ASYNC109
        """The entries of the directory ``path`` as upstream ``FileEntry`` objects."""
        return await self._transport.run(flow.list_files(self._router, path, timeout))

    async def exists(self, path: str, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Whether ``path`` exists in the sandbox (without downloading it)."""
        return await self._transport.run(flow.file_exists(self._router, path, timeout))


class AsyncSandbox(SandboxBase[AsyncBrokerSandboxClient, AsyncCommands, AsyncFiles]):
    """One sandbox behind the broker, for asyncio: the async counterpart of :class:`Sandbox`.

    ``await AsyncSandbox.create()`` (waits until Ready; a cancelled create deletes its claim),
    ``await AsyncSandbox.connect(name)``, ``await AsyncSandbox.list()``; ``await
    sandbox.commands.run(...)``, ``await sandbox.files.write/read/read_to/list/exists(...)``;
    ``await sandbox.kill()`` (idempotent). ``async with`` kills it on exit, also when the block
    raises or is cancelled.
    """

    def __init__(
        self,
        client: AsyncBrokerSandboxClient,
        info: proto.SandboxInfo,
        *,
        owns_client: bool = False,
    ) -> None:
        transport, router = client.transport, info.router
        parts = AsyncCommands(transport, router), AsyncFiles(transport, router)
        super().__init__(client, info, *parts, owns_client)

    async def refresh(self) -> proto.SandboxInfo:
        """Fetch the current state from the broker."""
        self._info = await self._client.get_info(self.name)
        return self._info

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
            if self._owns_client:
                await self._client.close()

    async def kill(self) -> None:
        """Delete the sandbox (to the end, even if the task is cancelled meanwhile).
        Idempotent: a sandbox that is already gone is not an error."""
        if self._killed:
            return
        client = self._client
        if self._needs_own_client_to_kill():
            client = AsyncBrokerSandboxClient(client.connection_config, auth=client.auth)
        try:
            await client._delete(self.name)
        finally:
            if client is not self._client:
                await client.close()
        logger.info("killed sandbox %s", self.name)
        if self._killed_now():
            await self._client.close()

    terminate = kill

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
        **options: Unpack[flow.SandboxCreateOptions],
    ) -> AsyncSandbox:
        """Async :meth:`Sandbox.create`: the same options, environment and guarantees; a
        cancelled create deletes the claim it made, then re-raises ``CancelledError``."""
        ready_timeout, create_options = flow.sandbox_create_args(template, options)
        client = make_client(AsyncBrokerSandboxClient, options, creating=True)
        return await cls._owning(
            client,
            lambda: client.create_sandbox(
                labels=labels, sandbox_ready_timeout=ready_timeout, **create_options
            ),
        )

    @classmethod
    async def connect(
        cls, name: str, *, ready_timeout: float = 30, **options: Unpack[flow.ConnectOptions]
    ) -> AsyncSandbox:
        """Async :meth:`Sandbox.connect`."""
        client = make_client(AsyncBrokerSandboxClient, options, named=("name", "ready_timeout"))
        return await cls._owning(
            client, lambda: client.get_sandbox(name, resolve_timeout=ready_timeout)
        )

    @classmethod
    async def list(
        cls,
        label_selector: Mapping[str, str] | str | None = None,
        **options: Unpack[flow.ConnectOptions],
    ) -> builtins.list[proto.SandboxInfo]:
        """Async :meth:`Sandbox.list`."""
        client = make_client(
            AsyncBrokerSandboxClient, options, what="list()", named=("label_selector",)
        )
        try:
            return await client.list_sandboxes(label_selector)
        finally:
            await client.close()
