"""``broker serve``'s HTTP/1.1 connections under a hostile client (llhttp, through uvicorn's
httptools protocol: ``broker/server/_httptools.py``), on a real process over real TLS.

What a review found, each checked here on the wire:

- **Trailers** (the fields after a chunked body's last chunk): httptools reports them through
  the same callback as the head's headers, and uvicorn appended them to the request's
  headers, so a trailer ``Authorization`` authenticated a request whose head had none
  (RFC 9110, 6.5.1: a recipient must not merge trailers into the header section; h11 dropped
  them). And a trailer value that never ended was held without limit (64 MiB sent: the
  broker 62 MiB larger, its other requests stalled by the copying); the head's 16 KiB counted
  the head only.
- **Pipelining**: llhttp parses every request of what one read brings, and uvicorn queued each
  with its scope, resuming reads after every answer: 64 MiB of ``GET /healthz`` pipelined
  (no token) grew the broker to 4.4 GiB. Now at most :data:`MAX_PIPELINED` requests wait
  behind the one being answered; the last of them is the connection's last answer. And a read
  that began inside one request's head and ended inside a later one's was counted as one
  head: a few pipelined requests were refused 431.
- **A caller that leaves with a request pipelined**: uvicorn told only the newest request's
  app (not the one answering) that its caller was gone, so a streamed answer went on being
  relayed from the sandbox to nobody. And a WebSocket handshake pipelined behind a request
  was answered before it (uvicorn handed the connection to its WebSocket protocol at once).
- **uvicorn's WebSocket lines** (``"WebSocket /path?query" [accepted]``, and each refusal's
  status) carried the target and its query string into the broker's messages.

No timed assertion: watchdogs far above what the broker needs.
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from k8s_agent_sandbox_awx import Sandbox
from tests._support.served_broker import ServedBroker, served_broker

pytest.importorskip("uvicorn", reason="needs the [broker] extra")

from k8s_agent_sandbox_awx.broker.server._limits import MAX_HEAD_BYTES, MAX_PIPELINED

WATCHDOG = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedBroker]:
    with served_broker(tmp_path_factory.mktemp("adversary")) as broker:
        yield broker


def tls_connect(broker: ServedBroker) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", broker.port), timeout=WATCHDOG)
    return broker.tls().wrap_socket(raw, server_hostname="127.0.0.1")


def read_until_closed(sock: ssl.SSLSocket, timeout: float = WATCHDOG) -> bytes:
    """Everything the broker sends until it closes (or ``timeout`` of silence)."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def statuses(answers: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", answers)]


# -- trailers ----------------------------------------------------------------------------------


def test_a_trailer_is_not_one_of_the_requests_headers(served: ServedBroker) -> None:
    """A token in a trailer (after the last chunk) does not authenticate: the head had none."""
    with tls_connect(served) as sock:
        sock.sendall(
            b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n0\r\nAuthorization: Bearer "
            + served.token().encode()
            + b"\r\n\r\n"
        )
        answer = read_until_closed(sock)
    assert statuses(answer) == [401], answer[:500]
    assert b"token_missing" in answer


def test_a_trailer_value_that_never_ends_is_cut_at_the_head_limit(served: ServedBroker) -> None:
    """A request whose app reads its body (a token: it is being answered, no deadline of the
    server's applies) and whose trailer's value never ends: 431 soon after the limit."""
    with tls_connect(served) as sock:
        sock.sendall(
            b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + served.token().encode() + b"\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: "
        )
        sent, answer = 0, b""
        with contextlib.suppress(OSError):
            while sent < 1_000_000 and not answer:
                sock.sendall(b"t" * 1024)
                sent += 1024
                sock.settimeout(0.01 if sent < MAX_HEAD_BYTES else 0.2)
                with contextlib.suppress(TimeoutError, ssl.SSLWantReadError):
                    answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), answer
    assert sent < 64 * 1024, sent


# -- pipelining --------------------------------------------------------------------------------

PADDED = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 2000 + b"\r\n\r\n"


def test_pipelined_requests_read_together_are_each_a_head_of_their_own(
    served: ServedBroker,
) -> None:
    """Twelve pipelined requests, 24 KiB, the middle ones in one write that begins inside the
    first's head and ends inside the last's: each is answered (no 431: no head is 16 KiB)."""
    stream = PADDED * 12
    with tls_connect(served) as sock:
        sock.sendall(stream[:10])
        time.sleep(0.3)  # three writes, so that the middle one is a read of its own
        sock.sendall(stream[10:-10])
        time.sleep(0.3)
        sock.sendall(stream[-10:-4] + b"\r\nConnection: close\r\n\r\n")
        answers = read_until_closed(sock)
    assert statuses(answers) == [200] * 12, answers[-300:]


