"""``sandbox.ports.forward``: a local listener without a token, forwarding HTTP and WebSockets to
a sandbox's port through the broker (issue 23), end to end against the local broker over real
HTTPS, both dialects, sync and async."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import AsyncSandbox
from tests._support import ws_client
from tests._support.port_server import APP, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("dialect")]


def test_plain_httpx_through_the_forward(sandbox: Any, app_port: int) -> None:
    with sandbox.ports.forward(app_port) as forward:
        assert forward.url == f"http://127.0.0.1:{forward.port}"
        answer = httpx.get(
            forward.url + "/headers", headers={"Authorization": "Bearer mine", "Cookie": "a=b"}
        )
        assert answer.status_code == 200
        seen = {k.lower(): v for k, v in answer.json()["headers"]}
        assert "authorization" not in seen and "cookie" not in seen
        posted = httpx.post(forward.url + "/echo", content=b"y" * 300_000)
        assert posted.content == b"y" * 300_000
        assert httpx.get(forward.url + "/redirect").status_code == 302  # the server's answer
        with httpx.Client() as keep_alive:  # several requests from one client
            for _ in range(3):
                assert keep_alive.get(forward.url + "/headers").status_code == 200
        port = forward.port
        names = {t.name for t in threading.enumerate()}
        assert f"port-forward-{port}" in names  # the acceptor, by its name
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/headers")  # the listener is gone
    left = [t.name for t in threading.enumerate() if t.name.startswith(f"port-forward-{port}")]
    assert left == []  # every thread of the forwarder joined


def test_streamed_answer_through_the_forward(sandbox: Any, app_port: int) -> None:
    with (
        sandbox.ports.forward(app_port) as forward,
        httpx.stream("GET", forward.url + "/stream") as answer,
    ):
        arrived = [time.monotonic() for _ in answer.iter_lines()]
    assert len(arrived) == 3 and arrived[-1] - arrived[0] > 0.3


def test_nothing_listening_through_the_forward(sandbox: Any) -> None:
    port = free_port()
    with sandbox.ports.forward(port) as forward:
        answer = httpx.get(forward.url + "/")
    assert answer.status_code == 502
    assert answer.json()["code"] == "port_not_listening"
    assert f"nothing listens on port {port}" in answer.json()["detail"]


def test_websocket_echo_through_the_forward(sandbox: Any, app_port: int) -> None:
    with sandbox.ports.forward(app_port) as forward:
        ws = ws_client.connect("127.0.0.1", forward.port, "/ws")
        assert ws.head.startswith(b"HTTP/1.1 101"), ws.head
        ws.send(1, b"hello")
        assert ws.recv() == (1, b"hello")
        big = bytes(range(256)) * 400  # 100 KiB, binary
        ws.send(2, big)
        assert ws.recv() == (2, big)
        ws.send(1, b"close:4001")  # the server closes with 4001: passed on
        opcode, payload = ws.recv()
        assert opcode == 8 and struct.unpack("!H", payload[:2])[0] == 4001
        ws.sock.close()
        second = ws_client.connect("127.0.0.1", forward.port, "/ws")
        second.send(1, b"again")
        assert second.recv() == (1, b"again")
        opcode, payload = second.close(4002)  # the client's close code reaches the server
        assert opcode == 8 and struct.unpack("!H", payload[:2])[0] == 4002
        second.sock.close()


def test_websocket_traffic_both_ways_at_once_through_the_forward(
    sandbox: Any, app_port: int
) -> None:
    """Frames sent from one thread while another reads the echoes: the forwarder's two threads
    read and write the broker connection's TLS at once (each direction 3 MiB, more than the
    socket buffers hold, so each waits on the other)."""
    frames = [bytes([n]) * 32 * 1024 for n in range(96)]
    with sandbox.ports.forward(app_port) as forward:
        ws = ws_client.connect("127.0.0.1", forward.port, "/ws")
        assert ws.head.startswith(b"HTTP/1.1 101"), ws.head
        sender = threading.Thread(target=lambda: [ws.send(2, frame) for frame in frames])
        sender.start()
        echoed = [ws.recv() for _ in frames]
        sender.join(30)
        assert echoed == [(2, frame) for frame in frames]
        ws.close(1000)
        ws.sock.close()


def test_a_client_that_half_closes_after_its_request_gets_the_answer(
    sandbox: Any, app_port: int
) -> None:
    """``nc -N`` and ``printf ... | nc -q`` send the request, then shut their sending side: the
    end of the request is not the end of the answer."""
    with sandbox.ports.forward(app_port) as forward:
        client = socket.create_connection(("127.0.0.1", forward.port), 30)
        body = b"half" * 1000
        client.sendall(
            b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        client.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
        client.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert answer.endswith(body)


def test_websocket_to_nothing_listening_is_refused(sandbox: Any) -> None:
    with sandbox.ports.forward(free_port()) as forward:
        ws = ws_client.connect("127.0.0.1", forward.port, "/ws")
        ws.sock.close()
    assert ws.head.startswith(b"HTTP/1.1 502")
    assert b"agent-sandbox-broker-error: port_not_listening" in ws.head.lower()


def test_a_stuck_local_client_never_freezes_the_forwarder(sandbox: Any, app_port: int) -> None:
    with sandbox.ports.forward(app_port) as forward:
        silent = socket.create_connection(("127.0.0.1", forward.port))
        silent.sendall(b"GET /headers HTTP/1.1\r\n")  # half a head, then nothing
        reader = socket.create_connection(("127.0.0.1", forward.port))
        reader.sendall(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # and never read
        assert httpx.get(forward.url + "/headers", timeout=10).status_code == 200
        started = time.monotonic()
    assert time.monotonic() - started < 8  # the exit ended both and joined their threads
    for sock in (silent, reader):
        sock.close()


def test_no_token_in_the_forwarders_logs(
    sandbox: Any, app_port: int, dialect_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token = sandbox.client.auth.get_credential(dialect_broker.url).token
    with sandbox.ports.forward(app_port) as forward:
        assert httpx.get(forward.url + "/headers").status_code == 200
        assert token not in repr(forward)
    assert any("forwarding" in r.getMessage() for r in caplog.records)
    assert token.split(".")[2] not in caplog.text and "Bearer" not in caplog.text


def test_async_forward(dialect_broker: Any) -> None:
    env = dialect_broker.environ("kubernetes")
    port = free_port()

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as sandbox:
            argv = [sys.executable, APP, str(port)]
            handle = await sandbox.commands.run(argv, timeout=300, background=True)
            async with sandbox.ports.forward(port) as forward, httpx.AsyncClient() as http:
                for _ in range(300):
                    answer = await http.get(forward.url + "/headers")
                    if answer.status_code != 502:
                        break
                    await asyncio.sleep(0.05)
                assert answer.status_code == 200
                seen = {k.lower() for k, _ in answer.json()["headers"]}
                assert "authorization" not in seen
                ws = await asyncio.to_thread(ws_client.connect, "127.0.0.1", forward.port, "/ws")
                ws.send(1, b"async")
                assert await asyncio.to_thread(ws.recv) == (1, b"async")
                ws.sock.close()
            await handle.kill()

    asyncio.run(main())


def test_a_credential_failure_is_a_plain_502_to_the_local_client(
    sandbox: Any, app_port: int
) -> None:
    class Failing:
        def get_credential(self, audience: str) -> Any:
            raise RuntimeError("the token file is unreadable")

        def invalidate(self, audience: str) -> None:
            return None

    transport = sandbox.client._transport
    kept, transport.auth = transport.auth, Failing()
    try:
        with sandbox.ports.forward(app_port) as forward:
            answer = httpx.get(forward.url + "/headers", timeout=10)
    finally:
        transport.auth = kept
    assert answer.status_code == 502
    assert "RuntimeError: the token file is unreadable" in answer.text
    assert "agent-sandbox-broker-error" not in answer.headers  # the forwarder's own answer
