"""The broker's own HTTP/1.1 connections (``backends._http11``) against a hostile runtime: the
runtime is code the sandbox's owner controls, so it may answer anything, slowly, never, or
maliciously; each test's server is such a runtime, on loopback.

- a ``2xx`` to a ``CONNECT`` (which a caller could send: the broker's server passes
  ``CONNECT /`` to the app) makes h11 switch protocols: the answer's body loop got ``PAUSED``
  for ever without awaiting, and the broker's one event loop span (every caller's requests
  stopped). It is now ``RemoteProtocolError`` before the answer starts, and the connection is
  closed; and the data plane refuses ``CONNECT`` (``400 invalid_method``) before sending;
- informational answers (``100 Continue``, ``103 Early Hints``) without end kept the broker
  reading and parsing them at the runtime's pace, the read timeout never fired: at most
  :data:`MAX_INFORMATIONAL` are skipped, then ``RemoteProtocolError``;
- an answer with both ``Transfer-Encoding: chunked`` and a ``Content-Length`` is read chunked
  (h11), and its ``Content-Length`` was relayed to the caller with a body of another length:
  an intermediary must remove it (RFC 9112, section 6.3), so it is removed;
- an idle kept-alive connection was closed only when a later request to the same runtime found
  it expired: one to a sandbox no longer used was held until the pool was; it is closed once
  its idle time is over;
- a head trickled a byte at a time, each within the read timeout, was waited for whole (for
  ever, at one byte per timeout): the head now has the read timeout as its deadline (the
  body's stays per read: an event stream's longest silence);
- and what held (regression tests): a second answer or bytes after the body, at once or later,
  never reach another request (the connection is closed, a new one carries the next request,
  sent once); an answer head past :data:`MAX_HEAD` is refused, not buffered; an endless
  chunked answer to a reader that stopped is not buffered past :data:`READ_BUFFER` (and a
  read); a ``keep-alive`` an HTTP/1.0 answer (or one that also says ``close``) claims is not
  believed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from k8s_agent_sandbox_awx.broker.backends import _http11
from k8s_agent_sandbox_awx.broker.backends._interface import READY, Owner
from k8s_agent_sandbox_awx.broker.backends.kubernetes._claims import KubeClaimState
from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import Routes, RouteSettings
from k8s_agent_sandbox_awx.broker.common._errors import ApiError
from k8s_agent_sandbox_awx.broker.dataplane._forward import Forward
from k8s_agent_sandbox_awx.broker.identity._policy import Caller
from tests._support.loopback_runtime import LoopbackRuntime as _Server

TIMEOUT = httpx.Timeout(connect=5.0, read=5.0, write=5.0, pool=10.0)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class _Spinning(Exception):
    """The event loop did not come back within the test's bound (a loop that never awaits)."""


@contextlib.contextmanager
def _bounded(seconds: float) -> Iterator[None]:
    """Interrupt this (main) thread after ``seconds``: a loop that never awaits cannot be
    timed out by asyncio, but Python code is interrupted by a signal's handler."""

    def interrupt(*_: object) -> None:
        raise _Spinning(f"the event loop did not come back within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


async def _read(answer: _http11.Http11Answer) -> bytes:
    try:
        return b"".join([chunk async for chunk in answer.aiter_raw()])
    finally:
        await answer.aclose()


def test_a_2xx_to_connect_is_refused_and_never_spins_the_event_loop() -> None:
    """``CONNECT /`` answered ``200`` with a body: the body loop met h11's ``PAUSED`` (a switch
    of protocols) again and again without awaiting, and nothing else in the broker ran."""

    async def main() -> None:
        async def tunnel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(OK)
            await writer.drain()
            await asyncio.sleep(5)

        async with _Server(tunnel) as server:
            pool = server.pool()
            with pytest.raises(httpx.RemoteProtocolError, match="CONNECT"):
                await _read(await pool.send(b"CONNECT", b"/", [], b"", TIMEOUT))
            assert pool.connections == 0

    with _bounded(5):
        asyncio.run(main())


def test_informational_answers_without_end_are_a_protocol_error() -> None:
    """A runtime that answers ``100 Continue`` for ever: the broker gave up never (the read
    timeout is per read), parsing them at the runtime's pace."""

    async def main() -> None:
        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            while True:
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 64)
                await writer.drain()

        async with _Server(endless) as server:
            pool = server.pool()
            with pytest.raises(httpx.RemoteProtocolError, match="informational"):
                await asyncio.wait_for(pool.send(b"GET", b"/", [], None, TIMEOUT), 5)
            assert pool.connections == 0

    asyncio.run(main())


def test_a_few_informational_answers_are_still_skipped() -> None:
    async def main() -> None:
        async def hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            early = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + early * 3 + OK)
            await writer.drain()

        async with _Server(hints) as server:
            answer = await server.pool().send(b"GET", b"/", [], None, TIMEOUT)
            assert (answer.status_code, await _read(answer)) == (200, b"ok")

    asyncio.run(main())