def test_a_deep_pipeline_is_answered_up_to_the_limit_then_closed(served: ServedBroker) -> None:
    """1800 requests pipelined in one write (64 KiB): the one being answered and at most
    MAX_PIPELINED waiting behind it are answered, the last with ``connection: close``; the
    rest is dropped (before: every one queued at once, a scope each)."""
    one = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with tls_connect(served) as sock:
        with contextlib.suppress(OSError):  # the broker may close before the last is sent
            sock.sendall(one * (65536 // len(one)))
        answers = read_until_closed(sock)
    codes = statuses(answers)
    assert codes and set(codes) == {200}, answers[-300:]
    assert len(codes) <= MAX_PIPELINED + 1, (len(codes), answers[-300:])
    last = answers.rpartition(b"HTTP/1.1 200")[2]
    assert last.count(b"connection: close") == 1, (len(codes), answers[-300:])
    with tls_connect(served) as sock:  # and the broker serves on
        sock.sendall(one.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        assert statuses(read_until_closed(sock)) == [200]


# -- a caller that leaves ----------------------------------------------------------------------


@dataclass
class Streamer:
    """A sandbox's HTTP server on 127.0.0.1 (a local sandbox's ports are the host's) that
    streams a chunk every 0.1 s for ever; ``ended`` is set once the broker closes its side."""

    listener: socket.socket = field(default_factory=socket.socket)
    started: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            self.started.set()
            with contextlib.suppress(OSError):
                while not self.ended.wait(0.1):
                    conn.sendall(b"5\r\ntick\n\r\n")
            self.ended.set()


def test_a_caller_that_leaves_with_a_request_pipelined_ends_its_stream(
    served: ServedBroker,
) -> None:
    """A streamed answer (a port request), a request pipelined behind it, then the caller
    vanishes: the stream ends (the broker closes its connection to the sandbox's server).
    Before, it was relayed to nobody until it ended."""
    streamer = Streamer()
    try:
        with Sandbox.create(environ=served.environ()) as sandbox:
            token = {"Authorization": f"Bearer {served.token()}"}
            head = _head({**sandbox.ports.headers(streamer.port), **token})
            sock = tls_connect(served)
            sock.sendall(
                f"GET /stream HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode()
                + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"  # waits behind the stream
            )
            assert streamer.started.wait(WATCHDOG)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(1)  # the stream relayed for a while
            # the caller vanishes (a reset, as a crash or a network failure makes it)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            assert streamer.ended.wait(WATCHDOG), "the stream still relayed to nobody"
    finally:
        streamer.ended.set()
        streamer.listener.close()


HANDSHAKE = (
    "GET /v1/x HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
)


def test_a_websocket_handshake_pipelined_behind_a_request_is_refused(
    served: ServedBroker,
) -> None:
    """uvicorn handed the connection to its WebSocket protocol as soon as the handshake was
    parsed, so its answer came before the answer of the request sent first (a streamed port
    answer here): the caller, or a proxy that pipelines, would take one for the other. Now
    the handshake is a malformed request: 400, the connection closed."""
    streamer = Streamer()
    try:
        with Sandbox.create(environ=served.environ()) as sandbox:
            token = {"Authorization": f"Bearer {served.token()}"}
            head = _head({**sandbox.ports.headers(streamer.port), **token})
            with tls_connect(served) as sock:
                sock.sendall(
                    f"GET /stream HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + HANDSHAKE.encode()
                )
                answers = read_until_closed(sock, timeout=5)
            assert statuses(answers)[:1] == [400], answers[:300]
            assert b"not_found" not in answers, answers[:300]  # the WebSocket's answer
    finally:
        streamer.ended.set()
        streamer.listener.close()


def _head(headers: dict[str, str]) -> str:
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items())


# -- what uvicorn's lines carry ----------------------------------------------------------------


def test_a_websocket_handshake_logs_no_target(served: ServedBroker) -> None:
    """uvicorn's own line for each handshake ("WebSocket /path?query" and its status) is not
    among the broker's messages (the access log records the handshake, without the target)."""
    before = len(served.messages())
    with tls_connect(served) as sock:
        sock.sendall(
            b"GET /v1/whoami/HIDDEN-PATH?access_token=HIDDEN-QUERY HTTP/1.1\r\nHost: x\r\n"
            b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        answer = read_until_closed(sock)
    assert statuses(answer) == [404], answer[:300]
    time.sleep(0.5)  # what the broker logs after its answer
    logged = repr(served.messages()[before:]) + "".join(served.served.stdout)
    assert "HIDDEN" not in logged, logged[-2000:]


def test_the_uvicorn_hooks_the_protocol_overrides_exist() -> None:
    """The subclass overrides these of uvicorn's httptools protocol: one missing (a uvicorn
    outside the [broker] extra's range) would silently drop a limit, not fail."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from k8s_agent_sandbox_awx.broker.server._httptools import DeadlineHttpTools

    overridden = {
        name
        for name, value in vars(DeadlineHttpTools).items()
        if callable(value) and not name.startswith("__") and name in dir(HttpToolsProtocol)
    }
    expected = {
        "connection_made",
        "connection_lost",
        "data_received",
        "on_message_begin",
        "on_url",
        "on_header",
        "on_headers_complete",
        "on_body",
        "on_message_complete",
        "_start_asgi_task",
        "handle_websocket_upgrade",
        "send_400_response",
    }
    assert overridden == expected
