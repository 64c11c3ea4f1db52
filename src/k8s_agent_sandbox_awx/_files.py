"""``sandbox.files``: streamed uploads and downloads through the broker."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Generator, Iterator
from typing import IO, Any, BinaryIO, Protocol

from . import _flow as flow
from ._base import FilesBase
from ._dataplane import DownloadMeter
from ._exchange import plan_upload
from ._transport import BrokerTransport, UploadStream
from ._upstream import FileEntry

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
    """File operations in one sandbox. Returned by ``Sandbox.files``."""

    def write(
        self,
        path: str,
        content: bytes | bytearray | memoryview | str | BinaryIO,
        timeout: float | None = None,
        allow_unsafe_paths: bool = False,
    ) -> None:
        """Write ``content`` to ``path`` (relative to the sandbox root; parents are created).

        Binary file objects are streamed in chunks from their current position; the caller
        closes them. An upload is retried only if its body can be sent again (bytes, or a
        seekable file, rewound to where it started).
        """
        dest = flow.file_path(path, allow_unsafe_paths)
        spec, body = plan_upload(self._target, dest, content, timeout)
        self._transport.send(spec, body=UploadStream(body))

    def read(
        self, path: str, timeout: float | None = None, allow_unsafe_paths: bool = False
    ) -> bytes:
        """Return the bytes of the file at ``path`` (use :meth:`read_to` for large files)."""
        return self._transport.call(flow.read_file(self._target, path, timeout, allow_unsafe_paths))

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
        many bytes. ``allow_unsafe_paths`` skips the client-side path checks (as upstream; the
        runtime still confines every path to the sandbox).
        """
        src, spec = flow.download_spec(self._target, path, timeout, allow_unsafe_paths)
        meter = DownloadMeter(spec, src, max_bytes)
        if not writer_or_path(destination):
            return self._transport.download(spec, meter, destination)
        with partial_file(destination) as out:  # type: ignore[arg-type]
            return self._transport.download(spec, meter, out)

    def list(self, path: str = ".", timeout: float | None = None) -> list[FileEntry]:
        """The entries of the directory ``path`` as upstream ``FileEntry`` objects."""
        return self._transport.call(flow.list_files(self._target, path, timeout))

    def exists(self, path: str, timeout: float | None = None) -> bool:
        """Whether ``path`` exists in the sandbox (without downloading it)."""
        return self._transport.call(flow.file_exists(self._target, path, timeout))