def test_a_content_length_beside_transfer_encoding_is_not_relayed() -> None:
    """The body is read chunked (h11: Transfer-Encoding wins); the answer's headers carried the
    runtime's ``Content-Length: 3`` beside a 10-byte body, which the caller would frame by."""

    async def main() -> None:
        async def both(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n"
                b"X-Kept: 1\r\n\r\na\r\n0123456789\r\n0\r\n\r\n"
            )
            await writer.drain()

        async with _Server(both) as server:
            answer = await server.pool().send(b"GET", b"/", [], None, TIMEOUT)
            names = [k.lower() for k, _ in answer.headers.raw]
            assert b"content-length" not in names and b"x-kept" in names, names
            assert answer.headers.get("content-length", "none") == "none"
            assert await _read(answer) == b"0123456789"

    asyncio.run(main())


def test_an_idle_connection_is_closed_when_its_idle_time_is_over() -> None:
    async def main() -> None:
        async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(OK)
                await writer.drain()

        async with _Server(answering) as server:
            pool = server.pool(idle_seconds=0.2)
            answer = await pool.send(b"GET", b"/", [], None, TIMEOUT)
            assert await _read(answer) == b"ok"
            assert pool.connections == 1  # kept alive
            await asyncio.sleep(0.6)  # no other request comes to find it expired
            assert pool.connections == 0
            answer = await pool.send(b"GET", b"/", [], None, TIMEOUT)
            assert await _read(answer) == b"ok"
            assert server.connections == 2

    asyncio.run(main())


def test_a_head_trickled_past_the_read_timeout_is_a_read_timeout() -> None:
    """A runtime that sends its answer's head a byte every 0.1 s, with a read timeout of 0.5 s:
    each read came in time, so the broker waited for the whole head (about 4 s here; a 100 KiB
    head at one byte per 299 s, for ever): ``X-Sandbox-Timeout`` is how long the broker waits
    for the runtime's answer, and now bounds its head whole."""

    async def main() -> None:
        async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            for byte in OK:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)

        async with _Server(trickle) as server:
            pool = server.pool()
            started = asyncio.get_running_loop().time()
            timeout = httpx.Timeout(connect=5.0, read=0.5, write=5.0, pool=10.0)
            with pytest.raises(httpx.ReadTimeout, match="head"):
                await pool.send(b"GET", b"/", [], None, timeout)
            assert asyncio.get_running_loop().time() - started < 2
            assert pool.connections == 0

    asyncio.run(main())


def test_a_body_trickled_within_the_read_timeout_is_read_whole() -> None:
    """The body's read timeout stays per read (an event stream's longest silence)."""

    async def main() -> None:
        async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n")
            for _ in range(8):
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.write(b"x")
            await writer.drain()

        async with _Server(trickle) as server:
            timeout = httpx.Timeout(connect=5.0, read=0.5, write=5.0, pool=10.0)
            answer = await server.pool().send(b"GET", b"/", [], None, timeout)
            assert await _read(answer) == b"x" * 8

    asyncio.run(main())


