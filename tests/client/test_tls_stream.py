"""The port forward's upstream TLS: one thread reads while another writes, over real TLS on
loopback (a CA made here), which an ``ssl.SSLSocket`` must not be used for (OpenSSL's connection
object is not thread-safe; the forwarder once crashed so)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from k8s_agent_sandbox_awx.client import _port_forward
from k8s_agent_sandbox_awx.client._tls_stream import TlsStream
from k8s_agent_sandbox_awx.client.http._config import BrokerConnectionConfig

Handler = Callable[[ssl.SSLSocket], None]


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def serve(ca: trustme.CA) -> Iterator[Callable[[Handler], int]]:
    """``serve(handler)``: a TLS listener on loopback whose one connection ``handler`` runs
    (in one thread of its own); its port."""
    threads: list[threading.Thread] = []
    listeners: list[socket.socket] = []

    def start(handler: Handler) -> int:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def run() -> None:
            conn, _ = listener.accept()
            conn.settimeout(30)
            try:
                tls = context.wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError):  # a client that refused the certificate
                conn.close()
                return
            with tls:
                handler(tls)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        return int(listener.getsockname()[1])

    yield start
    for listener in listeners:
        listener.close()
    for thread in threads:
        thread.join(10)


def _client(ca: trustme.CA, port: int) -> TlsStream:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    raw = socket.create_connection(("127.0.0.1", port), 10)
    stream = TlsStream(raw, context, server_hostname="127.0.0.1")
    stream.handshake(10)
    raw.settimeout(30)
    return stream


def _echo(tls: ssl.SSLSocket) -> None:
    """Read and write back in one thread: the client must read while it writes, or both stall
    once the socket buffers are full."""
    with contextlib.suppress(OSError):  # the client may cut the connection
        while chunk := tls.recv(65536):
            tls.sendall(chunk)


def test_one_thread_writes_while_another_reads(ca: trustme.CA, serve: Any) -> None:
    """32 MiB each way at once: far more than the socket buffers hold, so the writer is
    blocked by the peer while the reader works, on one TLS state."""
    stream = _client(ca, serve(_echo))
    total = 32 * 1024 * 1024
    block = os.urandom(1024 * 1024)
    sent = hashlib.sha256()
    failed: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(total // len(block)):
                stream.sendall(block)
                sent.update(block)
        except BaseException as exc:  # the assertion below names it
            failed.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    got, received = hashlib.sha256(), 0
    while received < total:
        chunk = stream.recv(65536)
        assert chunk, f"the stream ended after {received} of {total} bytes"
        got.update(chunk)
        received += len(chunk)
    writer.join(30)
    assert not failed and not writer.is_alive()
    assert got.hexdigest() == sent.hexdigest()
    stream.shutdown(socket.SHUT_RDWR)
    stream.close()


def test_the_end_of_the_stream_is_an_empty_read(ca: trustme.CA, serve: Any) -> None:
    def closes_cleanly(tls: ssl.SSLSocket) -> None:
        tls.sendall(b"bye")
        with contextlib.suppress(ssl.SSLError):  # the client closes without answering
            tls.unwrap()  # close_notify

    def just_closes(tls: ssl.SSLSocket) -> None:
        tls.sendall(b"bye")
        socket.socket.shutdown(tls, socket.SHUT_RDWR)  # no close_notify (a ragged end)

    for handler in (closes_cleanly, just_closes):
        stream = _client(ca, serve(handler))
        data = b""
        while chunk := stream.recv(10):
            data += chunk
        assert data == b"bye", handler.__name__
        stream.close()


def test_a_certificate_of_another_ca_fails_the_handshake(serve: Any) -> None:
    port = serve(lambda tls: None)
    with pytest.raises(ssl.SSLCertVerificationError):
        _client(trustme.CA(), port)


def test_the_forwarder_connects_to_an_https_broker_with_a_tls_stream(
    ca: trustme.CA, serve: Any, tmp_path: Path
) -> None:
    """The forwarder's upstream is a :class:`TlsStream` (its two threads share it), never an
    ``ssl.SSLSocket``."""
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    port = serve(_echo)
    config = BrokerConnectionConfig(broker_url=f"https://127.0.0.1:{port}", ca_cert=str(bundle))
    upstream = _port_forward._connect(config)
    try:
        assert isinstance(upstream, TlsStream)
        assert not isinstance(upstream.raw, ssl.SSLSocket)
        upstream.sendall(b"ping")
        assert upstream.recv(10) == b"ping"
    finally:
        upstream.shutdown(socket.SHUT_RDWR)
        upstream.close()


def test_a_trickled_handshake_is_cut_off_at_its_deadline(ca: trustme.CA) -> None:
    """One deadline for the whole handshake: a peer that answers a byte now and then (each
    read within any per-read timeout) is cut off once the handshake's seconds are over."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)  # the ClientHello
            record = b"\x16\x03\x03\x40\x00" + b"\x00" * 40  # a 16 KiB record's start
            for byte in record:  # one byte every 0.1 s, until the client has gone
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.1)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    context = ssl.create_default_context()
    ca.configure_trust(context)
    raw = socket.create_connection(("127.0.0.1", port), 10)
    stream = TlsStream(raw, context, server_hostname="127.0.0.1")
    started = time.monotonic()
    with pytest.raises((TimeoutError, ssl.SSLError)) as failed:
        stream.handshake(1.0)
    assert isinstance(failed.value, TimeoutError), failed.value
    assert time.monotonic() - started < 3
    stream.close()
    thread.join(10)
    listener.close()


def test_the_forwarder_refuses_renegotiation(ca: trustme.CA, serve: Any, tmp_path: Path) -> None:
    """A TLS 1.2 renegotiation would make a write wait for the reading thread: the forwarder's
    context refuses it."""
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    config = BrokerConnectionConfig(
        broker_url=f"https://127.0.0.1:{serve(_echo)}", ca_cert=str(bundle)
    )
    upstream = _port_forward._connect(config)
    try:
        assert isinstance(upstream, TlsStream)
        assert upstream._tls.context.options & ssl.OP_NO_RENEGOTIATION
    finally:
        upstream.shutdown(socket.SHUT_RDWR)
        upstream.close()
