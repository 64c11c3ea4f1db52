"""The broker's bounds on WebSockets (issue 26, item 6), on ``broker serve`` as a real process:
its memory is the RSS of that process (``/proc/PID/status``), never the test's.

Before: nothing limited the WebSockets of one caller, and a message could be 16 MiB either
way; twelve WebSockets of one caller sending 15 MiB messages to a server that never reads grew
the broker by about 50 MiB each (598 MiB measured here). Now:

- a caller holds at most ``websocket_max_per_caller`` (16) WebSockets open at once; one more
  is ``429 websocket_limit`` naming the limit and its setting;
- a message is at most ``websocket_max_message_bytes`` (1 MiB) either way: a larger one closes
  the WebSocket with 1009, before the broker holds it;
- what one WebSocket holds while its receiver reads nothing is a few messages of that size:
  the figures below are the stated bounds for 100 of them (measured: about 3.0 MiB each
  towards a server that reads nothing, 4.8 MiB each towards a caller that reads nothing).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import Sandbox
from tests._support.served_broker import ServedBroker, raise_file_limit, served_broker
from tests._support.ws_client import WebSocket
from tests._support.ws_flood import Pusher, frame_head, open_caller
from tests._support.ws_peers import MIB, Server

pytest.importorskip("websockets", reason="needs the [broker] extra (WebSocket upgrades)")

MESSAGE = 1 * MIB
"""``websocket_max_message_bytes``' default."""
CONNECTIONS = 100
TOWARDS_A_SERVER_THAT_READS_NOTHING = 4 * MIB
"""What the broker may hold per WebSocket whose sandbox's server reads nothing: 3 messages
and 1 MiB (TLS and WebSocket buffers, the task), at most."""
TOWARDS_A_CALLER_THAT_READS_NOTHING = 6 * MIB
"""The same for a caller that reads nothing (the other way, the caller's side of the relay
holds a whole message more: its TLS connection's write buffer): 5 messages and 1 MiB."""
OVERSIZED_SLACK = 96 * MIB
"""What 100 WebSockets refused at their first (15 MiB) message may grow the broker by in all
(measured: about 45 MiB, what TLS read of each before the close, which the process keeps for
later; before the limit, 50 MiB each)."""


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedBroker]:
    """(Not ``broker``: the folder's conftest resets a fixture of that name.) The limit per
    caller is twice the WebSockets the tests open: one that ended still counts until the
    broker's connection to the server is closed too (up to CLOSE_TIMEOUT, 2 s, later)."""
    raise_file_limit(4 * CONNECTIONS + 200)
    with served_broker(tmp_path, websocket_max_per_caller=2 * CONNECTIONS) as broker:
        yield broker


@pytest.fixture
def headers(served: ServedBroker, server: Server) -> Iterator[dict[str, str]]:
    with Sandbox.create(environ=served.environ()) as sandbox:
        yield {**sandbox.ports.headers(server.port), "Authorization": f"Bearer {served.token()}"}


def connect(broker: ServedBroker, headers: dict[str, str], path: str) -> WebSocket:
    return open_caller(broker.url, str(broker.pki.ca_file), path, headers)


def warmed(broker: ServedBroker, headers: dict[str, str]) -> int:
    """The broker's RSS (KiB) after one WebSocket went through it (its first use imports and
    builds what every later one shares)."""
    ws = connect(broker, headers, "/echo")
    assert ws.head.startswith(b"HTTP/1.1 101"), ws.head
    ws.send(2, b"warm")
    assert ws.recv() == (2, b"warm")
    ws.close()
    ws.sock.close()
    time.sleep(0.5)
    return broker.rss_kib()


def growth_mib(broker: ServedBroker, base_kib: int) -> float:
    return (broker.rss_kib() - base_kib) / 1024


def close_code(ws: WebSocket) -> int | None:
    """The code of the close frame the broker sent (``None``: none came)."""
    try:
        ws.sock.settimeout(10)
        while True:
            opcode, payload = ws.recv()
            if opcode == 8:
                return int(struct.unpack("!H", payload[:2])[0]) if len(payload) >= 2 else 1005
    except OSError:
        return None


def test_the_issues_trial_100_websockets_sending_15_mib_messages(
    served: ServedBroker, server: Server, headers: dict[str, str]
) -> None:
    """100 WebSockets of one caller, each sending 15 MiB messages to a server that never
    reads: each is closed 1009 at its first message, and the broker holds none of its messages
    (before: about 50 MiB each)."""
    broker = served
    base = warmed(broker, headers)
    pushers: list[Pusher] = []
    for index in range(CONNECTIONS):
        ws = connect(broker, headers, "/sink")
        assert ws.head.startswith(b"HTTP/1.1 101"), (index, ws.head + ws._buffer)
        pushers.append(Pusher(ws, 15 * MIB).start())
        if index % 10 == 9:  # fail fast, before the machine runs short
            for pusher in pushers:
                pusher.done.wait(60)
            grown = growth_mib(broker, base)
            assert grown < OVERSIZED_SLACK / MIB, f"{grown:.0f} MiB for {index + 1} WebSockets"
    assert not any(p.held for p in pushers), "a 15 MiB message was taken"
    assert sum(p.sent for p in pushers) == 0
    grown = growth_mib(broker, base)
    print(f"100 WebSockets refused at their first 15 MiB message: {grown:.0f} MiB in all")
    assert grown < OVERSIZED_SLACK / MIB


