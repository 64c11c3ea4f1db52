"""The broker's own HTTP/1.1 connections to a plain-HTTP runtime (``backends._http11``): what
the forward relies on, against raw loopback servers.

- a kept-alive connection is reused, and only after a clean, complete exchange that neither
  side asked to close; an idle one the server closed is never used (also when the close has
  not reached the event loop yet), and a request is never sent twice: a connection that fails
  after the request was written is the caller's error, not a retry;
- the failures are httpx's: ``ConnectError`` (refused: nothing sent), ``ReadTimeout``,
  ``WriteTimeout``, ``RemoteProtocolError`` (the server closed before or during the answer);
- a reader that stops reading stops the socket being read (bounded memory), a server that
  stops reading makes writes wait (then time out);
- the target is sent as its bytes, with a ``Host`` header; the body framed as httpx frames it;
- a cancelled exchange closes its connection.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from k8s_agent_sandbox_awx.broker.backends._http11 import READ_BUFFER, Http11Pool
from tests._support.loopback_runtime import Handler
from tests._support.loopback_runtime import LoopbackRuntime as _Server

TIMEOUT = httpx.Timeout(connect=5.0, read=5.0, write=5.0, pool=10.0)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def _head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def _request(reader: asyncio.StreamReader) -> bytes:
    """One request with a Content-Length body (or none), whole."""
    head = await _head(reader)
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            return head + await reader.readexactly(int(value))
    return head


async def _get(pool: Http11Pool, target: bytes = b"/", **kw: float) -> tuple[int, bytes]:
    timeout = httpx.Timeout(**{"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 10.0, **kw})
    answer = await pool.send(b"GET", target, [], None, timeout)
    try:
        return answer.status_code, b"".join([chunk async for chunk in answer.aiter_raw()])
    finally:
        await answer.aclose()


def _answering(server: list[_Server], answer: bytes = OK, *, times: int = 100) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(times):
            server[0].requests.append(await _request(reader))
            writer.write(answer)
            await writer.drain()

    return handler


async def _serving(handler_of: Callable[[list[_Server]], Handler]) -> _Server:
    holder: list[_Server] = []
    made = _Server(handler_of(holder))
    holder.append(made)
    return made


def test_a_kept_alive_connection_is_reused_and_the_target_sent_as_its_bytes() -> None:
    async def main() -> None:
        async with await _serving(_answering) as server:
            pool = server.pool()
            target = b"/files/a%2Fb%20c?x=%2e%2e&y=1"
            for _ in range(3):
                assert await _get(pool, target) == (200, b"ok")
            assert (server.connections, pool.connections) == (1, 1)
            first = server.requests[0]
            assert first.startswith(b"GET " + target + b" HTTP/1.1\r\n"), first
            assert f"host: 127.0.0.1:{server.port}\r\n".encode() in first.lower()
            await pool.aclose()
            assert pool.is_closed and pool.connections == 0

    asyncio.run(main())


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\n\r\nok",  # read until the server closes
    ],
)
def test_a_connection_the_server_asked_to_close_is_not_reused(answer: bytes) -> None:
    async def main() -> None:
        async with await _serving(lambda s: _answering(s, answer, times=1)) as server:
            pool = server.pool()
            for _ in range(2):
                assert await _get(pool) == (200, b"ok")
            assert server.connections == 2

    asyncio.run(main())


def test_an_idle_connection_the_server_closed_is_not_used() -> None:
    """The server closes its kept-alive connection: the next request goes on a new one, sent
    once."""

    async def main() -> None:
        async with await _serving(lambda s: _answering(s, times=1)) as server:
            pool = server.pool()
            assert await _get(pool) == (200, b"ok")
            await asyncio.sleep(0.1)  # the server's close reaches the loop: the pool drops it
            assert pool.connections == 0
            assert await _get(pool) == (200, b"ok")
            assert (server.connections, len(server.requests)) == (2, 2)

    asyncio.run(main())


def test_a_close_the_event_loop_has_not_seen_yet_is_found_on_the_socket() -> None:
    """The server's FIN arrived while the loop was busy (no callback ran yet): the socket is
    checked before the connection is reused, as httpcore checks it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: list[bytes] = []
    closed = threading.Event()

    def serve() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                seen.append(conn.recv(65536))
                conn.sendall(OK)
                if len(seen) == 1:
                    time.sleep(0.2)  # the client's request over; then it closes
            closed.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def main() -> None:
        pool = Http11Pool("127.0.0.1", port, keep=8, idle_seconds=15.0)
        assert await _get(pool) == (200, b"ok")
        assert pool.connections == 1
        closed.wait(5)  # blocks the loop: the FIN is in the socket, no callback has run
        time.sleep(0.05)  # noqa: ASYNC251 (the loop must not run: that is the case tested)
        assert pool.connections == 1
        assert await _get(pool) == (200, b"ok")
        await pool.aclose()

    try:
        asyncio.run(main())
        thread.join(5)
        assert len(seen) == 2 and all(r.startswith(b"GET / ") for r in seen)
    finally:
        listener.close()


