"""Callers that push WebSocket messages through a broker as fast as it takes them, for the
tests of the broker's WebSocket limits (stdlib only, threads).

Each caller's socket keeps small kernel buffers (``ws_peers.SOCKET_BUFFER``) and sends
binary messages of one size in one frame each, masked with a zero key (a legal mask that
leaves the payload as it is: masking 15 MiB in Python would take longer than the test), until
a send blocks for ``stall`` seconds: then the broker has stopped reading from it, and what it
holds for the connection is what it holds for good.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from tests._support import ws_client
from tests._support.ws_peers import small_buffers


def frame_head(size: int, opcode: int = 2) -> bytes:
    """The head of one final, masked frame of ``size`` bytes, with a zero masking key."""
    if size < 126:
        length = bytes([0x80 | size])
    elif size < 65536:
        length = bytes([0x80 | 126]) + struct.pack("!H", size)
    else:
        length = bytes([0x80 | 127]) + struct.pack("!Q", size)
    return bytes([0x80 | opcode]) + length + b"\0\0\0\0"


def open_caller(url: str, cafile: str, path: str, headers: dict[str, str]) -> ws_client.WebSocket:
    """A WebSocket handshake through the broker at ``url`` on a socket with small buffers
    (the answer is in ``.head``: ``101`` or a refusal)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 443
    plain = small_buffers(socket.socket())
    plain.settimeout(30)
    plain.connect((host, port))
    tls = ssl.create_default_context(cafile=cafile).wrap_socket(plain, server_hostname=host)
    return ws_client.handshake(tls, host, port, path, headers)


@dataclass
class Pusher:
    """Sends ``size``-byte messages on ``ws`` from a thread of its own until a send blocks
    for ``stall`` seconds (``held``) or the connection ends (``ended``)."""

    ws: ws_client.WebSocket
    size: int
    stall: float = 3.0
    sent: int = 0
    held: bool = False
    ended: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Pusher:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        payload = b"x" * self.size
        head = frame_head(self.size)
        self.ws.sock.settimeout(self.stall)
        try:
            while True:
                self.ws.sock.sendall(head)
                self.ws.sock.sendall(payload)
                self.sent += 1
        except TimeoutError:
            self.held = True
        except OSError as exc:
            self.ended = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()