@pytest.mark.parametrize("later", [False, True], ids=["with-the-body", "after-it"])
@pytest.mark.parametrize(
    "extra",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged",  # a second answer
        b"garbage",
    ],
    ids=["a-second-answer", "bytes"],
)
def test_bytes_after_an_answer_never_reach_the_next_request(later: bool, extra: bytes) -> None:
    """What a runtime sends past its answer's end (a second answer, ready for the next
    request) closes the connection: the next request goes on a new one and gets its own
    answer. (This held before: a regression test.)"""

    async def main() -> None:
        async def smuggling(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                server.requests.append(await reader.readuntil(b"\r\n\r\n"))
                if later:
                    writer.write(OK)
                    await writer.drain()
                    await asyncio.sleep(0.1)
                    writer.write(extra)
                else:
                    writer.write(OK + extra)
                await writer.drain()

        async with _Server(smuggling) as server:
            pool = server.pool()
            answer = await pool.send(b"GET", b"/", [], None, TIMEOUT)
            assert await _read(answer) == b"ok"
            await asyncio.sleep(0.3)
            answer = await pool.send(b"GET", b"/second", [], None, TIMEOUT)
            assert await _read(answer) == b"ok"
            assert server.connections == 2 and len(server.requests) == 2

    asyncio.run(main())


def test_an_answer_head_past_the_limit_is_refused_not_buffered() -> None:
    """A runtime that sends header lines for ever: ``RemoteProtocolError`` once the head passes
    :data:`MAX_HEAD` (h11's bound), with no more than that (and a read) buffered. (Held.)"""

    async def main() -> None:
        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\n")
            while True:
                writer.write(b"X-Filler: " + b"f" * 1000 + b"\r\n")
                await writer.drain()

        async with _Server(endless) as server:
            pool = server.pool()
            with pytest.raises(httpx.RemoteProtocolError):
                await asyncio.wait_for(pool.send(b"GET", b"/", [], None, TIMEOUT), 5)
            assert pool.connections == 0
            assert _http11.MAX_HEAD == 100 * 1024

    asyncio.run(main())


def _pod_forward(port: int, settings: RouteSettings | None = None) -> tuple[object, object]:
    """The data plane's forward as the broker answers it (its errors as JSON), over the
    Kubernetes pod data plane to a stand-in pod at 127.0.0.1:``port`` (the runtime's port),
    for a caller who owns ``claim-1`` (``settings``: other routes); and its routes (to close)."""
    if settings is None:
        settings = RouteSettings(data_plane="pod", runtime_port=port, allow_loopback_pod_ips=True)
    routes = Routes(settings)
    state = KubeClaimState(
        name="claim-1", namespace="team-a", template="python", owner=Owner("i", "s", "p"),
        labels={}, annotations={}, stamps={}, env={}, created_at=0.0, expires_at=1.0,
        phase=READY, reason=None, message=None, transition_at=0.0, started_at=0.0, bound=True,
        scopes=frozenset({"commands", "files"}), uid="u", sandbox_name="sbx-1",
        pod_ips=("127.0.0.1",),
    )  # fmt: skip

    class Gate:
        async def authenticate(self, connection: object) -> Caller:
            return Caller("p", "i", "s", "aud", 2**31)

    class Backend:
        async def get(self, name: str, **_: object) -> KubeClaimState:
            return state

        async def route(self, state: KubeClaimState, port: int) -> object:
            return routes.route(state, port)

    forward = Forward(Backend(), Gate(), None)  # type: ignore[arg-type]

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        try:
            await forward.handle(Request(scope, receive), send)  # type: ignore[arg-type]
        except ApiError as exc:
            await exc.response()(scope, receive, send)  # type: ignore[arg-type]

    return app, routes


@contextlib.asynccontextmanager
async def pod_forwarding(
    port: int, settings: RouteSettings | None = None
) -> AsyncIterator[tuple[Any, Any]]:
    """:func:`_pod_forward`'s app and routes, the routes closed at the end."""
    app, routes = _pod_forward(port, settings)
    try:
        yield app, routes
    finally:
        await routes.close()  # type: ignore[attr-defined]


def test_the_forward_refuses_connect_and_answers_endless_1xx_with_its_502() -> None:
    """Through the forward (pod data plane): ``CONNECT`` (a tunnel, which the data plane does
    not open; a ``2xx`` relayed to it made the broker's own server fail with a traceback) is
    ``400 invalid_method`` before anything is sent; endless ``1xx`` answers are ``502
    sandbox_answer_lost``; and the broker goes on serving (the next request is answered)."""

    async def main() -> None:
        async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            server.requests.append(head)
            if head.startswith(b"GET /endless "):
                while True:
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 64)
                    await writer.drain()
            writer.write(OK)
            await writer.drain()
            await asyncio.sleep(5)

        async with _Server(hostile) as server:
            async with pod_forwarding(server.port) as (app, _):
                transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
                headers = {"X-Sandbox-ID": "claim-1", "X-Sandbox-Namespace": "team-a"}
                async with httpx.AsyncClient(transport=transport, base_url="http://b") as http:
                    answer = await http.request("CONNECT", "/", headers=headers)
                    assert answer.status_code == 400, answer.text
                    error = answer.json()
                    assert error["code"] == "invalid_method" and "CONNECT" in error["detail"]
                    assert server.requests == []
                    answer = await http.get("/endless", headers=headers)
                    assert answer.status_code == 502, answer.text
                    assert answer.json()["code"] == "sandbox_answer_lost", answer.text
                    answer = await http.get("/health", headers=headers)
                    assert (answer.status_code, answer.text) == (200, "ok")

    with _bounded(10):
        asyncio.run(main())


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["http-1.0-keep-alive", "keep-alive-and-close"],
)
def test_a_keep_alive_the_answer_cannot_promise_is_not_believed(answer: bytes) -> None:
    """An HTTP/1.0 answer's ``Connection: keep-alive`` (h11 keeps no HTTP/1.0 connection) and
    a ``close`` beside ``keep-alive``: the next request goes on a new connection. (Held.)"""

    async def main() -> None:
        async def lying(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()

        async with _Server(lying) as server:
            pool = server.pool()
            for _ in range(2):
                assert await _read(await pool.send(b"GET", b"/", [], None, TIMEOUT)) == b"ok"
            assert server.connections == 2

    asyncio.run(main())


def test_an_endless_chunked_answer_to_a_reader_that_stops_is_not_buffered() -> None:
    """Small chunks without end to a reader that took one and waits: the broker holds at most
    its read buffer (and a read) of them. (Held.)"""

    async def main() -> None:
        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"400\r\n" + b"c" * 1024 + b"\r\n")
                await writer.drain()

        async with _Server(endless) as server:
            pool = server.pool()
            answer = await pool.send(b"GET", b"/", [], None, TIMEOUT)
            chunks = answer.aiter_raw()
            await chunks.__anext__()
            await asyncio.sleep(0.5)
            (connection,) = pool._open
            held = len(connection.received) + len(connection.parser.buffer)
            assert held <= _http11.READ_BUFFER + 256 * 1024, held
            await answer.aclose()
            assert pool.connections == 0

    asyncio.run(main())
