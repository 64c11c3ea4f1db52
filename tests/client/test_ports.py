"""``sandbox.ports``: a server in the sandbox reached through the broker (issue 23, "Ports").

End to end against the local broker over real HTTPS, both dialects, sync and async: a stdlib
server (``tests/_support/port_app.py``) started with ``commands.run(..., background=True)``,
reached through ``ports.client`` (and later ``ports.forward``)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import sys
import time
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox
from k8s_agent_sandbox_awx.errors import (
    BrokerNotFoundError,
    BrokerPermissionError,
    PortNotAllowedError,
    PortNotListeningError,
    UnsupportedOperationError,
)
from tests._support.port_server import APP, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("dialect")]


def test_client_reaches_the_server_without_the_token(sandbox: Any, app_port: int) -> None:
    with sandbox.ports.client(app_port) as client:
        answer = client.get("/headers", headers={"Cookie": "session=abc"})
    assert answer.status_code == 200
    seen = {k.lower(): v for k, v in answer.json()["headers"]}
    assert "authorization" not in seen and "cookie" not in seen  # stripped by the broker
    assert not any(k.startswith("x-sandbox-") for k in seen)
    assert answer.json()["path"] == "/headers"


def test_each_request_reaches_the_server_on_a_connection_of_its_own(
    sandbox: Any, app_port: int
) -> None:
    """No kept-alive connection to a user's server: a restarted server fails no request, and
    one that answers in several writes without TCP_NODELAY (this one, like ``python -m
    http.server``) does not stall 40 ms per request (Nagle against delayed ACKs)."""
    with sandbox.ports.client(app_port) as client:
        peers = [tuple(client.get("/headers").json()["peer"]) for _ in range(3)]
    assert len(set(peers)) == 3


def test_client_streams_a_chunked_answer(sandbox: Any, app_port: int) -> None:
    arrived: list[float] = []
    with (
        sandbox.ports.client(app_port) as client,
        client.stream("GET", "/stream") as answer,
    ):
        lines = []
        for line in answer.iter_lines():
            arrived.append(time.monotonic())
            lines.append(line)
    assert [line.split(":")[0] for line in lines] == ["chunk-0", "chunk-1", "chunk-2"]
    assert arrived[-1] - arrived[0] > 0.3  # streamed as it came, not buffered to the end


def test_post_body_and_redirect_not_followed(sandbox: Any, app_port: int) -> None:
    with sandbox.ports.client(app_port) as client:
        assert client.post("/echo", content=b"x" * 100_000).content == b"x" * 100_000
        redirect = client.get("/redirect")
    assert redirect.status_code == 302 and redirect.headers["location"] == "/headers"


def raw_request(broker: Any, sandbox: Any, port: int, target: bytes) -> tuple[int, bytes]:
    """``GET target`` to the broker over a TLS socket, byte for byte (httpx would resolve a
    dot segment before sending it): the status and the body."""
    url = httpx.URL(broker.url)
    token = sandbox.client.auth.get_credential(broker.url).token
    headers = {**sandbox.ports.headers(port), "Authorization": f"Bearer {token}"}
    head = b"GET " + target + b" HTTP/1.1\r\nHost: " + url.netloc + b"\r\n"
    head += b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
    context = ssl.create_default_context(cafile=broker.ca_bundle)
    with (
        socket.create_connection((url.host, url.port), 10) as plain,
        context.wrap_socket(plain, server_hostname=url.host) as sock,
    ):
        sock.sendall(head + b"Connection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def test_target_is_forwarded_as_sent_or_refused(
    sandbox: Any, app_port: int, dialect_broker: Any
) -> None:
    sent = b"/headers/a%2Fb/%2e%2e/c;d//e%5C?q=/../"
    status, body = raw_request(dialect_broker, sandbox, app_port, sent)
    assert status == 200 and json.loads(body)["path"] == sent.decode()  # byte for byte
    for dotted in (b"/headers/../x", b"/headers/./x", b"/a/.."):
        status, body = raw_request(dialect_broker, sandbox, app_port, dotted)
        assert status == 400, body
        refusal = json.loads(body)
        assert refusal["code"] == "path_not_normalized" and "'..' segment" in refusal["detail"]


def test_nothing_listening_is_a_typed_error(sandbox: Any) -> None:
    port = free_port()
    with sandbox.ports.client(port) as client, pytest.raises(PortNotListeningError) as info:
        client.get("/")
    assert info.value.port == port and info.value.code == "port_not_listening"
    assert f"nothing listens on port {port} in sandbox {sandbox.sandbox_id!r}" in str(info.value)
    assert "new sandbox" not in str(info.value)


def test_a_port_the_policy_forbids(sandbox: Any) -> None:
    with sandbox.ports.client(80) as client, pytest.raises(PortNotAllowedError) as info:
        client.get("/")
    assert info.value.status_code == 403 and info.value.port == 80
    assert "port 80" in str(info.value) and "1024-65535" in str(info.value)


def test_the_runtime_port_is_no_user_port(sandbox: Any) -> None:
    for call in (sandbox.ports.client, sandbox.ports.url, sandbox.ports.forward):
        with pytest.raises(ValueError, match="runtime's own port"):
            call(8888)
    with pytest.raises(TypeError):
        sandbox.ports.client("8000")


def test_another_callers_sandbox(dialect_broker: Any, sandbox: Any, app_port: int) -> None:
    other = dialect_broker.environ("kubernetes", namespace="team-b", service_account="other")
    with Sandbox.create(environ=other) as mine:
        headers = sandbox.ports.headers(app_port)
        with mine.ports.client(app_port) as client:
            client.headers.update(headers)  # someone else's sandbox, with my token
            with pytest.raises((BrokerPermissionError, BrokerNotFoundError)) as info:
                client.get("/headers")
    assert info.value.status_code in (403, 404)


def test_url_headers_and_get_host(sandbox: Any, app_port: int, dialect_broker: Any) -> None:
    url = sandbox.ports.url(app_port, "/headers")
    assert url == dialect_broker.url.rstrip("/") + "/headers"
    headers = sandbox.ports.headers(app_port)
    assert headers["X-Sandbox-Port"] == str(app_port)
    assert headers["X-Sandbox-ID"] == sandbox.sandbox_id
    assert "Authorization" not in headers
    token = sandbox.client.auth.get_credential(dialect_broker.url).token
    verify = ssl.create_default_context(cafile=dialect_broker.ca_bundle)
    answer = httpx.get(url, headers={**headers, "Authorization": f"Bearer {token}"}, verify=verify)
    assert answer.status_code == 200 and answer.json()["path"] == "/headers"
    with pytest.raises(UnsupportedOperationError, match=r"ports\.forward") as info:
        sandbox.ports.get_host(app_port)
    assert "no host of its own" in str(info.value)


def test_no_token_in_the_logs(
    sandbox: Any, app_port: int, dialect_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token = sandbox.client.auth.get_credential(dialect_broker.url).token
    with sandbox.ports.client(app_port) as client:
        assert client.get("/headers").status_code == 200
    assert any("port" in r.getMessage() for r in caplog.records)
    assert token.split(".")[2] not in caplog.text


def test_async_client(dialect_broker: Any) -> None:
    env = dialect_broker.environ("kubernetes")
    port = free_port()

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as sandbox:
            argv = [sys.executable, APP, str(port)]
            handle = await sandbox.commands.run(argv, timeout=300, background=True)
            async with sandbox.ports.client(port) as client:
                for _ in range(300):
                    try:
                        answer = await client.get("/headers")
                        break
                    except PortNotListeningError:
                        await asyncio.sleep(0.05)
                seen = {k.lower() for k, _ in answer.json()["headers"]}
                assert answer.status_code == 200 and "authorization" not in seen
                async with client.stream("GET", "/stream") as streamed:
                    body = b"".join([chunk async for chunk in streamed.aiter_bytes()])
                assert body.count(b"chunk-") == 3
                with pytest.raises(PortNotAllowedError):
                    await client.get("/", headers={"X-Sandbox-Port": "80"})
            with pytest.raises(UnsupportedOperationError):
                sandbox.ports.get_host(port)
            await handle.kill()

    asyncio.run(main())


def test_broker_refusal_body_is_json(sandbox: Any) -> None:
    port = free_port()
    with sandbox.ports.client(port) as client, pytest.raises(PortNotListeningError) as info:
        client.get("/")
    response = info.value.response
    assert response.headers["agent-sandbox-broker-error"] == "port_not_listening"
    assert json.loads(response.content)["code"] == "port_not_listening"
