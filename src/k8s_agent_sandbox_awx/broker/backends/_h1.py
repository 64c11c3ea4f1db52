"""HTTP/1.1 for the broker's own connections (:mod:`._http11`), without I/O: a request's head
written straight into bytes (:func:`request_head`), and an answer parsed by a small, strict
parser (:class:`Parser`: a head, then a body by its framing). It replaces h11 there: the same
exchanges, a fraction of the CPU (h11 builds and validates an event object per step).

The request's parts are checked before anything is written, by h11's rules: the method a
token, the target visible ASCII, every header name a token and every value visible
characters with spaces and tabs only within (no CR, LF or NUL: what keeps a header from
becoming two; the forward's headers are the broker server's parse of the caller's, checked
already, so all names are matched at once and all values at once), one ``Content-Length``
(digits; equal duplicates sent once), ``Transfer-Encoding`` only ``chunked`` and not beside a
``Content-Length``, a whole body of the length declared.

The answer is read as h11 read it (RFC 9112): a status line ``HTTP/d.d NNN [reason]``, header
lines (``name: value``; obsolete line folding joined with a space; lines may end in a bare
LF), the head at most :data:`MAX_HEAD` bytes; ``Content-Length`` one value of digits
(duplicates equal as written merged); ``Transfer-Encoding`` only ``chunked`` (anything else,
``gzip, chunked`` among them, is refused: the broker does not undo transfer codings); chunk
sizes hex (at most 20 digits), chunk extensions and trailers read and
dropped; no body after ``HEAD``, ``204`` and ``304``; without framing, the body runs to the
connection's close. Every failure is httpx's (``RemoteProtocolError`` for the answer,
``LocalProtocolError`` for the request), with no header value in its message (a route's
headers carry a token).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

import httpx

__all__ = [
    "CHUNKED",
    "MAX_HEAD",
    "UNTIL_CLOSE",
    "Head",
    "Parser",
    "body_framing",
    "frame_chunk",
    "request_head",
]

MAX_HEAD: Final = 100 * 1024
"""The largest answer head accepted (httpcore's ``MAX_INCOMPLETE_EVENT_SIZE``), and the
largest chunk-size line or trailer section."""
CHUNKED: Final = -1
"""A body's framing (:func:`body_framing`): chunked (else a length, or :data:`UNTIL_CLOSE`)."""
UNTIL_CLOSE: Final = -2
"""A body's framing: it ends where the server closes the connection (no length, not chunked)."""

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_METHOD = re.compile(_TOKEN)
_NAMES = re.compile(rb"%s(?::%s)*" % (_TOKEN, _TOKEN))
"""Header names joined by ``:`` (which no token holds: a name with one adds a ``:``, which the
count of them finds): all tokens, in one match."""
_FIELD_VALUE = rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?"
_VALUES = re.compile(rb"%s(?:\n%s)*" % (_FIELD_VALUE, _FIELD_VALUE))
"""Header values joined by LF (which no value may hold: counted too), each h11's
``field-value``: in one match."""
_TARGET = re.compile(rb"[\x21-\x7e]+")
_DIGITS = re.compile(rb"[0-9]{1,20}")
_MAX_LENGTH_DIGITS: Final = 20

_HEADER_LINE = re.compile(rb"(%s):[ \t]*(%s)[ \t]*" % (_TOKEN, _FIELD_VALUE))
_STATUS_LINE = re.compile(rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: (?:[ \t]|[^\x00\s])*)?")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")
_BLANK_LINE = re.compile(rb"\n\r?\n")
_NO_BODY_STATUS = (204, 304)


def _refused(why: str) -> httpx.RemoteProtocolError:
    return httpx.RemoteProtocolError(why)


# ------------------------------------------------------------------------------ the request


def request_head(
    method: bytes,
    target: bytes,
    host_line: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    body: object,
) -> tuple[bytes, int | None, bool]:
    """The request's head (``host_line``, ``host: ...\r\n``, first), the framing of its body
    (a declared length, :data:`CHUNKED`, or ``None``: no body) and whether the request asks to
    close the connection. ``body`` is bytes, ``None`` or chunks: the framing httpx gives
    (a ``Content-Length`` for bytes unless empty outside ``POST``/``PUT``/``PATCH``, chunked
    for chunks) unless ``headers`` frame it. ``httpx.LocalProtocolError``: a part that HTTP
    does not allow, or would make the head say something else (a whole body of another
    length than the one declared among them)."""
    if _METHOD.fullmatch(method) is None:
        raise httpx.LocalProtocolError("Illegal method characters")
    if _TARGET.fullmatch(target) is None:
        raise httpx.LocalProtocolError("Illegal target characters")
    block, length, chunked, close = _header_block(headers) if headers else (b"", None, False, False)
    if chunked:
        framing: int | None = CHUNKED
    elif length is not None:
        framing = length
        if (body is None or isinstance(body, bytes)) and len(body or b"") != length:
            raise httpx.LocalProtocolError("a whole body of another length than declared")
    elif isinstance(body, bytes):
        framing = len(body)
        if body or method in (b"POST", b"PUT", b"PATCH"):
            block += b"content-length: %d\r\n" % framing
    elif body is not None:
        framing = CHUNKED
        block += b"transfer-encoding: chunked\r\n"
    else:
        framing = None
    return b"%s %s HTTP/1.1\r\n%s%s\r\n" % (method, target, host_line, block), framing, close


