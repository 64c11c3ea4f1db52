"""A minimal WebSocket client over a plain socket (stdlib only), for the ports tests."""

from __future__ import annotations

import base64
import os
import socket
import ssl
import struct
from urllib.parse import urlsplit


class WebSocket:
    """A client WebSocket on ``sock`` after a ``101``; ``head``: the handshake's answer head."""

    def __init__(self, sock: socket.socket, head: bytes, rest: bytes) -> None:
        self.sock = sock
        self.head = head
        self._buffer = rest

    def send(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            head = bytes([0x80 | opcode, 0x80 | n])
        elif n < 65536:
            head = bytes([0x80 | opcode, 0x80 | 126]) + struct.pack("!H", n)
        else:
            head = bytes([0x80 | opcode, 0x80 | 127]) + struct.pack("!Q", n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def _read(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the connection closed mid-frame")
            self._buffer += chunk
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    def recv(self) -> tuple[int, bytes]:
        """The next whole message: ``(opcode, payload)`` (continuations joined)."""
        opcode, payload = -1, b""
        while True:
            b0, b1 = self._read(2)
            length = b1 & 0x7F
            if length == 126:
                length = struct.unpack("!H", self._read(2))[0]
            elif length == 127:
                length = struct.unpack("!Q", self._read(8))[0]
            data = self._read(length)
            if opcode == -1:
                opcode = b0 & 0x0F
            payload += data
            if b0 & 0x80:
                return opcode, payload

    def close(self, code: int = 1000) -> tuple[int, bytes]:
        """Send a close with ``code``; the peer's close frame back."""
        self.send(8, struct.pack("!H", code))
        return self.recv()


def connect(host: str, port: int, path: str, headers: dict[str, str] | None = None) -> WebSocket:
    """A WebSocket handshake on a new connection to ``host:port`` (plain TCP)."""
    return handshake(socket.create_connection((host, port), 10), host, port, path, headers)


def connect_tls(
    url: str, cafile: str, path: str, headers: dict[str, str] | None = None
) -> WebSocket:
    """A WebSocket handshake to the HTTPS server at ``url`` (a broker's), verified with the CA
    bundle ``cafile`` (the socket wrapped by hand)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 443
    context = ssl.create_default_context(cafile=cafile)
    plain = socket.create_connection((host, port), 10)
    return handshake(context.wrap_socket(plain, server_hostname=host), host, port, path, headers)


def handshake(
    sock: socket.socket, host: str, port: int, path: str, headers: dict[str, str] | None = None
) -> WebSocket:
    """Send a WebSocket handshake on ``sock``; the answer's head (and what followed it)."""
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return WebSocket(sock, head, rest)