def test_100_websockets_towards_a_server_that_reads_nothing(
    served: ServedBroker, server: Server, headers: dict[str, str]
) -> None:
    """Messages of the largest size allowed, as fast as the broker takes them: every
    WebSocket is held up (the broker stopped reading it) and the broker grows by at most
    TOWARDS_A_SERVER_THAT_READS_NOTHING for each."""
    broker = served
    base = warmed(broker, headers)
    pushers = []
    for _ in range(CONNECTIONS):
        ws = connect(broker, headers, "/sink")
        assert ws.head.startswith(b"HTTP/1.1 101"), ws.head
        pushers.append(Pusher(ws, MESSAGE).start())
    for pusher in pushers:
        assert pusher.done.wait(120)
    assert all(p.held for p in pushers), [p.ended for p in pushers if p.ended][:3]
    grown = growth_mib(broker, base)
    per = grown / CONNECTIONS
    print(f"towards a server that reads nothing: {grown:.0f} MiB, {per:.2f} MiB per WebSocket")
    assert grown * MIB < CONNECTIONS * TOWARDS_A_SERVER_THAT_READS_NOTHING, f"{per:.2f} MiB each"
    for pusher in pushers:
        pusher.ws.sock.close()


def test_100_websockets_towards_a_caller_that_reads_nothing(
    served: ServedBroker, server: Server, headers: dict[str, str]
) -> None:
    """The other way: the sandbox's server floods 1 MiB messages to callers that read none."""
    broker = served
    base = warmed(broker, headers)
    callers = []
    for _ in range(CONNECTIONS):
        ws = connect(broker, headers, "/flood?mib=32&message_mib=1")
        assert ws.head.startswith(b"HTTP/1.1 101"), ws.head
        callers.append(ws)
    deadline = time.monotonic() + 120
    while len(server.peers) < CONNECTIONS or _still_taking(server):
        assert time.monotonic() < deadline, "the floods did not settle"
    taken = sum(peer.sent for peer in server.peers)
    assert taken < CONNECTIONS * 32 * MIB, "the servers handed over every flood: no backpressure"
    grown = growth_mib(broker, base)
    per = grown / CONNECTIONS
    print(f"towards a caller that reads nothing: {grown:.0f} MiB, {per:.2f} MiB per WebSocket")
    assert grown * MIB < CONNECTIONS * TOWARDS_A_CALLER_THAT_READS_NOTHING, f"{per:.2f} MiB each"
    for ws in callers:
        ws.sock.close()


def _still_taking(server: Server, quiet: float = 3.0) -> bool:
    """Whether the floods' servers still hand bytes over (unchanged for ``quiet`` seconds:
    settled; no assertion on time, a slow machine only waits longer)."""
    before = sum(peer.sent for peer in server.peers)
    time.sleep(quiet)
    return sum(peer.sent for peer in server.peers) != before


def test_a_caller_holds_at_most_websocket_max_per_caller(tmp_path: Path, server: Server) -> None:
    """One more than the limit is ``429 websocket_limit`` (the broker's JSON, its error
    header), naming the limit and its setting; another caller is not affected; a closed
    WebSocket frees its slot."""
    with served_broker(tmp_path, websocket_max_per_caller=3) as broker:
        with (
            Sandbox.create(environ=broker.environ("alice")) as mine,
            Sandbox.create(environ=broker.environ("bob")) as theirs,
        ):
            alice = {
                **mine.ports.headers(server.port),
                "Authorization": f"Bearer {broker.token('alice')}",
            }
            bob = {
                **theirs.ports.headers(server.port),
                "Authorization": f"Bearer {broker.token('bob')}",
            }
            held = [connect(broker, alice, "/echo") for _ in range(3)]
            assert all(ws.head.startswith(b"HTTP/1.1 101") for ws in held)
            refused = connect(broker, alice, "/echo")
            status, head_lines, body = _answer(refused)
            assert status == 429, refused.head
            assert head_lines.get("agent-sandbox-broker-error") == "websocket_limit"
            assert body["code"] == "websocket_limit"
            assert "holds 3 open WebSockets" in body["detail"]
            assert "websocket_max_per_caller = 3" in body["detail"]
            other = connect(broker, bob, "/echo")
            assert other.head.startswith(b"HTTP/1.1 101"), other.head
            held[0].close()
            held[0].sock.close()
            deadline = time.monotonic() + 20
            while True:  # the slot is free once the broker saw the close
                again = connect(broker, alice, "/echo")
                if again.head.startswith(b"HTTP/1.1 101"):
                    break
                assert time.monotonic() < deadline, again.head
                time.sleep(0.1)
            again.send(1, b"still relayed")
            assert again.recv() == (1, b"still relayed")
            for ws in [*held[1:], other, again]:
                ws.sock.close()


def _answer(ws: WebSocket) -> tuple[int, dict[str, str], Any]:
    lines = ws.head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    body = ws._buffer
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        body += ws.sock.recv(65536)
    return status, headers, json.loads(body) if body else None


def test_a_message_over_the_limit_closes_the_websocket_with_1009(
    tmp_path: Path, server: Server
) -> None:
    """Either way: a caller's message over websocket_max_message_bytes is refused when its
    frame's head says so (the broker never reads it), a server's too."""
    with served_broker(tmp_path, websocket_max_message_bytes=64 * 1024) as broker:
        with Sandbox.create(environ=broker.environ()) as sandbox:
            headers = {
                **sandbox.ports.headers(server.port),
                "Authorization": f"Bearer {broker.token()}",
            }
            ws = connect(broker, headers, "/echo")
            ws.send(2, b"y" * (64 * 1024))  # at the limit: relayed
            assert ws.recv() == (2, b"y" * (64 * 1024))
            ws.sock.sendall(frame_head(64 * 1024 + 1))  # one byte over: its head is enough
            assert close_code(ws) == 1009
            ws.sock.close()
            flooded = connect(broker, headers, "/flood?mib=1&message_mib=1")
            assert flooded.head.startswith(b"HTTP/1.1 101"), flooded.head
            assert close_code(flooded) == 1009
            flooded.sock.close()