def _header_block(
    headers: Sequence[tuple[bytes, bytes]],
) -> tuple[bytes, int | None, bool, bool]:
    """The header lines of ``headers`` (not empty), checked in one match for all names and
    one for all values (h11's rules: a token; visible characters, spaces and tabs within,
    none at either end), then their framing (:func:`_framing_headers`)."""
    names = b":".join([name for name, _ in headers])
    if _NAMES.fullmatch(names) is None or names.count(b":") != len(headers) - 1:
        raise httpx.LocalProtocolError("Illegal header name")
    values = b"\n".join([value for _, value in headers])
    if _VALUES.fullmatch(values) is None or values.count(b"\n") != len(headers) - 1:
        raise httpx.LocalProtocolError("Illegal header value")
    length: int | None = None
    chunked = close = False
    lowered = b":%s:" % names.lower()
    framing_names = (b":content-length:", b":transfer-encoding:", b":connection:")
    if framing_names[0] in lowered or framing_names[1] in lowered or framing_names[2] in lowered:
        headers, length, chunked, close = _framing_headers(headers)
    return b"".join([b"%s: %s\r\n" % header for header in headers]), length, chunked, close


def _framing_headers(
    headers: Sequence[tuple[bytes, bytes]],
) -> tuple[list[tuple[bytes, bytes]], int | None, bool, bool]:
    """The headers with one ``Content-Length`` (equal duplicates dropped, as h11 sends them),
    that length, whether ``Transfer-Encoding: chunked`` frames the body, and whether
    ``Connection`` asks to close."""
    kept: list[tuple[bytes, bytes]] = []
    length: bytes | None = None
    chunked = close = False
    for name, value in headers:
        low = name.lower()
        if low == b"content-length":
            value = _content_length(value, httpx.LocalProtocolError)
            if length is not None:
                if value != length:
                    raise httpx.LocalProtocolError("conflicting Content-Length headers")
                continue
            length = value
        elif low == b"transfer-encoding":
            if chunked or value.strip(b" \t").lower() != b"chunked":
                raise httpx.LocalProtocolError("Only Transfer-Encoding: chunked is supported")
            chunked = True
        elif low == b"connection":
            close = close or b"close" in _tokens(value)
        kept.append((name, value))
    if chunked and length is not None:
        raise httpx.LocalProtocolError("Content-Length and Transfer-Encoding both frame the body")
    return kept, None if length is None else int(length), chunked, close


def frame_chunk(data: bytes, framing: int | None) -> bytes:
    """``data`` (not empty) as the request's body sends it: a chunk, or as it is."""
    return b"%x\r\n%s\r\n" % (len(data), data) if framing == CHUNKED else data


def _tokens(value: bytes) -> list[bytes]:
    return [part.strip(b" \t").lower() for part in value.split(b",")]


def _content_length(value: bytes, error: type[httpx.ProtocolError]) -> bytes:
    """A ``Content-Length`` value as h11 reads it: comma-separated equal values of digits
    (equal as written: ``5, 05`` conflict), the one value returned."""
    if value.isdigit() and len(value) <= _MAX_LENGTH_DIGITS:  # the rule (ASCII digits only)
        return value
    lengths = {part.strip(b" \t") for part in value.split(b",")}
    if len(lengths) != 1:
        raise error("conflicting Content-Length headers")
    (only,) = lengths
    if _DIGITS.fullmatch(only) is None:
        raise error("bad Content-Length")
    return only


# ------------------------------------------------------------------------------ the answer


class Head:
    """An answer's head: its status, headers (names in the server's case; one
    ``Content-Length``, ``Transfer-Encoding``'s value in lower case) and whether the server
    keeps the connection (HTTP/1.1 and no ``Connection: close``)."""

    __slots__ = ("chunked", "headers", "keep_alive", "length", "status")

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        length: int | None,
        chunked: bool,
    ) -> None:
        self.status = status
        self.headers = headers
        self.keep_alive = keep_alive
        self.length = length
        self.chunked = chunked


