"""The runtime's one ``multipart/form-data`` reader: a body streamed, part by part, to a form.

``POST /upload`` (legacy) and ``POST /fs/write`` take multipart bodies of any size. The parsing
is python-multipart's (imported on the first upload; the fork server imports it ahead for its
children); this module turns its callbacks into one call per part on a :class:`Form`:
``begin`` with the part's ``Content-Disposition`` parameters, ``data`` as its bytes arrive
(never held in memory), ``end``. The first failure stops the parsing; the rest of the body is
read and dropped, so that the client gets the answer, not a connection reset.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

E = TypeVar("E", bound=Exception)


class Form(Protocol):
    """Where the parts of one body go."""

    def begin(self, disposition: dict[bytes, bytes]) -> None:
        """A part starts: its ``Content-Disposition`` parameters (``name``, ``filename``)."""
        ...

    def data(self, data: memoryview) -> None:
        """Bytes of the current part, as they arrive (a view of the chunk being parsed: used
        at once, never kept)."""
        ...

    def end(self) -> None:
        """The current part ended."""
        ...


class PartFile:
    """Where a file part's bytes go: a new temporary file (``prefix`` + 16 hex digits) in the
    directory open at ``parent`` (the caller's), never through a link, renamed over its
    destination at the part's end (:meth:`commit`), so that the destination is the old file or
    the whole new one, never half of it; :meth:`discard` removes it when it was not committed.
    ``OSError`` as ``os.open`` raises it (``FileNotFoundError``: the directory is gone)."""

    def __init__(self, parent: int, prefix: str, mode: int) -> None:
        self.parent = parent
        self.name: str | None = f"{prefix}{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.out: int | None = os.open(self.name, flags, mode, dir_fd=parent)
        self.size = 0

    def write(self, data: memoryview) -> None:
        assert self.out is not None
        self.size += len(data)
        while data:
            data = data[os.write(self.out, data) :]

    def commit(self, destination: str) -> None:
        """Close it and rename it over ``destination`` (a name in the same directory)."""
        assert self.out is not None and self.name is not None
        os.close(self.out)
        self.out = None
        os.rename(self.name, destination, src_dir_fd=self.parent, dst_dir_fd=self.parent)
        self.name = None

    def discard(self) -> None:
        """Close it, and remove it unless it was committed."""
        if self.out is not None:
            os.close(self.out)
            self.out = None
        if self.name is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self.parent)
            self.name = None


class FileWriter:
    """What a form that writes one file part holds (``POST /upload``, ``POST /fs/write``): the
    destination's directory open at ``parent`` and the :class:`PartFile` in it. :meth:`cleanup`,
    after the body however it ended, discards a file not committed and closes the directory."""

    def __init__(self) -> None:
        self.parent: int | None = None
        self.file: PartFile | None = None

    def cleanup(self) -> None:
        if self.file is not None:
            self.file.discard()
            self.file = None
        if self.parent is not None:
            os.close(self.parent)
            self.parent = None


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a ``multipart/form-data`` ``Content-Type`` (``None``: another type, or
    no boundary)."""
    from python_multipart.multipart import parse_options_header

    ctype, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    return boundary if ctype == b"multipart/form-data" and boundary else None


def read_form(
    boundary: bytes | None,
    chunks: Iterable[bytes],
    form: Form,
    failed: Callable[[Exception], E],
    refused: E | None = None,
) -> E | None:
    """Stream the multipart body ``chunks`` into ``form``; the first failure, or ``None`` once
    the body was parsed to its end.

    ``refused``: a failure known before the body (it is read and dropped). A part's failure is
    what ``failed`` makes of what was raised (the endpoint's own refusal; ``failed`` may raise
    it again: a failure the endpoint does not answer); the rest of the body is then read and
    dropped. What reading ``chunks`` raises (a body that ends early), and what the end of the
    parsing raises, are the caller's."""
    failure = refused
    parser = _Parser(boundary, form).parser if failure is None and boundary else None
    for chunk in chunks:
        if failure is not None or parser is None:
            continue  # read the rest, so the client gets our answer, not a reset
        try:
            parser.write(chunk)
        except Exception as exc:
            failure = failed(exc)
    if failure is None and parser is not None:
        parser.finalize()
    return failure


class _Parser:
    """python-multipart's parser, its header callbacks collected into one ``begin`` per part."""

    def __init__(self, boundary: bytes, form: Form) -> None:
        from python_multipart.multipart import MultipartParser

        self.form = form
        self.headers: dict[str, bytes] = {}
        self.field = b""
        self.value = b""
        callbacks: Any = {
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": form.end,
        }
        self.parser = MultipartParser(boundary, callbacks)

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self.field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def _header_end(self) -> None:
        self.headers[self.field.decode("latin-1").lower()] = self.value
        self.field, self.value = b"", b""

    def _headers_finished(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, disposition = parse_options_header(self.headers.get("content-disposition", b""))
        self.headers = {}
        self.form.begin(disposition)

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        self.form.data(memoryview(data)[start:end])
