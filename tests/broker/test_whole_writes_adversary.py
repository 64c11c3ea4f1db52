"""The data plane's whole writes (``Http11Answer.whole_body``, a request body sent as bytes)
against a hostile runtime and hostile callers, through the forward (pod data plane) driven as
the broker's server drives it (ASGI messages: a body whole in its first message, in parts, or
a caller gone before it).

- a caller gone before its body's first message: the forward sent the request's head (with the
  caller's ``Content-Length``) to the sandbox over a new connection, then dropped it; it is now
  ``ClientDisconnect`` before anything is sent (no connection, no command counted);
- and what held (regression tests): an answer that came whole with bytes after it (a second
  answer, or fewer bytes than its ``Content-Length``) is given whole and its connection never
  reused; one with more ``Content-Length`` than the runtime sent before closing, or a broken
  chunk that came with its head, drops the caller's connection (never a complete answer); a
  body past a ``HEAD``'s answer is neither relayed nor left on a reused connection; ``1xx``
  answers before a whole one are skipped; a caller's duplicate ``Content-Length`` reaches the
  runtime as one header; the access log counts a whole answer's bytes; a router's own
  "could not connect" ``502`` that came whole is still the broker's ``sandbox_unreachable`` up
  to ``MAX_ROUTER_ANSWER`` bytes (relayed past it); a caller gone mid-body closes the
  runtime's connection, none kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import RouteSettings
from k8s_agent_sandbox_awx.broker.dataplane._relay import DroppedConnection
from k8s_agent_sandbox_awx.broker.dataplane._unreachable import (
    MAX_ROUTER_ANSWER,
    ROUTER_NOT_CONNECTED,
)
from k8s_agent_sandbox_awx.broker.observability._access import Observed
from tests._support.loopback_runtime import LoopbackRuntime as _Server
from tests.broker.test_forward_pool_adversary import _bounded, pod_forwarding

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
DATA = [(b"x-sandbox-id", b"claim-1"), (b"x-sandbox-namespace", b"team-a")]


async def _drive(
    app: App,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    messages: list[dict[str, Any]],
) -> tuple[int, bytes, bool]:
    """One request as the broker's server gives it to the app: ``messages`` (then the caller's
    disconnect once the answer ended); its status, its body, and whether it ended."""
    sent: list[dict[str, Any]] = []
    ended = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await ended.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            ended.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"b"), *DATA, *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, ended.is_set()


def _whole(body: bytes) -> list[dict[str, Any]]:
    return [{"type": "http.request", "body": body, "more_body": False}]


async def _head_and_body(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            return head + await reader.readexactly(int(value))
    return head


def _runtime(answer: Callable[[bytes], bytes], after: bytes = b"") -> Any:
    """A runtime that answers each request (its head and body) with ``answer(request)`` and
    ``after`` in the same write."""

    def handler_of(server: list[_Server]) -> Any:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                request = await _head_and_body(reader)
                server[0].requests.append(request)
                writer.write(answer(request) + after)
                await writer.drain()

        return handler

    return handler_of


async def _serving(handler_of: Any) -> _Server:
    holder: list[_Server] = []
    made = _Server(lambda r, w: handler_of(holder)(r, w))
    holder.append(made)
    return made


def test_a_caller_gone_before_its_body_sends_nothing_to_the_sandbox() -> None:
    """The caller declared a body and left before any of it came: the forward connected to the
    runtime and sent the request's head, which promised a body that never came."""

    async def main() -> None:
        async with await _serving(_runtime(lambda _: OK)) as server:
            async with pod_forwarding(server.port) as (app, _):
                with pytest.raises(ClientDisconnect):
                    await _drive(
                        app,  # type: ignore[arg-type]
                        "POST",
                        "/execute",
                        [(b"content-length", b"20")],
                        [{"type": "http.disconnect"}],
                    )
                await asyncio.sleep(0.1)
                assert (server.connections, server.requests) == (0, [])

    with _bounded(10):
        asyncio.run(main())


@pytest.mark.parametrize(
    "after",
    [b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged", b"garbage"],
    ids=["a-second-answer", "more-than-its-length"],
)
def test_bytes_after_a_whole_answer_close_its_connection(after: bytes) -> None:
    async def main() -> None:
        async with await _serving(_runtime(lambda _: OK, after)) as server:
            async with pod_forwarding(server.port) as (app, _):
                for path in ("/first", "/second"):
                    got = await _drive(app, "GET", path, [], [])  # type: ignore[arg-type]
                    assert got == (200, b"ok", True)
                    await asyncio.sleep(0.05)
                assert server.connections == 2 and len(server.requests) == 2

    with _bounded(10):
        asyncio.run(main())


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nzz\r\n",
    ],
    ids=["less-than-its-length", "a-broken-chunk"],
)
def test_a_broken_answer_that_came_with_its_head_is_never_complete(answer: bytes) -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _head_and_body(reader)
            writer.write(answer)
            await writer.drain()
            writer.close()

        async with _Server(handler) as server:
            async with pod_forwarding(server.port) as (app, routes):
                with pytest.raises(DroppedConnection):
                    await _drive(app, "GET", "/download/a", [], [])  # type: ignore[arg-type]
                pools = routes._pods.values()  # type: ignore[attr-defined]
                assert [pool.connections for pool, _ in pools] == [0]

    with _bounded(10):
        asyncio.run(main())


def test_a_body_after_a_head_answer_is_not_relayed_nor_kept() -> None:
    def answer(request: bytes) -> bytes:
        if request.startswith(b"HEAD "):
            return b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged"
        return OK

    async def main() -> None:
        async with await _serving(_runtime(answer)) as server:
            async with pod_forwarding(server.port) as (app, _):
                got = await _drive(app, "HEAD", "/download/a", [], [])  # type: ignore[arg-type]
                assert got == (200, b"", True)
                await asyncio.sleep(0.05)
                got = await _drive(app, "GET", "/download/a", [], [])  # type: ignore[arg-type]
                assert got == (200, b"ok", True)
                assert server.connections == 2

    with _bounded(10):
        asyncio.run(main())