def body_framing(method: bytes, head: Head) -> int:
    """How the body of a final answer (``head``) to ``method`` ends: a length, :data:`CHUNKED`
    or :data:`UNTIL_CLOSE` (RFC 9112, section 6.3; ``Transfer-Encoding`` over
    ``Content-Length``)."""
    if head.status in _NO_BODY_STATUS or method == b"HEAD":
        return 0
    if head.chunked:
        return CHUNKED
    if head.length is not None:
        return head.length
    return UNTIL_CLOSE


def parse_head(head: bytes) -> Head:
    """The head ``head`` (up to the blank line that ends it)."""
    lines = _lines(head)
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise _refused(f"illegal status line: {lines[0][:80]!r}")
    version, status = status_line.group(1, 2)
    code = int(status)
    if code < 100:
        raise _refused(f"illegal status code {code}")
    folded = b"\n " in head or b"\n\t" in head
    headers, length, chunked, close = parse_fields(lines[1:], folded)
    return Head(code, headers, not close and version >= b"1.1", length, chunked)


def _lines(section: bytes) -> list[bytes]:
    """The lines of a head or a trailer section (up to its blank line: its last line's LF
    not included), each line's end (CRLF, or a bare LF as h11 took it) removed."""
    if section.endswith(b"\r"):
        section = section[:-1]
    return section.replace(b"\r\n", b"\n").split(b"\n")


def parse_fields(
    lines: list[bytes], folded: bool = True
) -> tuple[list[tuple[bytes, bytes]], int | None, bool, bool]:
    """Header lines (obsolete folding joined, unless ``folded`` says that no line starts with
    a blank): the headers, their ``Content-Length``, whether ``Transfer-Encoding: chunked``
    is given, and whether ``Connection`` asks to close."""
    if folded:
        lines = _unfolded(lines)
    headers: list[tuple[bytes, bytes]] = []
    length: bytes | None = None
    chunked = close = False
    for line in lines:
        field = _HEADER_LINE.fullmatch(line)
        if field is None:
            raise _refused(f"illegal header line: {line.partition(b':')[0][:80]!r}")
        name, value = field.group(1, 2)
        low = name.lower()
        if low == b"content-length":
            value = _content_length(value, httpx.RemoteProtocolError)
            if length is not None:
                if value != length:
                    raise _refused("conflicting Content-Length headers")
                continue
            length = value
        elif low == b"transfer-encoding":
            value = value.lower()
            if chunked or value != b"chunked":
                raise _refused("Only Transfer-Encoding: chunked is supported")
            chunked = True
        elif low == b"connection":
            close = close or b"close" in _tokens(value)
        headers.append((name, value))
    return headers, None if length is None else int(length), chunked, close


def _unfolded(lines: list[bytes]) -> list[bytes]:
    """Lines whose continuations (obsolete line folding: a line that starts with a space or a
    tab) are joined to the line before with one space."""
    joined: list[bytes] = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            if not joined:
                raise _refused("continuation line at start of headers")
            joined[-1] += b" " + line.lstrip(b" \t")
        else:
            joined.append(line)
    return joined