def test_a_request_is_never_sent_twice_when_a_reused_connection_breaks() -> None:
    """The server reads the second request on the kept-alive connection, then closes without
    an answer: the caller gets ``RemoteProtocolError`` (the forward's ``sandbox_answer_lost``)
    and the request reached the server once."""

    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            server.requests.append(await _request(reader))
            writer.write(OK)
            await writer.drain()
            server.requests.append(await _request(reader))  # then closes: no answer

        async with _Server(handler) as server:
            pool = server.pool()
            assert await _get(pool) == (200, b"ok")
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await pool.send(b"POST", b"/execute", [], b"{}", TIMEOUT)
            await asyncio.sleep(0.1)
            assert server.connections == 1 and len(server.requests) == 2
            assert server.requests[1].startswith(b"POST /execute ")
            assert pool.connections == 0

    asyncio.run(main())


def test_a_server_closing_mid_answer_is_a_broken_answer() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()

        async with _Server(handler) as server:
            pool = server.pool()
            answer = await pool.send(b"GET", b"/", [], None, TIMEOUT)
            got = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in answer.aiter_raw():
                    got += chunk
            assert got == b"abc" and pool.connections == 0

    asyncio.run(main())


def test_the_failures_are_httpxs() -> None:
    async def main() -> None:
        unused = socket.create_server(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        unused.close()
        refused = Http11Pool("127.0.0.1", port, keep=8, idle_seconds=15.0)
        with pytest.raises(httpx.ConnectError) as caught:
            await _get(refused)
        assert isinstance(caught.value.__cause__, ConnectionRefusedError)

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _request(reader)
            await asyncio.sleep(3)

        async with _Server(silent) as server:
            pool = server.pool()
            started = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await _get(pool, read=0.3)
            assert time.monotonic() - started < 2 and pool.connections == 0

    asyncio.run(main())


def test_a_reader_that_stops_reading_stops_the_socket_being_read() -> None:
    """A 64 MiB answer to a reader that takes one chunk and waits: the broker holds at most a
    read buffer's worth (plus one read) of it, the rest stays with the sender."""

    async def main() -> None:
        total = 64 * 1024 * 1024

        async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
            block = b"x" * (1024 * 1024)
            for _ in range(64):
                writer.write(block)
                await writer.drain()

        async with _Server(big) as server:
            pool = server.pool()
            answer = await pool.send(b"GET", b"/", [], None, TIMEOUT)
            chunks = answer.aiter_raw()
            got = len(await chunks.__anext__())
            await asyncio.sleep(0.5)  # the sender keeps sending, nobody reads
            (connection,) = pool._open
            assert len(connection.received) <= READ_BUFFER + 256 * 1024
            async for chunk in chunks:
                got += len(chunk)
            assert got == total

    asyncio.run(main())


def test_a_server_that_stops_reading_makes_writes_wait_then_time_out() -> None:
    async def main() -> None:
        async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(5)

        sent = 0

        async def body() -> AsyncIterator[bytes]:
            nonlocal sent
            block = b"y" * (1024 * 1024)
            for _ in range(512):
                sent += len(block)
                yield block

        async with _Server(deaf) as server:
            pool = server.pool()
            timeout = httpx.Timeout(connect=5.0, read=5.0, write=0.5, pool=10.0)
            with pytest.raises(httpx.WriteTimeout):
                await pool.send(b"POST", b"/upload", [], body(), timeout)
            assert sent < 64 * 1024 * 1024, sent  # the rest was never read from the caller
            assert pool.connections == 0

    asyncio.run(main())


def test_a_chunked_body_and_an_early_answer() -> None:
    """Chunks without a length go chunked (as httpx sends them); a server that answers before
    it read the body (a ``413``) has its answer returned, as httpcore returns it."""

    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await _head(reader)
            server.requests.append(head)
            if b"/small" in head:
                server.requests.append(await reader.readuntil(b"0\r\n\r\n"))
                writer.write(OK)
            else:
                writer.write(
                    b"HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
            await writer.drain()

        async def chunks(n: int, size: int = 65536) -> AsyncIterator[bytes]:
            for _ in range(n):
                yield b"z" * size

        async with _Server(handler) as server:
            pool = server.pool()
            answer = await pool.send(b"POST", b"/small", [], chunks(2, 1000), TIMEOUT)
            assert answer.status_code == 200
            await answer.aclose()
            assert b"transfer-encoding: chunked" in server.requests[0].lower()
            assert server.requests[1].startswith(b"3e8\r\n" + b"z" * 1000 + b"\r\n3e8\r\n")
            answer = await pool.send(b"POST", b"/big", [], chunks(2048), TIMEOUT)
            assert answer.status_code == 413
            await answer.aclose()

    asyncio.run(main())


def test_a_cancelled_exchange_closes_its_connection() -> None:
    async def main() -> None:
        async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                server.requests.append(await _request(reader))
                await asyncio.sleep(0.3)
                writer.write(OK)
                await writer.drain()

        async with _Server(slow) as server:
            pool = server.pool()
            task = asyncio.ensure_future(_get(pool))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool.connections == 0
            assert await _get(pool) == (200, b"ok")
            assert server.connections == 2

    asyncio.run(main())


def test_idle_connections_are_bounded_and_expire() -> None:
    async def main() -> None:
        async with await _serving(_answering) as server:
            pool = server.pool(keep=1)
            assert await asyncio.gather(*(_get(pool) for _ in range(3))) == [(200, b"ok")] * 3
            assert (server.connections, pool.connections) == (3, 1)
            expiring = server.pool(idle_seconds=0.0)
            assert await _get(expiring) == (200, b"ok")
            await asyncio.sleep(0.01)
            assert await _get(expiring) == (200, b"ok")
            assert server.connections == 5 and expiring.connections == 1

    asyncio.run(main())


def test_a_unix_socket_runtime(tmp_path: Path) -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await _request(reader)
                writer.write(OK)
                await writer.drain()

        path = str(tmp_path / "runtime.sock")
        server = await asyncio.start_unix_server(handler, path)
        try:
            pool = Http11Pool("127.0.0.1", 8888, uds=path, keep=8, idle_seconds=15.0)
            assert [await _get(pool) for _ in range(2)] == [(200, b"ok")] * 2
            assert pool.connections == 1
            await pool.aclose()
        finally:
            server.close()

    asyncio.run(main())


def test_a_unix_socket_whose_backlog_is_full_is_waited_for(tmp_path: Path) -> None:
    """An isolated sandbox's runtime listens on a Unix socket with a small backlog (socketserver:
    5): a connect beyond it is ``EAGAIN``, not a connection in progress. Before, asyncio's
    connect took that for a connection: the request's first write failed and 64 followers at
    once got ``sandbox_answer_lost`` for requests never sent. Now each connect waits its turn."""
    path = str(tmp_path / "runtime.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    stop = threading.Event()

    def serve() -> None:  # one connection at a time, slowly: the backlog fills
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                time.sleep(0.005)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def main() -> list[tuple[int, bytes]]:
        pool = Http11Pool("127.0.0.1", 8888, uds=path, keep=0, idle_seconds=1.0)
        try:
            return list(await asyncio.gather(*(_get(pool) for _ in range(24))))
        finally:
            await pool.aclose()

    try:
        assert asyncio.run(main()) == [(200, b"ok")] * 24
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_reset_connection_is_a_read_error() -> None:
    """The server resets the connection after reading the request: ``httpx.ReadError`` (the
    forward's ``sandbox_answer_lost``), never an exception httpx would not raise."""

    async def main() -> None:
        async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _request(reader)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # linger 0: an RST, not a FIN

        async with _Server(reset) as server:
            pool = server.pool()
            with pytest.raises(httpx.ReadError) as caught:
                await pool.send(b"POST", b"/execute", [], b"{}", TIMEOUT)
            assert isinstance(caught.value.__cause__, ConnectionResetError)
            assert pool.connections == 0

    asyncio.run(main())


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (OK, b"ok"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n1\r\n!\r\n0\r\n\r\n",
         b"ok!"),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
    ],
)  # fmt: skip
def test_a_body_that_came_with_its_head_is_whole_and_its_connection_reused(
    answer: bytes, body: bytes
) -> None:
    """``whole_body``: the answer written in one piece is given whole (no relay needed), and
    its connection goes back to the pool, as after a body read to its end."""

    async def main() -> None:
        async with await _serving(lambda s: _answering(s, answer)) as server:
            pool = server.pool()
            for _ in range(2):
                got = await pool.send(b"GET", b"/", [], None, TIMEOUT)
                assert got.whole_body() == body
                await got.aclose()
            assert (server.connections, pool.connections) == (1, 1)

    asyncio.run(main())


def test_a_body_still_on_its_way_is_not_whole_and_streams_from_what_was_parsed() -> None:
    """The head and part of the body arrived: ``whole_body`` is ``None`` and loses nothing;
    the body streams whole, and the connection is reused."""
    go_on = asyncio.Event()

    def handler_of(server: list[_Server]) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            server[0].requests.append(await _request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nabc")
            await writer.drain()
            await go_on.wait()
            writer.write(b"def")
            await _request(reader)
            writer.write(OK)

        return handler

    async def main() -> None:
        async with await _serving(handler_of) as server:
            pool = server.pool()
            got = await pool.send(b"GET", b"/", [], None, TIMEOUT)
            await asyncio.sleep(0.05)  # "abc" arrives (with the head, or after it)
            assert got.whole_body() is None
            go_on.set()
            assert b"".join([chunk async for chunk in got.aiter_raw()]) == b"abcdef"
            assert await _get(pool) == (200, b"ok")
            assert server.connections == 1

    asyncio.run(main())


def test_a_malformed_body_that_came_with_its_head_fails_as_it_streams() -> None:
    """A broken chunked body already received: ``whole_body`` is ``None`` and the body's read
    fails as it would have (``RemoteProtocolError``), the connection closed."""
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nzz\r\n"

    async def main() -> None:
        async with await _serving(lambda s: _answering(s, answer)) as server:
            pool = server.pool()
            got = await pool.send(b"GET", b"/", [], None, TIMEOUT)
            assert got.whole_body() is None
            chunks: list[bytes] = []
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in got.aiter_raw():
                    chunks.append(chunk)
            assert chunks == [b"ok"] and pool.connections == 0

    asyncio.run(main())
