"""Hostile port requests and their WebSockets at the broker (headers, duplicates, smuggling,
what reaches the user's server). Real requests against the loopback broker of tests/broker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.broker_api import tls_exchange
from tests._support.port_server import running_port_app


@pytest.fixture
def app_port() -> Iterator[int]:
    """The app on a free port of this host (a local sandbox's ports are the host's)."""
    with running_port_app() as port:
        yield port


def raw(broker: LocalBroker, head: bytes, body: bytes = b"") -> bytes:
    """``head`` + ``body`` sent to the broker over TLS as they are; the whole answer (a read
    that times out or breaks ends it)."""
    return tls_exchange(broker, head + body, lenient=True)


def head_of(alice: Any, sandbox: dict[str, Any], port: str, *lines: str, target: str) -> bytes:
    router = sandbox["router"]
    fields = [
        f"GET {target} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Authorization: Bearer {alice.token}",
        f"X-Sandbox-ID: {router['sandbox_id']}",
        f"X-Sandbox-Namespace: {router['namespace']}",
        f"X-Sandbox-Port: {port}",
        "Connection: close",
        *lines,
    ]
    return ("\r\n".join(fields) + "\r\n\r\n").encode("latin-1")


@pytest.mark.parametrize("port", ["\u00b2", "\u00b9\u00b2", "8\u00b3"])
def test_a_superscript_port_is_400_naming_the_header(alice: Any, port: str) -> None:
    """``str.isdigit()`` is true for the Latin-1 superscripts, which ``int()`` refuses: the
    broker answered 500 instead of the header's 400."""
    sandbox = alice.ready()
    answer = raw(alice.broker, head_of(alice, sandbox, port, target="/"))
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"invalid_header" in answer and b"X-Sandbox-Port" in answer


def test_no_credential_or_router_header_reaches_the_users_server(alice: Any, app_port: int) -> None:
    """Duplicated, odd-case and Connection-nominated credentials: none reaches the server."""
    sandbox = alice.ready()
    head = head_of(
        alice,
        sandbox,
        str(app_port),
        "authorization: Bearer second",
        "Proxy-Authorization: Basic c2VjcmV0",
        "Cookie: session=1",
        "cookie: other=2",
        "X-SANDBOX-ID: someone-else",
        "x-sandbox-port: 8888",
        target="/headers",
    )
    answer = raw(alice.broker, head)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    import json

    seen = {k.lower(): v for k, v in json.loads(answer.partition(b"\r\n\r\n")[2])["headers"]}
    leaked = {"authorization", "proxy-authorization", "cookie"} & set(seen)
    assert not leaked and not [k for k in seen if k.startswith("x-sandbox-")], seen
    assert alice.token not in answer.decode("latin-1")


@pytest.mark.parametrize(
    "framing",
    [
        ["Content-Length: 5", "Transfer-Encoding: chunked"],
        ["Transfer-Encoding: chunked", "Content-Length: 5"],
        ["Content-Length: 5", "Content-Length: 6"],
        ["Transfer-Encoding: gzip, chunked"],
        ["Transfer-Encoding: chunked, identity"],
    ],
)
def test_ambiguous_framing_never_reaches_the_server_as_two_requests(
    alice: Any, app_port: int, framing: list[str]
) -> None:
    sandbox = alice.ready()
    head = head_of(alice, sandbox, str(app_port), *framing, target="/echo").replace(
        b"GET /echo", b"POST /echo"
    )
    body = b"0\r\n\r\nGET /headers HTTP/1.1\r\nHost: x\r\n\r\n"
    answer = raw(alice.broker, head, body)
    assert answer.count(b"HTTP/1.1 ") <= 1, answer
    assert b'"path": "/headers"' not in answer


def test_no_credential_reaches_the_server_in_a_websocket_handshake(
    alice: Any, app_port: int
) -> None:
    """The server answers a handshake to /headers with 200 and the headers it got (relayed as
    the server's answer): the caller's credentials are not among them, and a subprotocol is
    passed on as the caller offered it (the broker takes its token only from Authorization)."""
    pytest.importorskip("websockets", reason="needs the [broker] extra (WebSocket upgrades)")
    sandbox = alice.ready()
    head = head_of(
        alice,
        sandbox,
        str(app_port),
        "Upgrade: websocket",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        "Sec-WebSocket-Protocol: chat",
        "Cookie: session=1",
        "Proxy-Authorization: Basic c2VjcmV0",
        "authorization: Bearer second",
        target="/headers",
    ).replace(b"Connection: close", b"Connection: Upgrade")
    answer = raw(alice.broker, head)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    import json

    body = answer.partition(b"\r\n\r\n")[2]
    seen = {k.lower(): v for k, v in json.loads(body[body.index(b"{") :])["headers"]}
    assert not {"authorization", "proxy-authorization", "cookie"} & set(seen), seen
    assert not [k for k in seen if k.startswith("x-sandbox-")], seen
    assert seen.get("sec-websocket-protocol") == "chat"
