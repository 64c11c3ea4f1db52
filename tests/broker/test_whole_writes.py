"""A small exchange in one write each way (docs/performance.md, "One write each way"):

- the runtime ends a whole answer's head and writes its body in one write (``send_whole``), so
  the broker reads the answer at once, not its head and then its body;
- the forward sends a request body that arrived whole with its head as bytes (one write with
  the head); a longer one still streams as it comes, and a client gone mid-body is
  ``ClientDisconnect`` as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from starlette.requests import ClientDisconnect, Request

from k8s_agent_sandbox_awx.broker.dataplane._forward import _forwarded_body
from k8s_agent_sandbox_awx.broker.runtime._http import send_json


class _Writes:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.writes.append(bytes(data))
        return len(data)


class _Exchange(BaseHTTPRequestHandler):
    """http.server's handler with no socket: what it writes is recorded."""

    def __init__(self, version: str = "HTTP/1.1") -> None:  # no socket, no request to parse
        self.wfile = _Writes()  # type: ignore[assignment]
        self.request_version = version
        self.close_connection = False
        self.requestline = "POST /execute HTTP/1.1"
        self.command, self.path = "POST", "/execute"

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_whole_answer_is_one_write() -> None:
    exchange = _Exchange()
    send_json(exchange, 200, {"exit_code": 0})  # type: ignore[arg-type]
    [write] = exchange.wfile.writes  # type: ignore[attr-defined]
    head, _, body = write.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 ") and b"\r\nContent-Length: 16" in head
    assert body == b'{"exit_code": 0}'


def test_an_answer_to_http_0_9_is_still_written() -> None:
    exchange = _Exchange("HTTP/0.9")
    send_json(exchange, 200, {})  # type: ignore[arg-type]
    assert b"".join(exchange.wfile.writes) == b"{}"  # type: ignore[attr-defined]


def _request(messages: list[dict[str, Any]], headers: dict[str, str]) -> Request:
    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/execute",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    return Request(scope, receive)


async def _all(body: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in body]


def test_a_body_that_came_whole_is_bytes_with_its_length() -> None:
    request = _request([{"type": "http.request", "body": b"{}", "more_body": False}],
                       {"content-length": "2"})  # fmt: skip
    headers: list[tuple[bytes, bytes]] = []
    assert asyncio.run(_forwarded_body(request, headers)) == b"{}"
    assert headers == [(b"content-length", b"2")]


@pytest.mark.parametrize("framing", [{"content-length": "4"}, {"transfer-encoding": "chunked"}])
def test_a_body_in_parts_streams_from_its_first(framing: dict[str, str]) -> None:
    messages = [
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
    ]

    async def main() -> list[bytes]:
        body = await _forwarded_body(_request(messages, framing), [])
        assert not isinstance(body, bytes)
        return await _all(body)

    assert asyncio.run(main()) == [b"ab", b"cd"]


def test_a_client_gone_mid_body_is_a_client_disconnect() -> None:
    messages = [
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def main() -> None:
        body = await _forwarded_body(_request(messages, {"content-length": "4"}), [])
        with pytest.raises(ClientDisconnect):
            await _all(body)

    asyncio.run(main())
