"""The broker's own HTTP/1.1 connections to a plain-HTTP runtime: the request's head written
straight into bytes and the answer parsed by a small strict parser of our own (:mod:`._h1`,
pure Python: the ``[local]`` extra has no C parser) over an asyncio protocol, with a small
keep-alive pool per runtime (:class:`Http11Pool`).

Why: httpx and httpcore cost about 400-500 us of CPU per forwarded request in their own layers
(bench/bench_forward_client.py); the same exchange framed here costs a fraction of it (h11,
which framed it before, took about a quarter of the broker's CPU per request: an event object
built and validated per step). Used for
every plain-HTTP route to a runtime: a pod's (the pod data plane), the local backend's, and an
``http://`` Kubernetes router's; an ``https://`` router and port requests (a user's server: a
new connection each) keep httpx.

The failures are httpx's exception types, raised as httpcore raises them, so that the forward's
answers do not depend on which client carried the request (``dataplane._forward._send_upstream``):

- ``ConnectError`` / ``ConnectTimeout``: no connection was made, nothing was sent (``PoolTimeout``
  never: the pool bounds its idle connections, not the ones in use, as the httpx clients it
  replaces);
- ``WriteTimeout`` / ``ReadTimeout``: a write or a read did not complete in its named time
  (the read timeout bounds an answer's head whole, and each read of its body);
- ``RemoteProtocolError``, ``ReadError``, ``LocalProtocolError``: the request may have been sent.

A kept-alive connection is reused only when both sides completed the exchange (the request
written whole, the answer read to its end) and neither asked to close (``Connection: close``,
an HTTP/1.0 answer, a body that ends at the close), and only while it is idle and the server
has neither closed it nor sent anything (checked again on the socket itself before reuse, as
httpcore does); a connection that fails after it was chosen is never retried on another: the
request may have reached the server (a command never runs twice). A connection is closed on
any error, on cancellation, when its answer is closed before its end, and once it has been
idle for the pool's ``idle_seconds`` (not only when a later request finds it expired). Reading
stops while :data:`READ_BUFFER` bytes wait for the consumer, writing waits while the socket's
buffer is full: memory stays bounded whatever pace either peer keeps.

A hostile runtime (the sandbox's owner's code) gets no more: a ``2xx`` to a ``CONNECT`` (a
tunnel) is ``RemoteProtocolError``, as are a ``101`` (no upgrade is ever asked), more than
:data:`MAX_INFORMATIONAL` ``1xx`` answers, a head over :data:`MAX_HEAD` bytes and anything
:mod:`._h1` refuses; a ``Content-Length`` beside ``Transfer-Encoding`` is removed from the
answer's headers (its body is read chunked); bytes past an answer's end close its connection;
a body cut short by the server's close (even within a chunk's size line) is
``RemoteProtocolError``.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import AsyncIterator, Sequence
from typing import Final, cast

import httpx

from ._h1 import (
    CHUNKED,
    MAX_HEAD,
    UNTIL_CLOSE,
    Head,
    Parser,
    body_framing,
    frame_chunk,
    request_head,
)

__all__ = ["MAX_HEAD", "Http11Answer", "Http11Pool", "RequestBody"]

READ_BUFFER: Final = 64 * 1024
"""Bytes received and not yet taken by the reader past which the socket is no longer read."""
MAX_INFORMATIONAL: Final = 16
"""The most informational answers (``100 Continue``, ``103 Early Hints``) skipped before an
answer's final head; past them the exchange fails (``RemoteProtocolError``): an endless
stream of them never lets the read timeout fire."""

RequestBody = bytes | AsyncIterator[bytes] | None
"""A request's body: ``None`` (a method without one: no framing header), bytes (sent with a
``Content-Length`` unless empty, or the headers give one), or chunks (chunked unless the
headers give a length)."""


class _WriteFailed(Exception):
    """A write to a connection that was closed (by the server, or after an error)."""


class _Connection(asyncio.Protocol):
    """One connection: what was received (:attr:`received`, then the parser's buffer), the
    exchange's state, the waiters."""

    def __init__(self, pool: Http11Pool) -> None:
        self.pool = pool
        self.parser = Parser()
        self.method = b""
        """The current request's method (a ``HEAD``'s answer has no body)."""
        self.sent = False
        """The current request was written whole."""
        self.keep_alive = False
        """Neither the current request nor its answer asked to close the connection."""
        self.transport: asyncio.Transport | None = None
        self.received = bytearray()
        self.eof = False
        self.closed = False
        self.error: BaseException | None = None
        """Why the connection was lost (``None``: closed cleanly, or not lost)."""
        self.idle_since: float | None = None
        """When the connection went idle in the pool (``None``: in use, or closed)."""
        self._reading: asyncio.Future[None] | None = None
        self._writing: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._poll: select.poll | None = None

    # -- asyncio's callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is none by class
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(select, "poll"):
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        self.received += data
        if len(self.received) >= READ_BUFFER and self.transport is not None:
            self.transport.pause_reading()
            self._reading_paused = True
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = self.closed = True
        self.error = exc
        self._wake_reader()
        if self._writing is not None and not self._writing.done():
            self._writing.set_result(None)
        self.pool._forget(self)

    def pause_writing(self) -> None:
        self._writing = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writing is not None and not self._writing.done():
            self._writing.set_result(None)
        self._writing = None

    def _wake_reader(self) -> None:
        if self._reading is not None and not self._reading.done():
            self._reading.set_result(None)
        if self.idle_since is not None:  # the server spoke or left while the connection idled
            self.abort()

    # -- what an exchange uses
    def usable(self) -> bool:
        """Whether this idle connection may carry a request: open, nothing received since its
        last answer, and its socket has nothing to read (a close not seen by the loop yet)."""
        if self.eof or self.received or self.parser.buffer:
            return False
        if self.transport is None or self.transport.is_closing():
            return False
        return self._poll is None or not self._poll.poll(0)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.pool._forget(self)

    async def write(self, data: bytes, within: float | None) -> None:
        """Send ``data``, waiting (at most ``within``) while the socket's buffer is full
        (:class:`_WriteFailed`: the connection is closed)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise _WriteFailed()
        self.transport.write(data)
        if self._writing is not None:
            await _within(self._writing, within, httpx.WriteTimeout)
            if self.closed:
                raise _WriteFailed()

    def take(self) -> bool:
        """Move what was received to the parser's buffer (``False``: nothing was there)."""
        received = self.received
        if not received:
            return False
        parser = self.parser
        if parser.buffer:
            parser.buffer += received
            received.clear()
        else:  # no copy: the buffers swap
            self.received, parser.buffer = parser.buffer, received
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return True

    async def fill(self, within: float | None) -> None:
        """Wait for more of the answer and give it to the parser (``parser.closed``: the
        server closed its side; ``httpx.ReadError``: the connection failed,
        ``httpx.ReadTimeout``: nothing came)."""
        if not self.received and not self.eof:
            self._reading = asyncio.get_running_loop().create_future()
            try:
                await _within(self._reading, within, httpx.ReadTimeout)
            finally:
                self._reading = None
        if self.take():
            return
        if self.error is not None:  # reset, or another failure of the socket
            raise httpx.ReadError(str(self.error) or type(self.error).__name__) from self.error
        self.parser.closed = True

    def next_body(self) -> bytes | None:
        """:meth:`.Parser.body` of what was received so far; what waits in :attr:`received`
        is moved to the parser only when it needs more (else a slow reader of small chunks
        would let the parser's buffer grow by a read per chunk taken)."""
        part = self.parser.body()
        if part is None and self.take():
            part = self.parser.body()
        return part


async def _within(
    waiter: asyncio.Future[None], within: float | None, error: type[httpx.TimeoutException]
) -> None:
    """Wait for ``waiter`` at most ``within`` seconds, else raise ``error``."""
    if within is None:
        await waiter
        return
    loop = asyncio.get_running_loop()
    handle = loop.call_later(within, _expire, waiter)
    try:
        await waiter
    except TimeoutError:
        raise error(f"no progress within {within:g} s") from None
    finally:
        handle.cancel()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Headers:
    """An answer's headers as received (``raw``: names in the server's case)."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str = "") -> str:
        """The first value of header ``name`` (any case), or ``default``."""
        wanted = name.lower().encode("latin-1")
        for key, value in self.raw:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return default


class Http11Answer:
    """An answer whose head was read; its body streams from :meth:`aiter_raw` (transfer
    coding removed, content coding kept: what ``httpx.Response.aiter_raw`` gives), or is
    :meth:`whole_body` when it all came with the head."""

    def __init__(
        self, connection: _Connection, status: int, headers: _Headers, read: float | None
    ) -> None:
        self.status_code = status
        self.headers = headers
        self._connection: _Connection | None = connection
        self._read_timeout = read
        self._parsed: list[bytes] = []
        """The body's chunks :meth:`whole_body` parsed, not yet given (:meth:`aiter_raw`)."""
        self._failed: httpx.RemoteProtocolError | None = None

    def whole_body(self) -> bytes | None:
        """The whole body, if all of it was received already (with the head, as a rule): the
        connection then goes back to the pool, as at the end of :meth:`aiter_raw`. Else
        ``None``, and nothing is lost: :meth:`aiter_raw` gives the body (what this parsed
        first), and fails as it would have (a malformed body)."""
        connection = self._connection
        if connection is None or self._failed is not None:
            return None
        parsed = self._parsed
        try:
            while (part := connection.next_body()) is not None:
                if not part:
                    body = b"".join(parsed) if len(parsed) != 1 else parsed[0]
                    parsed.clear()
                    self._ended(connection)
                    return body
                parsed.append(part)
        except httpx.RemoteProtocolError as exc:
            self._failed = exc
        return None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            raise httpx.StreamClosed()
        try:
            parsed, self._parsed = self._parsed, []
            for chunk in parsed:  # in order, not list.pop(0): quadratic in tiny chunks
                yield chunk
            if self._failed is not None:
                raise self._failed
            while True:
                part = connection.next_body()
                if part is None:
                    await connection.fill(self._read_timeout)
                elif part:
                    yield part
                else:
                    break
        except BaseException:
            self._close()
            raise
        self._ended(connection)

    def _ended(self, connection: _Connection) -> None:
        """The answer was read whole: its connection goes back to the pool."""
        self._connection = None
        connection.pool._release(connection)

    async def aclose(self) -> None:
        """Done with the answer: its connection is closed unless the answer was read whole."""
        self._close()

    def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.abort()


class Http11Pool:
    """The kept-alive connections to one plain-HTTP server: ``host``:``port``, or the Unix
    socket ``uds`` (``host`` then only names it in the ``Host`` header); at most ``keep`` idle
    connections, each for at most ``idle_seconds``. Connections in use are not bounded (as
    the httpx clients this replaces: ``max_connections=None``)."""

    def __init__(
        self, host: str, port: int, *, uds: str | None = None, keep: int, idle_seconds: float
    ) -> None:
        self.host = host
        self.port = port
        self.uds = uds
        self.keep = keep
        self.idle_seconds = idle_seconds
        self.host_header = (f"[{host}]" if ":" in host else host).encode("ascii")
        if port != 80:
            self.host_header += b":%d" % port
        self.host_line = b"host: %s\r\n" % self.host_header
        self._idle: list[_Connection] = []
        """The idle connections, the longest idle first."""
        self._open: set[_Connection] = set()
        self._closed = False
        self._sweep: asyncio.TimerHandle | None = None
        """Closes the idle connections whose idle time is over, when the first one's is (one
        timer for the pool, not one per release: :meth:`_expire`)."""

    def __repr__(self) -> str:
        where = self.uds or f"{self.host}:{self.port}"
        return f"Http11Pool({where!r}, idle={len(self._idle)}, open={len(self._open)})"

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def connections(self) -> int:
        """How many connections are open (idle or in use)."""
        return len(self._open)

    async def aclose(self) -> None:
        """Close every connection (idle or in use) and refuse new requests."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self._open):
            connection.abort()

    async def send(
        self,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: RequestBody,
        timeouts: httpx.Timeout,
    ) -> Http11Answer:
        """Send the request (``target`` exactly as given; a ``Host`` header is added) and read
        its answer's head; the body is the answer's (:class:`Http11Answer`). A request HTTP
        does not allow (:func:`._h1.request_head`) is refused before a connection is chosen."""
        head = request_head(method, target, self.host_line, headers, body)
        connection = self._idle_connection() or await self._connect(timeouts.connect)
        try:
            await _send_request(connection, method, head, body, timeouts.write)
            return await _read_head(connection, timeouts.read)
        except BaseException:
            connection.abort()
            raise

    def _idle_connection(self) -> _Connection | None:
        deadline = time.monotonic() - self.idle_seconds
        while self._idle:
            connection = self._idle.pop()
            since = connection.idle_since
            if since is not None and since >= deadline and connection.usable():
                connection.idle_since = None
                return connection
            connection.idle_since = None
            connection.abort()
        return None

    async def _connect(self, within: float | None) -> _Connection:
        if self._closed:
            raise httpx.ConnectError("the connections to this runtime are closed")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(within):
                if self.uds is not None:
                    sock = await unix_connected(self.uds)
                    _, connection = await loop.create_unix_connection(
                        lambda: _Connection(self), sock=sock
                    )
                else:
                    _, connection = await loop.create_connection(
                        lambda: _Connection(self), self.host, self.port
                    )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection within {within:g} s") from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        self._open.add(connection)
        return connection

    def _release(self, connection: _Connection) -> None:
        """An exchange ended cleanly: keep ``connection`` for the next one if both sides
        completed it, neither asked to close, and nothing came past the answer's end."""
        if (
            self._closed
            or not connection.sent
            or not connection.keep_alive
            or not connection.parser.done
            or len(self._idle) >= self.keep
        ):
            connection.abort()
            return
        connection.sent = connection.keep_alive = False
        connection.idle_since = time.monotonic()
        if connection.usable():
            self._idle.append(connection)
            if self._sweep is None:
                loop = asyncio.get_running_loop()
                self._sweep = loop.call_later(self.idle_seconds, self._expire)
        else:
            connection.abort()

    def _expire(self) -> None:
        """Close the idle connections whose idle time is over; again when the next one's is."""
        self._sweep = None
        now = time.monotonic()
        while self._idle:
            since = self._idle[0].idle_since
            if since is not None and since + self.idle_seconds > now:
                wait = since + self.idle_seconds - now
                self._sweep = asyncio.get_running_loop().call_later(wait, self._expire)
                return
            self._idle.pop(0).abort()

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        if connection.idle_since is not None:
            connection.idle_since = None
            if connection in self._idle:
                self._idle.remove(connection)


async def _send_request(
    connection: _Connection,
    method: bytes,
    request: tuple[bytes, int | None, bool],
    body: RequestBody,
    within: float | None,
) -> None:
    """Write the request (``request``: :func:`._h1.request_head`'s head, framing and close;
    the framing as httpx frames it). A write that fails (the server closed early) ends the
    sending and the answer is read all the same, as httpcore does: a server may answer before
    it read the whole request (a ``413``); if none comes, the exchange fails as one whose
    request may have been sent."""
    head, framing, close = request
    connection.method = method
    connection.keep_alive = not close
    try:
        if body is None or isinstance(body, bytes):  # its length checked (request_head)
            data = body or b""
            if data and framing == CHUNKED:
                data = frame_chunk(data, framing) + _LAST_CHUNK
            elif framing == CHUNKED:
                data = _LAST_CHUNK
            await connection.write(head + data, within)
        else:
            await connection.write(head, within)
            sent = 0
            async for chunk in body:
                if chunk:
                    sent += len(chunk)
                    _check_length(framing, sent, None)
                    await connection.write(frame_chunk(chunk, framing), within)
            _check_length(framing, sent, sent)
            if framing == CHUNKED:
                await connection.write(_LAST_CHUNK, within)
        connection.sent = True
    except _WriteFailed:
        pass  # the answer is read all the same (see above)


_LAST_CHUNK: Final = b"0\r\n\r\n"


def _check_length(framing: int | None, sent: int, total: int | None) -> None:
    """``httpx.LocalProtocolError`` if a body's ``sent`` bytes pass the declared length
    (``framing``), or its ``total`` (at its end) falls short of it."""
    if framing is None or framing < 0:
        return
    if sent > framing:
        raise httpx.LocalProtocolError("Too much data for declared Content-Length")
    if total is not None and total < framing:
        raise httpx.LocalProtocolError("Too little data for declared Content-Length")


async def _read_head(connection: _Connection, within: float | None) -> Http11Answer:
    """The answer's head (:func:`_head`), read within ``within`` seconds in all: a head that
    trickles in, each read in time, is ``httpx.ReadTimeout`` all the same (its body's reads
    each have ``within``: an event stream's longest silence)."""
    try:
        async with asyncio.timeout(within):
            return await _head(connection, within)
    except TimeoutError:
        raise httpx.ReadTimeout(f"no answer's head within {within:g} s") from None


async def _head(connection: _Connection, within: float | None) -> Http11Answer:
    """The answer's final head; the informational answers (``100 Continue``, ``103 Early
    Hints``) are skipped, as httpcore skips them, but at most :data:`MAX_INFORMATIONAL`; a
    ``101`` (no upgrade was asked: the forward does not pass ``Upgrade``) and a ``2xx`` to a
    ``CONNECT`` (a tunnel) are refused. A ``Content-Length`` beside ``Transfer-Encoding``
    (the body is read chunked) is removed, as RFC 9112 (section 6.3) asks of an
    intermediary."""
    parser = connection.parser
    for _ in range(MAX_INFORMATIONAL + 1):
        head = parser.head()
        while head is None:
            await connection.fill(None)  # the head's deadline bounds the wait (_read_head)
            if parser.closed:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            head = parser.head()
        if head.status >= 200:
            return _answer(connection, head, within)
        if head.status == 101:
            raise httpx.RemoteProtocolError("the server switched protocols (101)")
    raise httpx.RemoteProtocolError(
        f"the server sent more than {MAX_INFORMATIONAL} informational answers (1xx)"
    )


def _answer(connection: _Connection, head: Head, within: float | None) -> Http11Answer:
    """The answer of the final ``head``, its body's framing set."""
    if connection.method == b"CONNECT" and 200 <= head.status < 300:
        raise httpx.RemoteProtocolError("the server opened a CONNECT tunnel")
    framing = body_framing(connection.method, head)
    connection.parser.begin(framing)
    connection.keep_alive = connection.keep_alive and head.keep_alive and framing != UNTIL_CLOSE
    raw = head.headers
    if head.chunked and head.length is not None:
        raw = [(k, v) for k, v in raw if k.lower() != b"content-length"]
    return Http11Answer(connection, head.status, _Headers(raw), within)


UNIX_BACKLOG_WAIT: Final = (0.001, 0.05)
"""The first and the longest pause between two connects to a Unix socket whose listener's
backlog is full (``EAGAIN``), until the connect timeout."""


async def unix_connected(path: str) -> socket.socket:
    """A non-blocking socket connected to the Unix socket ``path``. A listener whose backlog is
    full answers ``connect()`` with ``EAGAIN``: nothing is connecting in the background then
    (unlike TCP's ``EINPROGRESS``), so asyncio's own connect, which waits for the socket to be
    writable and reads no error, would hand over a socket that is not connected (the first
    write fails: an answer "lost" that was never sent). The connect is tried again instead,
    with a growing pause, until the caller's timeout."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    pause = UNIX_BACKLOG_WAIT[0]
    try:
        while True:
            try:
                sock.connect(path)
                return sock
            except BlockingIOError:  # EAGAIN: the backlog is full
                await asyncio.sleep(pause)
                pause = min(pause * 2, UNIX_BACKLOG_WAIT[1])
    except BaseException:
        sock.close()
        raise
