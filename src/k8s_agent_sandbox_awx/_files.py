"""``sandbox.files``: streamed uploads and downloads through the broker."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any, BinaryIO, Protocol

import httpx

from . import _protocol as proto
from ._exceptions import BrokerError, BrokerUnavailableError, RequestTimeoutError
from ._transport import BrokerTransport, ReplayableStream
from ._upstream import FileEntry, SandboxError

__all__ = ["Files"]

logger = logging.getLogger("k8s_agent_sandbox_awx.files")

CHUNK_SIZE = 1024 * 1024


def _path(path: str, allow_unsafe_paths: bool) -> str:
    if allow_unsafe_paths:
        if not isinstance(path, str) or not path:
            raise ValueError("The sandbox path is empty; name a file relative to the sandbox root.")
        return path.lstrip("/") or "."
    return proto.validate_sandbox_path(path)


class BinaryWriter(Protocol):
    def write(self, data: bytes, /) -> Any: ...


def _check_binary_reader(content: Any) -> None:
    if isinstance(content, io.TextIOBase):
        raise TypeError("File content must be opened in binary mode ('rb'), not text mode.")
    if not callable(getattr(content, "read", None)):
        raise TypeError(
            f"File content must be bytes, str or a binary file object, got "
            f"{type(content).__name__}."
        )


def _start_and_size(content: IO[bytes]) -> tuple[int | None, int | None]:
    """(start position, remaining size) of a seekable file; (None, None) otherwise."""
    try:
        if not content.seekable():
            return None, None
        start = content.tell()
        end = content.seek(0, io.SEEK_END)
        content.seek(start)
        return start, end - start
    except (AttributeError, OSError, ValueError):
        return None, None


class _MultipartStream(ReplayableStream):
    """The streamed multipart body: framing + the content read in chunks, never all at once."""

    def __init__(
        self,
        framing: proto.Multipart,
        content: bytes | BinaryIO,
        start: int | None,
        size: int | None = None,
    ) -> None:
        self._framing = framing
        self._content = content
        self._start = start
        self._size = size  # declared in Content-Length: exactly this many bytes are sent
        self._consumed = False
        self.replayable = isinstance(content, bytes) or start is not None

    def __iter__(self) -> Iterator[bytes]:
        if self._consumed and not self.replayable:
            raise httpx.StreamConsumed()
        self._consumed = True
        yield self._framing.prefix
        if isinstance(self._content, bytes):
            view = memoryview(self._content)
            for offset in range(0, len(view), CHUNK_SIZE):
                yield bytes(view[offset : offset + CHUNK_SIZE])
        else:
            if self._start is not None:
                self._content.seek(self._start)
            remaining = self._size
            while remaining is None or remaining > 0:
                want = CHUNK_SIZE if remaining is None else min(CHUNK_SIZE, remaining)
                chunk = self._content.read(want)
                if not chunk:
                    break
                if not isinstance(chunk, bytes | bytearray | memoryview):
                    raise TypeError("The file object's read() must return bytes (open it 'rb').")
                if remaining is not None:
                    remaining -= len(chunk)
                yield bytes(chunk)
            if remaining:
                raise ValueError(
                    f"The file shrank by {remaining} bytes while it was uploaded; upload a file "
                    "that does not change during the upload."
                )
        yield self._framing.suffix


class Files:
    """File operations in one sandbox. Returned by ``Sandbox.files``."""

    def __init__(self, transport: BrokerTransport, router: proto.RouterTarget) -> None:
        self._transport = transport
        self._router = router

    def _spec(self, spec: proto.RequestSpec, timeout: float | None) -> proto.RequestSpec:
        if timeout is not None:
            spec.read_timeout = float(timeout)
        return spec

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
        dest = _path(path, allow_unsafe_paths)
        body: bytes | BinaryIO
        if isinstance(content, str):
            body = content.encode("utf-8")
        elif isinstance(content, bytearray | memoryview):
            body = bytes(content)
        elif isinstance(content, bytes):
            body = content
        else:
            _check_binary_reader(content)
            body = content
        framing = proto.multipart_framing(dest)
        spec = self._spec(proto.upload(self._router, dest, framing), timeout)
        if isinstance(body, bytes):
            start: int | None = None
            size: int | None = len(body)
        else:
            start, size = _start_and_size(body)
        if size is not None:
            spec.headers["Content-Length"] = str(framing.length(size))
        else:
            spec.headers["Transfer-Encoding"] = "chunked"
        stream = _MultipartStream(framing, body, start, size)
        spec.retryable = stream.replayable
        first = True

        def make_body() -> httpx.SyncByteStream:
            nonlocal first
            if not first and not stream.replayable:
                raise BrokerError(
                    f"Could not write {dest!r}: the upload stream was consumed and cannot be "
                    "sent again; pass bytes or a seekable file to allow a retry."
                )
            first = False
            return stream

        self._transport.send(spec, body=make_body)
        logger.debug("wrote %s to sandbox %s", dest, self._router.sandbox_id)

    def read(
        self, path: str, timeout: float | None = None, allow_unsafe_paths: bool = False
    ) -> bytes:
        """Return the bytes of the file at ``path`` (use :meth:`read_to` for large files)."""
        src = _path(path, allow_unsafe_paths)
        spec = self._spec(proto.download(self._router, src), timeout)
        return self._transport.send(spec).content

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
        src = _path(path, allow_unsafe_paths)
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}.")
        if isinstance(destination, str | os.PathLike):
            local = os.path.abspath(os.fspath(destination))
            # Written next to the destination and renamed into place when complete: a failed
            # download neither leaves a partial file nor destroys an existing one.
            fd, partial = tempfile.mkstemp(
                prefix=f".{os.path.basename(local)}.", suffix=".part", dir=os.path.dirname(local)
            )
            try:
                with os.fdopen(fd, "wb") as out:
                    total = self._download(src, out, timeout, max_bytes)
                os.replace(partial, local)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(partial)
                raise
            return total
        if not callable(getattr(destination, "write", None)):
            raise TypeError("destination must be a local path or have a write(bytes) method.")
        return self._download(src, destination, timeout, max_bytes)

    def _download(
        self, src: str, out: BinaryWriter, timeout: float | None, max_bytes: int | None
    ) -> int:
        spec = self._spec(proto.download(self._router, src), timeout)
        response = self._transport.send(spec, stream=True)
        total = 0
        try:
            for chunk in response.iter_bytes(CHUNK_SIZE):
                if max_bytes is not None and total + len(chunk) > max_bytes:
                    raise SandboxError(
                        f"The file {src!r} is larger than max_bytes={max_bytes}; raise the limit."
                    )
                out.write(chunk)
                total += len(chunk)
        except httpx.TimeoutException as exc:
            raise RequestTimeoutError(
                f"Could not read {src!r}: the download stalled after {total} bytes. Retry, or "
                "pass a larger timeout=.",
                method=spec.method,
                path=spec.path,
            ) from exc
        except httpx.TransportError as exc:
            raise BrokerUnavailableError(
                f"Could not read {src!r}: the connection broke after {total} bytes "
                f"({type(exc).__name__}). Retry the download.",
                method=spec.method,
                path=spec.path,
            ) from exc
        finally:
            response.close()
        return total

    def list(self, path: str = ".", timeout: float | None = None) -> list[FileEntry]:
        """The entries of the directory ``path`` as upstream ``FileEntry`` objects."""
        src = proto.validate_sandbox_path(path, allow_root=True)
        spec = self._spec(proto.list_files(self._router, src), timeout)
        response = self._transport.send(spec)
        return proto.parse_file_entries(proto.parse_json(response.content, spec.what), src)

    def exists(self, path: str, timeout: float | None = None) -> bool:
        """Whether ``path`` exists in the sandbox (without downloading it)."""
        src = proto.validate_sandbox_path(path, allow_root=True)
        spec = self._spec(proto.exists(self._router, src), timeout)
        response = self._transport.send(spec)
        return proto.parse_exists(proto.parse_json(response.content, spec.what), src)
