"""The async files shell: ``AsyncSandbox.files`` (the operations of ``Sandbox.files``,
``_files``, awaited)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from ..errors import BrokerError
from ._base import FilesBase
from ._files import partial_file, writer_or_path
from .core import _fsapi as fsapi
from .core._fsapi import FileInfo, WatchEvent
from .core._steps import Op
from .http._async_transport import AsyncBrokerTransport
from .wire._files_wire import DownloadMeter

__all__ = ["AsyncFiles"]


def _awaiting_writer(out: Any) -> Callable[[bytes], Awaitable[Any]]:
    """``out.write`` as a coroutine function, whether ``write`` is sync or async."""

    async def write(data: bytes) -> Any:
        written = out.write(data)
        return await written if inspect.isawaitable(written) else written

    return write


class AsyncFiles(FilesBase[AsyncBrokerTransport, AsyncGenerator[bytes, None]]):
    """File operations in one sandbox. Returned by ``AsyncSandbox.files``: the operations,
    names, rules and errors of ``Sandbox.files``, awaited."""

    async def write(
        self,
        path: str | Sequence[tuple[str, Any]],
        data: Any = None,
        timeout: float | None = None,  # noqa: ASYNC109
        allow_unsafe_paths: bool = False,
    ) -> Any:
        """Async ``Sandbox.files.write`` (also the batch form), streamed: ``data`` is bytes,
        str, a binary file (read in a worker thread), an iterator or an async iterable of bytes
        (sent once, never retried)."""
        op = self._write_op(path, data, timeout, allow_unsafe_paths, allow_async=True)
        return await self._transport.run(op)

    async def write_from(
        self,
        path: str,
        local_path: str | os.PathLike[str],
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> FileInfo:
        """Upload the local file ``local_path`` to ``path`` (read in a worker thread)."""
        with open(local_path, "rb") as source:  # noqa: ASYNC230 - read in a worker thread
            info: FileInfo = await self.write(path, source, timeout)
        return info

    async def read(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        allow_unsafe_paths: bool = False,
        *,
        format: str = "bytes",
    ) -> Any:
        """Async ``Sandbox.files.read``; ``format="stream"`` gives an async iterator of
        chunks (``async for``; ``contextlib.aclosing`` to stop early)."""
        fmt = fsapi.read_format(format)
        op = fsapi.read(self._api, path, timeout, allow_unsafe_paths, stream=fmt == "stream")
        if fmt == "stream":
            return self._stream(op, path, None)
        return fsapi.decoded(await self._transport.run(op), fmt)

    async def _stream(
        self, op: Op[fsapi.Opened], src: str, max_bytes: int | None
    ) -> AsyncGenerator[bytes, None]:
        spec, response = await self._transport.run(op)
        meter = DownloadMeter(spec, src, max_bytes)
        async with contextlib.aclosing(self._transport.chunks(response, meter)) as chunks:  # type: ignore[arg-type]
            async for chunk in chunks:
                yield chunk

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
        chunks = self.iter_bytes(path, timeout, allow_unsafe_paths, max_bytes)
        if not writer_or_path(destination):
            return await _acopy(chunks, _awaiting_writer(destination))
        with partial_file(destination) as out:

            async def write(data: bytes) -> int:
                return await asyncio.to_thread(out.write, data)

            return await _acopy(chunks, write)

    async def list(self, path: str = ".", timeout: float | None = None) -> builtins.list[FileInfo]:  # noqa: ASYNC109
        """The entries of the directory ``path`` (:class:`FileInfo`, sorted by name)."""
        return await self._transport.run(fsapi.list_dir(self._api, path, timeout))

    async def exists(self, path: str, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Whether ``path`` exists in the sandbox."""
        return await self._transport.run(fsapi.exists(self._api, path, timeout))

    async def get_info(self, path: str, timeout: float | None = None) -> FileInfo:  # noqa: ASYNC109
        """The :class:`FileInfo` of ``path``."""
        return await self._transport.run(fsapi.get_info(self._api, path, timeout))

    async def make_dir(self, path: str, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Create the directory ``path`` and its parents; ``False`` if it already existed."""
        return await self._transport.run(fsapi.make_dir(self._api, path, timeout))

    async def move(
        self,
        source: str,
        destination: str,
        *,
        overwrite: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> FileInfo:
        """Async ``Sandbox.files.move`` (never replaces unless ``overwrite``)."""
        op = fsapi.move(self._api, source, destination, overwrite, timeout)
        return await self._transport.run(op)

    async def rename(
        self,
        old_path: str,
        new_path: str,
        *,
        overwrite: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> FileInfo:
        """E2B's name for :meth:`move` (see ``Sandbox.files.rename``)."""
        return await self.move(old_path, new_path, overwrite=overwrite, timeout=timeout)

    async def remove(
        self,
        path: str,
        *,
        recursive: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> bool:
        """Remove ``path``; ``False`` if it did not exist."""
        return await self._transport.run(fsapi.remove(self._api, path, recursive, timeout))

    def watch_dir(
        self,
        path: str,
        *,
        timeout: float | None = 60,
        recursive: bool = False,
    ) -> AsyncGenerator[WatchEvent, None]:
        """Async ``Sandbox.files.watch_dir``: ``async for event in files.watch_dir(...)``
        (``contextlib.aclosing`` to stop early)."""
        return self._watch(fsapi.Watch(self._api, path, timeout, recursive))

    async def _watch(self, watch: fsapi.Watch) -> AsyncGenerator[WatchEvent, None]:
        while (spec := watch.next_spec()) is not None:
            try:
                async with contextlib.aclosing(self._transport.events(spec)) as values:
                    async for value in values:
                        for event in watch.feed(value):
                            yield event
            except BrokerError as exc:
                watch.failed(exc)


async def _acopy(
    chunks: AsyncGenerator[bytes, None], write: Callable[[bytes], Awaitable[Any]]
) -> int:
    total = 0
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            await write(chunk)
            total += len(chunk)
    return total
