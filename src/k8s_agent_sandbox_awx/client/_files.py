"""``sandbox.files``: the sandbox's files through the broker (the sync shell of ``_fsapi``)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Generator, Iterator, Sequence
from typing import IO, Any, Protocol

from ..errors import BrokerError
from ._base import FilesBase
from .core import _fsapi as fsapi
from .core._fsapi import FileInfo, WatchEvent
from .core._steps import Op
from .http._transport import BrokerTransport
from .wire._files_wire import DownloadMeter

__all__ = ["BinaryWriter", "Files", "partial_file", "writer_or_path"]


class BinaryWriter(Protocol):
    def write(self, data: bytes, /) -> Any: ...


@contextlib.contextmanager
def partial_file(destination: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """A temporary file beside ``destination``, renamed into place when the block completes:
    a failed download neither leaves a partial file nor destroys an existing one.

    The file gets the mode ``open(destination, "wb")`` would give it: a new file 0o666 minus
    the umask, an existing one keeps its permissions (never more open while being written)."""
    local = os.path.abspath(os.fspath(destination))
    if os.path.isdir(local):  # checked before the download, not by the final rename
        raise IsADirectoryError(
            errno.EISDIR,
            f"The destination {local!r} is a directory; name the file to write, e.g. "
            f"{os.path.join(local, 'out.bin')!r}",
        )
    directory, name = os.path.split(local)
    try:
        existing: int | None = stat.S_IMODE(os.stat(local).st_mode) & 0o777
    except OSError:
        existing = None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        partial = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.part")
        try:
            fd = os.open(partial, flags, 0o666 if existing is None else existing)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - 100 collisions of 32 random bits
        raise FileExistsError(f"Could not create a temporary file beside {local!r}.")
    try:
        with os.fdopen(fd, "wb") as out:
            if existing is not None:
                os.fchmod(out.fileno(), existing)  # exactly its mode, whatever the umask
            yield out
        os.replace(partial, local)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def writer_or_path(destination: Any) -> bool:
    """``True`` for a local path; ``False`` for a writer; ``TypeError`` otherwise."""
    if isinstance(destination, str | os.PathLike):
        return True
    if not callable(getattr(destination, "write", None)):
        raise TypeError("destination must be a local path or have a write(bytes) method.")
    return False


class Files(FilesBase[BrokerTransport, Generator[bytes, None, None]]):
    """File operations in one sandbox. Returned by ``Sandbox.files``.

    Paths follow the runtime's rules: relative to ``/app`` (where commands run), or absolute
    under ``/app`` or ``/workspace`` (the sandbox's persistent area); the client refuses control
    characters. A runtime without the file API (``/fs/*``) is served through its legacy
    endpoints for ``read``/``write``/``list``/``exists`` (paths in ``/app`` only); the other
    operations then raise :class:`~k8s_agent_sandbox_awx.errors.FileAPIUnsupportedError`. The
    runtime's refusals are typed errors (``errors.SandboxFileError`` and its subclasses)
    naming the path and the rule."""

    def write(
        self,
        path: str | Sequence[tuple[str, Any]],
        data: Any = None,
        timeout: float | None = None,
        allow_unsafe_paths: bool = False,
    ) -> Any:
        """Write ``data`` to ``path`` and return its :class:`FileInfo`; or ``write([(path,
        data), ...])``: each in order, a list of FileInfo.

        ``data`` is bytes, str (UTF-8), a binary file object (streamed from its current position;
        the caller closes it) or an iterator of bytes (streamed, sent once). The runtime
        replaces the file atomically and creates its parents. Retried only if the body can be
        sent again (bytes, or a seekable file, rewound to where it started).
        """
        op = self._write_op(path, data, timeout, allow_unsafe_paths, allow_async=False)
        return self._transport.run(op)

    def write_from(
        self, path: str, local_path: str | os.PathLike[str], timeout: float | None = None
    ) -> FileInfo:
        """Upload the local file ``local_path`` to ``path`` (streamed); its FileInfo."""
        with open(local_path, "rb") as source:
            info: FileInfo = self.write(path, source, timeout)
        return info

    def read(
        self,
        path: str,
        timeout: float | None = None,
        allow_unsafe_paths: bool = False,
        *,
        format: str = "bytes",
    ) -> Any:
        """The file at ``path``: ``format="bytes"`` (default), ``"text"`` (UTF-8) or
        ``"stream"`` (an iterator of chunks of up to 1 MiB, flat memory; the download starts
        with the first chunk; close it if you stop early). A file over the runtime's read limit
        (64 MiB on deployed runtimes) is read through the legacy ``/download`` when it is in
        ``/app``."""
        fmt = fsapi.read_format(format)
        op = fsapi.read(self._api, path, timeout, allow_unsafe_paths, stream=fmt == "stream")
        if fmt == "stream":
            return self._stream(op, path, None)
        return fsapi.decoded(self._transport.run(op), fmt)

    def _stream(
        self, op: Op[fsapi.Opened], src: str, max_bytes: int | None
    ) -> Generator[bytes, None, None]:
        spec, response = self._transport.run(op)
        yield from self._transport.chunks(response, DownloadMeter(spec, src, max_bytes))  # type: ignore[arg-type]

    def read_to(
        self,
        path: str,
        destination: str | os.PathLike[str] | BinaryWriter,
        timeout: float | None = None,
        allow_unsafe_paths: bool = False,
        max_bytes: int | None = None,
    ) -> int:
        """Stream the file at ``path`` into ``destination`` and return the bytes written.

        ``destination`` is a local file path (streamed to a temporary file beside it, renamed
        into place when complete; nothing is left behind if the download fails) or a binary
        writer (not closed; data written before an error stays in it). With ``max_bytes``, a
        larger file raises ``SandboxError`` (a ``RuntimeError``, as upstream) after at most that
        many bytes. ``allow_unsafe_paths`` skips the client-side path checks of the legacy
        endpoints (as upstream; the runtime still confines every path to the sandbox).
        """
        chunks = self.iter_bytes(path, timeout, allow_unsafe_paths, max_bytes)
        if not writer_or_path(destination):
            return _copy(chunks, destination)  # type: ignore[arg-type]
        with partial_file(destination) as out:  # type: ignore[arg-type]
            return _copy(chunks, out)

    def list(self, path: str = ".", timeout: float | None = None) -> list[FileInfo]:
        """The entries of the directory ``path`` (:class:`FileInfo`, sorted by name)."""
        return self._transport.run(fsapi.list_dir(self._api, path, timeout))

    def exists(self, path: str, timeout: float | None = None) -> bool:
        """Whether ``path`` exists in the sandbox (a link counts; without downloading it)."""
        return self._transport.run(fsapi.exists(self._api, path, timeout))

    def get_info(self, path: str, timeout: float | None = None) -> FileInfo:
        """The :class:`FileInfo` of ``path`` (a link is described, not followed)."""
        return self._transport.run(fsapi.get_info(self._api, path, timeout))

    def make_dir(self, path: str, timeout: float | None = None) -> bool:
        """Create the directory ``path`` and its parents; ``False`` if it already existed."""
        return self._transport.run(fsapi.make_dir(self._api, path, timeout))

    def move(
        self,
        source: str,
        destination: str,
        *,
        overwrite: bool = False,
        timeout: float | None = None,
    ) -> FileInfo:
        """Move (rename) ``source`` to ``destination`` within one root and return the moved
        entry's FileInfo; an existing destination is never replaced unless ``overwrite``."""
        return self._transport.run(fsapi.move(self._api, source, destination, overwrite, timeout))

    def rename(
        self,
        old_path: str,
        new_path: str,
        *,
        overwrite: bool = False,
        timeout: float | None = None,
    ) -> FileInfo:
        """E2B's name for :meth:`move`: ``old_path`` renamed to ``new_path`` (within one root),
        the renamed entry's FileInfo; an existing ``new_path`` is never replaced unless
        ``overwrite``."""
        return self.move(old_path, new_path, overwrite=overwrite, timeout=timeout)

    def remove(self, path: str, *, recursive: bool = False, timeout: float | None = None) -> bool:
        """Remove ``path`` (a non-empty directory needs ``recursive=True``); ``False`` if it
        did not exist."""
        return self._transport.run(fsapi.remove(self._api, path, recursive, timeout))

    def watch_dir(
        self, path: str, *, timeout: float | None = 60, recursive: bool = False
    ) -> Generator[WatchEvent, None, None]:
        """The changes in the directory ``path`` as :class:`WatchEvent`s (``created``,
        ``modified``, ``removed``), for ``timeout`` seconds (``None``: until closed), with
        ``recursive`` everything below it. Close the iterator to stop early. The watch
        reconnects every 20 s (a fresh token each time) and after a broken connection, diffing
        the runtime's new snapshot, so no change is lost in between."""
        return self._watch(fsapi.Watch(self._api, path, timeout, recursive))

    def _watch(self, watch: fsapi.Watch) -> Generator[WatchEvent, None, None]:
        while (spec := watch.next_spec()) is not None:
            try:
                with contextlib.closing(self._transport.events(spec)) as values:
                    for value in values:
                        yield from watch.feed(value)
            except BrokerError as exc:
                watch.failed(exc)


def _copy(chunks: Generator[bytes, None, None], out: BinaryWriter) -> int:
    total = 0
    with contextlib.closing(chunks):
        for chunk in chunks:
            out.write(chunk)
            total += len(chunk)
    return total
