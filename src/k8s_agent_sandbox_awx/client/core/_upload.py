"""Streamed upload bodies, without I/O: what ``files.write`` sends and whether it can be sent
again.

A body is multipart framing (``_multipart.multipart_framing``, the one framing: the legacy
``/upload``'s single ``file`` part, or ``/fs/write``'s ``path`` field then ``file`` part) around
the content, which is bytes, a binary reader (``read(n)``), an iterator of bytes or (async
client only) an async iterable of bytes. The transports turn an :class:`UploadBody` into their
httpx stream, chunk by chunk (flat memory); only bytes and seekable files are replayable, so
only they are retried.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import AsyncIterable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ...errors import BrokerError
from ..wire import _protocol as proto
from ..wire._multipart import Multipart

__all__ = [
    "CHUNK_SIZE",
    "UploadBody",
    "finish_spec",
    "plan_body",
]

CHUNK_SIZE = 1024 * 1024

Kind = Literal["bytes", "reader", "iter", "aiter"]


def _classify(content: Any, *, allow_async: bool) -> tuple[Kind, Any]:
    """``(kind, content)``: what the content is and its form to send."""
    if isinstance(content, str):
        return "bytes", content.encode("utf-8")
    if isinstance(content, bytes | bytearray | memoryview):
        return "bytes", bytes(content)
    if isinstance(content, io.TextIOBase):
        raise TypeError("File content must be opened in binary mode ('rb'), not text mode.")
    if callable(getattr(content, "read", None)):
        return "reader", content
    if isinstance(content, AsyncIterable):
        if not allow_async:
            raise TypeError(
                "An async iterable can only be written with the async client (AsyncSandbox); "
                "pass bytes, str, a binary file or an iterator of bytes."
            )
        return "aiter", content
    if isinstance(content, Iterable):
        return "iter", content
    raise TypeError(
        "File content must be bytes, str, a binary file object, an iterator of bytes or (async "
        f"client only) an async iterable of bytes, got {type(content).__name__}."
    )


def _start_and_size(content: Any) -> tuple[int | None, int | None]:
    """(start position, remaining size) of a seekable file; (None, None) otherwise."""
    try:
        if not content.seekable():
            return None, None
        start = content.tell()
        end = content.seek(0, io.SEEK_END)
        content.seek(start)
        return int(start), int(end - start)
    except (AttributeError, OSError, ValueError):
        return None, None


@dataclass
class UploadBody:
    """The streamed multipart body of one upload: framing + the content in chunks, never all
    at once (``kind``: bytes, a reader, an iterator or an async iterable of bytes)."""

    framing: Multipart
    content: Any
    kind: Kind
    start: int | None
    size: int | None
    """Declared in Content-Length: exactly this many content bytes are sent (``None``: chunked)."""
    replayable: bool = False
    _consumed: bool = False
    _remaining: int | None = None
    _done: bool = False

    def begin(self) -> None:
        """Start (again): refuse a consumed one-shot stream, rewind a seekable file."""
        if self._consumed and not self.replayable:
            raise BrokerError(
                "The upload stream was consumed and cannot be sent again; pass bytes or a "
                "seekable file to allow a retry."
            )
        self._consumed = True
        self._remaining = self.size
        self._done = self.kind != "reader"
        if self.start is not None:
            self.content.seek(self.start)

    def byte_chunks(self) -> Iterator[bytes]:
        """The content of a ``bytes`` body in chunks."""
        view = memoryview(self.content if self.kind == "bytes" else b"")
        for offset in range(0, len(view), CHUNK_SIZE):
            yield bytes(view[offset : offset + CHUNK_SIZE])

    def want(self) -> int:
        """How many bytes to read next from a reader; 0 when done."""
        if self._done:
            return 0
        return CHUNK_SIZE if self._remaining is None else min(CHUNK_SIZE, self._remaining)

    def accept(self, chunk: Any) -> bytes:
        """Check a chunk read from the content; an empty chunk from a reader ends it."""
        if not isinstance(chunk, bytes | bytearray | memoryview):
            raise TypeError(
                "File content must yield bytes (open files 'rb'; an iterator must yield bytes), "
                f"got {type(chunk).__name__}."
            )
        if not chunk:
            if self.kind == "reader":
                self._done = True
                if self._remaining:
                    raise ValueError(
                        f"The file shrank by {self._remaining} bytes while it was uploaded; "
                        "upload a file that does not change during the upload."
                    )
            return b""
        if self._remaining is not None:
            self._remaining -= len(chunk)
            self._done = self._remaining <= 0
        return bytes(chunk)


def plan_body(framing: Multipart, content: Any, *, allow_async: bool = False) -> UploadBody:
    """The body of one upload of ``content`` inside ``framing``."""
    kind, body = _classify(content, allow_async=allow_async)
    start: int | None = None
    size: int | None = None
    if kind == "bytes":
        size = len(body)
    elif kind == "reader":
        start, size = _start_and_size(body)
    upload = UploadBody(framing, body, kind, start, size)
    upload.replayable = kind == "bytes" or start is not None
    return upload


def finish_spec(
    spec: proto.RequestSpec, body: UploadBody, timeout: float | None
) -> proto.RequestSpec:
    """``spec`` with the body's headers (its type and length, or chunked: the framing's
    :meth:`~.Multipart.headers`, the one place they are decided), retryable only if the body
    is replayable."""
    return dataclasses.replace(
        spec,
        headers={**spec.headers, **body.framing.headers(body.size)},
        read_timeout=spec.read_timeout if timeout is None else float(timeout),
        retryable=body.replayable,
    )
