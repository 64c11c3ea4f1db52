"""The local forward listener against a hostile local client: another process on 127.0.0.1
may use the forward to reach ITS port (that is the design), never anything else the credential
it adds could reach (the runtime's API, another port, another sandbox), and a browser page that
reaches it under another host name (DNS rebinding) is refused."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e


def raw_exchange(port: int, head: bytes) -> bytes:
    """Send ``head`` to the forwarder as it is and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


SMUGGLED = [
    # a bare LF inside a header line: the broker's HTTP parser reads two headers
    b"GET / HTTP/1.1\r\nX-A: 1\nX-Sandbox-Port: 8888\r\n\r\n",
    # ... or inside the request line
    b"GET / HTTP/1.1\nX-Sandbox-Port:8888\r\n\r\n",
    # a bare CR
    b"GET / HTTP/1.1\r\nX-A: 1\rX-Sandbox-Port: 8888\r\n\r\n",
    # a folded (obs-fold) line, continuing a header the forwarder keeps
    b"GET / HTTP/1.1\r\nX-A: 1\r\n X-Sandbox-Port: 8888\r\n\r\n",
    # a NUL byte
    b"GET / HTTP/1.1\r\nX-A: 1\x00X-Sandbox-Port: 8888\r\n\r\n",
]


@pytest.mark.parametrize("head", SMUGGLED, ids=["lf-header", "lf-line", "cr", "fold", "nul"])
def test_a_local_client_cannot_smuggle_router_headers_past_the_forwarder(
    sandbox: Any, app_port: int, head: bytes
) -> None:
    """A header hidden in a line the forwarder keeps would come FIRST at the broker (before the
    forwarder's own X-Sandbox-Port) and point the added credential at the runtime's API: the
    forwarder refuses such a head itself, before anything is sent."""
    with sandbox.ports.forward(app_port) as forward:
        answer = raw_exchange(forward.port, head)
    status = answer.split(b"\r\n", 1)[0]
    assert status == b"HTTP/1.1 400 Bad Request", answer[:300]
    assert b"agent-sandbox-awx port forward:" in answer
    assert b'"status"' not in answer  # the runtime's GET / answer never came back


def test_the_forward_reaches_only_its_port_with_odd_headers(sandbox: Any, app_port: int) -> None:
    """The local client's own router headers in any case are dropped: the answer is the
    forwarded port's server's."""
    head = (
        b"GET /headers HTTP/1.1\r\nHost: 127.0.0.1\r\nx-SANDBOX-port: 8888\r\n"
        b"X-Sandbox-ID: other\r\nConnection: X-Sandbox-Port\r\n\r\n"
    )
    with sandbox.ports.forward(app_port) as forward:
        answer = raw_exchange(forward.port, head)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["path"] == "/headers"


REBOUND = ["evil.example", "evil.example:80", "127.0.0.1.nip.example", "localhost.evil.example"]


@pytest.mark.parametrize("host", REBOUND)
def test_a_rebound_host_name_is_refused(sandbox: Any, app_port: int, host: str) -> None:
    """A web page whose name was rebound to 127.0.0.1 sends its own name as Host: the forwarder
    would add the credential to its requests; it refuses them (421) instead."""
    with sandbox.ports.forward(app_port) as forward:
        answer = httpx.get(forward.url + "/headers", headers={"Host": host}, timeout=15)
        websocket = raw_exchange(
            forward.port,
            f"GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            "\r\n".encode(),
        )
    assert answer.status_code == 421
    assert "host" in answer.text.lower() and "127.0.0.1" in answer.text
    assert websocket.startswith(b"HTTP/1.1 421"), websocket[:200]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "LOCALHOST", None])
def test_loopback_host_names_are_served(sandbox: Any, app_port: int, host: str | None) -> None:
    with sandbox.ports.forward(app_port) as forward:
        name = f"{host}:{forward.port}" if host else None
        head = b"GET /headers HTTP/1.1\r\n" + (f"Host: {name}\r\n".encode() if name else b"")
        answer = raw_exchange(forward.port, head + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
