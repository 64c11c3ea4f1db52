"""A loopback HTTPS server whose answers a test scripts, for what a real API server will not
do on demand: 5xx and 429 answers, redirects, a connection dropped before the answer, a watch
stream that stalls, an HTTP 410 before a watch's stream.

``ScriptedHTTPS(answer)`` serves on 127.0.0.1 with a certificate from a CA made at test time
(``ca_pem``); ``answer(request)`` returns a ``Reply`` for each request, and every request is
recorded in ``requests`` (method, target, headers, body). Use as an async context manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trustme


@dataclass(frozen=True)
class Seen:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Reply:
    """``status`` and a JSON ``body``; ``mode``: ``"answer"``, ``"drop"`` (close the
    connection without answering), ``"stall"`` (send the status line and headers of a chunked
    answer, then ``chunks``, then nothing until the client leaves), ``"trickle"`` (the whole
    answer, its body one byte every ``every`` seconds: each read gets a byte in time, the answer
    never ends in time); ``delay``: seconds to wait (without blocking the loop) before any of
    it. ``sent``: how many body bytes a trickle handed over so far (per reply)."""

    status: int = 200
    body: Any = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    mode: str = "answer"
    chunks: tuple[bytes, ...] = ()
    delay: float = 0.0
    every: float = 0.0
    sent: list[int] = field(default_factory=list, compare=False)


def status(code: int, reason: str, message: str = "") -> Reply:
    """A Kubernetes Status answer."""
    return Reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": reason, "message": message, "code": code})  # fmt: skip


class ScriptedHTTPS:
    def __init__(self, answer: Callable[[Seen], Reply]) -> None:
        self.answer = answer
        self.requests: list[Seen] = []
        self.ca = trustme.CA()
        self.ca_pem = self.ca.cert_pem.bytes()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.url = ""

    async def __aenter__(self) -> ScriptedHTTPS:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("127.0.0.1").configure_cert(context)
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=context)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"https://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while (seen := await self._read(reader)) is not None:
                self.requests.append(seen)
                reply = self.answer(seen)
                if reply.delay:
                    await asyncio.sleep(reply.delay)
                if reply.mode == "drop":
                    return
                if reply.mode == "stall":
                    writer.write(self._head(reply, chunked=True) + b"".join(
                        b"%x\r\n%s\r\n" % (len(c), c) for c in reply.chunks
                    ))  # fmt: skip
                    await writer.drain()
                    await reader.read()  # until the client gives up
                    return
                payload = json.dumps(reply.body).encode()
                if reply.mode == "trickle":
                    await self._trickle(writer, reply, payload)
                    continue
                writer.write(self._head(reply, length=len(payload)) + payload)
                await writer.drain()
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _trickle(self, writer: asyncio.StreamWriter, reply: Reply, payload: bytes) -> None:
        writer.write(self._head(reply, length=len(payload)))
        reply.sent.append(0)
        for index in range(len(payload)):
            await writer.drain()
            await asyncio.sleep(reply.every)
            writer.write(payload[index : index + 1])
            reply.sent[-1] += 1
        await writer.drain()

    @staticmethod
    def _head(reply: Reply, *, length: int = 0, chunked: bool = False) -> bytes:
        headers = {"Content-Type": "application/json", **reply.headers}
        headers.update(
            {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(length)}
        )
        lines = [f"HTTP/1.1 {reply.status} Scripted"] + [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> Seen | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, target, _ = request_line.split(" ", 2)
        headers = {
            k.strip().lower(): v.strip()
            for k, v in (line.split(":", 1) for line in header_lines if ":" in line)
        }
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return Seen(method, target, headers, body)
