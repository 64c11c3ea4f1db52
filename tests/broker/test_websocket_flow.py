"""Flow control of the broker's WebSocket relay (the guide's network-safety rule): a peer that
stops reading holds up only what is sent to it, and the broker never buffers for it without
bound: the relay stops pulling from the sender (backpressure), it does not keep what the
receiver does not take.

The sandbox's server and the callers are plain sockets with small kernel buffers
(``tests/_support/ws_peers.py``). What the broker holds is measured as the Python memory the
process allocated meanwhile (``tracemalloc``: the local broker runs in this process; the
kernel's socket buffers, which the broker does not choose, are not in it); how much the sender
got rid of is checked too: it was held up, it did not hand over what it offered."""

from __future__ import annotations

import socket
import ssl
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support import ws_client
from tests._support.ws_peers import MIB, Peer, Server, small_buffers

pytest.importorskip("websockets", reason="needs the [broker] extra (WebSocket upgrades)")

OFFERED = 64 * MIB
MESSAGE = 1 * MIB
HELD_AT_MOST = 12 * MIB
"""What the process may hold while a receiver reads nothing: a few messages in flight (the
broker's, and the test's own peers' copies of the one they are sending), far below what was
offered. Without flow control the broker held 16 messages more."""


@pytest.fixture
def traced() -> Iterator[Callable[[], int]]:
    """The Python memory allocated since the test began, while it runs."""
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    yield lambda: tracemalloc.get_traced_memory()[0] - baseline
    tracemalloc.stop()


@pytest.fixture
def sandbox_headers(alice: Any, server: Server) -> dict[str, str]:
    sandbox = alice.ready()
    headers: dict[str, str] = alice.data_headers(sandbox, **{"X-Sandbox-Port": str(server.port)})
    return {**headers, "Authorization": f"Bearer {alice.token}"}


def caller(broker: LocalBroker, headers: dict[str, str], path: str) -> ws_client.WebSocket:
    """A caller's WebSocket through the broker, its socket's kernel buffers small."""
    url = urlsplit(broker.url)
    host, port = url.hostname or "127.0.0.1", url.port or 443
    plain = small_buffers(socket.socket())
    plain.settimeout(30)
    plain.connect((host, port))
    context = ssl.create_default_context(cafile=broker.ca_bundle)
    sock = context.wrap_socket(plain, server_hostname=host)
    ws = ws_client.handshake(sock, host, port, path, headers)
    assert ws.head.startswith(b"HTTP/1.1 101"), ws.head
    return ws


def settled(progress: Callable[[], int], done: Callable[[], bool]) -> int:
    """``progress()`` once it stopped growing (unchanged for two seconds) or ``done()``: what a
    sender got rid of before the flow stopped (no assertion on time: a slow machine only
    waits longer)."""
    last, since = progress(), time.monotonic()
    while not done():
        time.sleep(0.1)
        now = progress()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 2.0:
            break
    return progress()


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_caller_that_stops_reading_holds_up_only_its_own_direction(
    broker: LocalBroker,
    server: Server,
    sandbox_headers: dict[str, str],
    traced: Callable[[], int],
) -> None:
    """The sandbox's server floods a caller that reads nothing: the broker stops taking from
    the server once the caller's side is full (the server's sends block) and holds a few
    messages, not the flood; meanwhile the caller's messages still reach the server, and the
    server's other clients are served."""
    slow = caller(broker, sandbox_headers, f"/flood?mib={OFFERED // MIB}&message_mib=1")
    until(lambda: bool(server.peers), "the flood's connection reached the server")
    flood: Peer = server.peers[0]
    taken = settled(lambda: flood.sent, flood.done.is_set)
    held = traced()
    assert taken < OFFERED, "the server handed over the whole flood: no backpressure"
    assert held < HELD_AT_MOST, f"{held / MIB:.1f} MiB held for a caller that reads nothing"

    for i in range(3):  # the other direction still flows
        slow.send(1, f"still flowing {i}".encode())
    until(lambda: len(flood.received) == 3, "the caller's messages reached the server")
    assert flood.received == [f"still flowing {i}".encode() for i in range(3)]
    other = caller(broker, sandbox_headers, "/echo")  # the server's other clients are served
    other.send(2, b"another client")
    assert other.recv() == (2, b"another client")
    assert other.close()[0] == 8
    # the flood is still held up (a message or two more may have moved on a busy machine,
    # where "stopped growing for 2 s" came early): nowhere near what was offered
    assert not flood.done.is_set() and flood.sent <= taken + 2 * MESSAGE < OFFERED
    slow.sock.close()


def test_a_sandbox_that_stops_reading_holds_up_the_caller_not_the_broker(
    broker: LocalBroker,
    server: Server,
    sandbox_headers: dict[str, str],
    traced: Callable[[], int],
) -> None:
    """A caller sends to a server that reads nothing: the broker stops taking from the caller
    (its sends block) and holds a few messages, not what the caller offered."""
    ws = caller(broker, sandbox_headers, "/sink")
    sent = [0]
    finished = threading.Event()
    payload = b"y" * MESSAGE

    def push() -> None:
        try:
            for _ in range(OFFERED // MESSAGE):
                ws.send(2, payload)
                sent[0] += MESSAGE
        except OSError:
            pass  # the socket closed at the test's end
        finally:
            finished.set()

    threading.Thread(target=push, daemon=True).start()
    taken = settled(lambda: sent[0], finished.is_set)
    held = traced()
    assert taken < OFFERED, "the caller handed over everything: no backpressure"
    assert held < HELD_AT_MOST, f"{held / MIB:.1f} MiB held for a server that reads nothing"
    ws.sock.close()


RELEASED_WITHIN = 8.0
"""How long a stuck server's connection may outlive its caller: well above the broker's close
timeout (2 s), below websockets' default (10 s) that held it before."""


def test_a_stuck_servers_connection_is_released_soon_after_the_caller_leaves(
    broker: LocalBroker, server: Server, sandbox_headers: dict[str, str]
) -> None:
    """The caller leaves; the sandbox's server never answers the broker's close: the broker
    drops its connection to the server once its close timeout
    (:data:`..._websocket.CLOSE_TIMEOUT`) passed, not websockets' default 10 s."""
    from k8s_agent_sandbox_awx.broker.dataplane import _websocket

    ws = caller(broker, sandbox_headers, "/mute")
    until(lambda: bool(server.peers), "the connection reached the server")
    mute: Peer = server.peers[0]
    ws.send(1, b"before leaving")
    until(lambda: mute.received == [b"before leaving"], "the message reached the server")
    ws.sock.close()  # the caller leaves
    assert mute.done.wait(RELEASED_WITHIN), "the broker still holds the stuck server's connection"
    assert _websocket.CLOSE_TIMEOUT * 2 <= RELEASED_WITHIN  # the bound stays generous