def test_informational_answers_before_a_whole_one_are_skipped_and_it_is_kept() -> None:
    early = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"

    async def main() -> None:
        async with await _serving(_runtime(lambda _: early + OK)) as server:
            async with pod_forwarding(server.port) as (app, _):
                for _ in range(2):
                    body = _whole(b'{"command": "true"}')
                    length = [(b"content-length", b"19")]
                    got = await _drive(app, "POST", "/execute", length, body)  # type: ignore[arg-type]
                    assert got == (200, b"ok", True)
                assert server.connections == 1
                assert all(r.endswith(b'{"command": "true"}') for r in server.requests)

    with _bounded(10):
        asyncio.run(main())


def test_a_callers_duplicate_content_length_reaches_the_runtime_once() -> None:
    async def main() -> None:
        async with await _serving(_runtime(lambda _: OK)) as server:
            async with pod_forwarding(server.port) as (app, _):
                twice = [(b"content-length", b"2"), (b"Content-Length", b"2")]
                got = await _drive(app, "POST", "/execute", twice, _whole(b"{}"))  # type: ignore[arg-type]
                assert got == (200, b"ok", True)
                [request] = server.requests
                lengths = [
                    line
                    for line in request.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ]
                assert lengths == [b"content-length: 2"] and request.endswith(b"\r\n\r\n{}")

    with _bounded(10):
        asyncio.run(main())


def test_the_access_log_counts_a_whole_answers_bytes() -> None:
    lines: list[dict[str, Any]] = []

    class Lines:
        failures = 0

        def write(self, record: dict[str, Any]) -> None:
            lines.append(dict(record))

    async def main() -> None:
        async with await _serving(_runtime(lambda _: OK)) as server:
            async with pod_forwarding(server.port) as (app, _):
                observed = Observed(app, access=Lines())  # type: ignore[arg-type]
                got = await _drive(
                    observed, "POST", "/execute", [(b"content-length", b"2")], _whole(b"{}")
                )  # type: ignore[arg-type]
                assert got == (200, b"ok", True)

    asyncio.run(main())
    [line] = lines
    assert (line["status"], line["bytes_in"], line["bytes_out"], line["end"]) == (
        200, 2, 2, "complete"
    ), line  # fmt: skip


def router_forwarding(port: int) -> contextlib.AbstractAsyncContextManager[tuple[Any, Any]]:
    """:func:`pod_forwarding` through an ``http://`` router at 127.0.0.1:``port``."""
    router = f"http://127.0.0.1:{port}"
    return pod_forwarding(
        port, RouteSettings(data_plane="router", router_url=router, allow_loopback_pod_ips=True)
    )


@pytest.mark.parametrize("size", [MAX_ROUTER_ANSWER, MAX_ROUTER_ANSWER + 1])
def test_a_routers_not_connected_answer_that_came_whole_is_still_the_brokers(size: int) -> None:
    """Upstream's router's ``502`` for a sandbox it could not reach, written in one piece: up to
    :data:`MAX_ROUTER_ANSWER` bytes it is the broker's ``sandbox_unreachable``, past it the
    router's answer relayed whole (the whole-body path skips neither check)."""

    def answer(request: bytes) -> bytes:
        sent = next(
            line.split(b":", 1)[1].strip()
            for line in request.split(b"\r\n")
            if line.lower().startswith(b"x-sandbox-id:")
        )
        detail = json.dumps({"detail": ROUTER_NOT_CONNECTED + sent.decode(), "pad": ""})
        body = (detail[:-2] + "x" * (size - len(detail)) + '"}').encode()
        assert len(body) == size
        return b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: %d\r\n\r\n%s" % (size, body)

    async def main() -> None:
        async with await _serving(_runtime(answer)) as server:
            async with router_forwarding(server.port) as (app, _):
                status, body, ended = await _drive(app, "GET", "/download/a", [], [])  # type: ignore[arg-type]
                assert (status, ended) == (502, True)
                assert len(server.requests) == 1
                mapped = json.loads(body).get("code") == "sandbox_unreachable"
                assert mapped is (size <= MAX_ROUTER_ANSWER), body[:200]
                assert mapped or len(body) == size
                assert not mapped or b"could not connect" in body, body

    with _bounded(10):
        asyncio.run(main())


def test_a_caller_gone_mid_body_closes_the_runtimes_connection() -> None:
    """The caller declared 20 bytes, sent 2, and left: the runtime's connection is closed (its
    request never ends: nothing runs), none is kept in the pool. (Held.)"""
    got: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"\r\n\r\n"))
        got.append(await reader.read())  # to the end: the broker closed the connection

    async def main() -> None:
        async with _Server(handler) as server:
            async with pod_forwarding(server.port) as (app, routes):
                messages = [
                    {"type": "http.request", "body": b"{}", "more_body": True},
                    {"type": "http.disconnect"},
                ]
                with pytest.raises(ClientDisconnect):
                    length = [(b"content-length", b"20")]
                    await _drive(app, "POST", "/execute", length, messages)  # type: ignore[arg-type]
                for _ in range(50):
                    if len(got) == 2:
                        break
                    await asyncio.sleep(0.02)
                assert b"\r\ncontent-length: 20\r\n" in got[0] and got[1:] == [b"{}"]
                pools = routes._pods.values()  # type: ignore[attr-defined]
                assert [pool.connections for pool, _ in pools] == [0]

    with _bounded(10):
        asyncio.run(main())