class Parser:
    """One connection's answers, parsed from :attr:`buffer` (what was received and not yet
    parsed: the connection appends to it): :meth:`head`, then :meth:`begin` with the body's
    framing and :meth:`body` until it ends (:attr:`done`). :attr:`closed`: the server closed
    its side, nothing more will come."""

    __slots__ = (
        "_footer",
        "_framing",
        "_in_chunk",
        "_scanned",
        "_trailers",
        "buffer",
        "closed",
        "done",
    )

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.closed = False
        self.done = False
        """The answer's body ended (its last byte was parsed)."""
        self._scanned = 0
        """How far :attr:`buffer` was searched for a head's end (or a line's) in vain."""
        self._in_chunk = 0
        """The body's bytes still to come: of a length, or of the current chunk."""
        self._footer = False
        """A chunk's data ended: its CRLF comes next (chunked)."""
        self._trailers = False
        """The last chunk came: the trailer section comes next (chunked)."""
        self._framing = 0

    def head(self) -> Head | None:
        """The next head taken from the buffer, or ``None`` until it is all there."""
        buffer = self.buffer
        if buffer and buffer[0] < 0x21:  # an empty line or a space where a status line starts
            raise _refused("illegal status line (it starts with a blank)")
        end = _BLANK_LINE.search(buffer, max(self._scanned - 2, 0))
        if end is None:
            self._scanned = len(buffer)
            if len(buffer) > MAX_HEAD:
                raise _refused(f"the answer's head is longer than {MAX_HEAD} bytes")
            return None
        self._scanned = 0
        stop = end.start()
        if stop > MAX_HEAD:
            raise _refused(f"the answer's head is longer than {MAX_HEAD} bytes")
        head = bytes(buffer[:stop])
        del buffer[: end.end()]
        return parse_head(head)

    def begin(self, framing: int) -> None:
        """The body of the answer whose head was just taken is framed by ``framing``."""
        self._framing = framing
        self._in_chunk = framing if framing >= 0 else 0
        self._footer = self._trailers = False
        self.done = framing == 0

    def body(self) -> bytes | None:
        """The body's next bytes from the buffer (not empty), ``b""`` once it ended
        (:attr:`done`), or ``None`` until more comes. The server's close ends a body framed
        by it and fails any other that has not ended."""
        if self.done:
            return b""
        if self._framing == CHUNKED:
            return self._chunked()
        if not self.buffer:
            if self._framing == UNTIL_CLOSE and self.closed:
                self.done = True
                return b""
            return self._more()
        if self._framing == UNTIL_CLOSE:
            return self._take(len(self.buffer))
        data = self._take(self._in_chunk)
        self._in_chunk -= len(data)
        self.done = not self._in_chunk
        return data

    def _more(self) -> bytes | None:
        """``None`` (more is needed), or the failure of a body whose server closed early."""
        if not self.closed:
            return None
        if self._framing == CHUNKED:
            raise _refused(
                "peer closed connection without sending complete message body "
                "(incomplete chunked read)"
            )
        expected = self._framing
        raise _refused(
            "peer closed connection without sending complete message body "
            f"(received {expected - self._in_chunk} bytes, expected {expected})"
        )

    def _take(self, most: int) -> bytes:
        """At most ``most`` of the buffer's bytes (it has some)."""
        buffer = self.buffer
        if most >= len(buffer):
            data = bytes(buffer)
            buffer.clear()
            return data
        data = bytes(buffer[:most])
        del buffer[:most]
        return data

    def _chunked(self) -> bytes | None:
        """:meth:`body`, chunked: a chunk's data, its CRLF, the next size line; the last
        chunk's trailers are read (checked as header lines) and dropped."""
        buffer = self.buffer
        while True:
            if self._in_chunk:
                if not buffer:
                    return self._more()
                data = self._take(self._in_chunk)
                self._in_chunk -= len(data)
                self._footer = not self._in_chunk
                return data
            if self._footer:
                if buffer[:2] != b"\r\n"[: len(buffer)]:
                    raise _refused("malformed chunk footer (no CRLF after a chunk's data)")
                if len(buffer) < 2:
                    return self._more()
                del buffer[:2]
                self._footer = False
            elif self._trailers:
                return self._trailer_section()
            else:
                size = self._chunk_size()
                if size is None:
                    return self._more()
                self._in_chunk = size
                self._trailers = not size

    def _chunk_size(self) -> int | None:
        """The next chunk-size line's size (taken from the buffer), or ``None`` until it is
        all there."""
        buffer = self.buffer
        end = buffer.find(b"\r\n", max(self._scanned - 1, 0))
        if end < 0:
            self._scanned = len(buffer)
            if len(buffer) > MAX_HEAD:
                raise _refused(f"a chunk-size line longer than {MAX_HEAD} bytes")
            return None
        self._scanned = 0
        line = _CHUNK_LINE.fullmatch(buffer, 0, end + 2)
        if line is None:
            raise _refused(f"illegal chunk header: {bytes(buffer[: min(end, 40)])!r}")
        size = int(line.group(1), 16)
        del buffer[: end + 2]
        return size

    def _trailer_section(self) -> bytes | None:
        """``b""`` once the trailer section (after the last chunk) was taken and checked, or
        ``None`` until it is all there."""
        buffer = self.buffer
        if buffer[:1] == b"\n" or buffer[:2] == b"\r\n":
            del buffer[: 1 if buffer[:1] == b"\n" else 2]
            self.done = True
            return b""
        end = _BLANK_LINE.search(buffer, max(self._scanned - 2, 0))
        if end is None:
            self._scanned = len(buffer)
            if len(buffer) > MAX_HEAD:
                raise _refused(f"a trailer section longer than {MAX_HEAD} bytes")
            return self._more()
        self._scanned = 0
        section = bytes(buffer[: end.start()])
        del buffer[: end.end()]
        parse_fields(_lines(section))
        self.done = True
        return b""
