"""The local forwarder's own limits (issue 26, item 9): one deadline for a request head,
counted from the accept (a byte a second held a connection, and its thread, as long as it
went on: the timeout was per ``recv()``), and a bound on the connections, so on the threads,
that one forward holds (every connection had two threads, without a limit).

No broker is needed: a head that arrives is forwarded to a broker that is not there (the
credential source fails first: ``502``); what is checked here ends before that.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from k8s_agent_sandbox_awx.client import _port_forward
from k8s_agent_sandbox_awx.client._port_forward import ForwardTarget, PortForward

HEAD = b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"p" * 40 + b"\r\n\r\n"


def _no_credential() -> Any:
    raise RuntimeError("no credential in this test")


@pytest.fixture
def forward() -> Iterator[PortForward]:
    target = ForwardTarget(
        config=SimpleNamespace(broker_url="https://127.0.0.1:9"),
        headers={"X-Sandbox-ID": "sbx-test"},
        source=_no_credential,
        port=3000,
        sandbox="sbx-test",
    )
    with PortForward(target) as running:
        yield running


def answer_of(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def own_threads(forward: PortForward) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"port-forward-{forward.port}")]


def test_a_trickled_head_gets_408_at_one_deadline_from_the_accept(
    forward: PortForward, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte every 0.2 s: every ``recv()`` gets one in time, the head never arrives in time.
    The forwarder answers ``408`` at its deadline, long before the head's end (before the fix
    it waited for the whole head and forwarded it)."""
    monkeypatch.setattr(_port_forward, "HEAD_SECONDS", 1.0)
    with socket.create_connection(("127.0.0.1", forward.port), timeout=30) as sock:
        sent = 0
        while sent < len(HEAD) and not answered(sock):
            sock.sendall(HEAD[sent : sent + 1])
            sent += 1
            time.sleep(0.2)
        answer = answer_of(sock)
    assert sent < len(HEAD), f"the forwarder read the whole trickled head: {answer[:80]!r}"
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b"the request head did not arrive within 1 s of the connection" in answer


def test_a_silent_connection_gets_408_at_the_deadline_and_frees_its_thread(
    forward: PortForward, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_port_forward, "HEAD_SECONDS", 0.5)
    with socket.create_connection(("127.0.0.1", forward.port), timeout=30) as sock:
        assert answer_of(sock).startswith(b"HTTP/1.1 408")
    deadline = time.monotonic() + 10
    while len(own_threads(forward)) > 1:  # the acceptor only
        assert time.monotonic() < deadline, own_threads(forward)
        time.sleep(0.02)


def test_the_connections_and_threads_of_a_forward_are_bounded(forward: PortForward) -> None:
    """:data:`MAX_CONNECTIONS` connections that send nothing hold their threads (until the
    head's deadline); one more is answered ``503`` at once, naming the bound; the threads stay
    within 1 + 2 x MAX_CONNECTIONS; once they end, the forward serves again."""
    bound = _port_forward.MAX_CONNECTIONS
    held = [socket.create_connection(("127.0.0.1", forward.port), timeout=30) for _ in range(bound)]
    try:
        extra = [
            socket.create_connection(("127.0.0.1", forward.port), timeout=30) for _ in range(8)
        ]
        answers = [answer_of(sock) for sock in extra]
        for sock in extra:
            sock.close()
        assert all(a.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") for a in answers), answers
        assert f"at most {bound} connections at once".encode() in answers[0]
        assert len(own_threads(forward)) <= 1 + 2 * bound
        assert not any(answered(sock) for sock in held)  # the held ones are still served
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # their slots are free again: a head is forwarded (to no broker: 502)
        with socket.create_connection(("127.0.0.1", forward.port), timeout=30) as sock:
            sock.sendall(HEAD)
            answer = answer_of(sock)
        if not answer.startswith(b"HTTP/1.1 503"):
            break
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)
    assert answer.startswith(b"HTTP/1.1 502"), answer
