"""WebSocket peers for the relay's flow-control tests (stdlib only, threads): a sandbox's server
that floods, sinks or echoes, and what each of its connections sent and received.

Every socket here keeps small kernel buffers (:data:`SOCKET_BUFFER`), so that what a peer
could hand over is what the broker between them took, not what the test's own kernel buffers
held."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from tests._support.port_app import GUID, read_frame, write_frame

SOCKET_BUFFER = 64 * 1024
MIB = 1024 * 1024


def small_buffers(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    return sock


@dataclass
class Peer:
    """One connection the server accepted: its path, the bytes its flood handed to the socket,
    the messages it received."""

    path: str
    sent: int = 0
    received: list[bytes] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


class Server:
    """A sandbox's WebSocket server on 127.0.0.1 (a local sandbox's ports are the host's);
    per path: ``/flood?mib=N&message_mib=M`` sends N MiB in binary messages of M MiB each
    (default 64 and 1) and records what arrives meanwhile; ``/sink`` reads nothing at all;
    ``/mute`` reads everything and answers nothing, not even a close; ``/echo`` echoes."""

    def __init__(self) -> None:
        self.listener = small_buffers(socket.socket())
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port: int = self.listener.getsockname()[1]
        self.peers: list[Peer] = []
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for sock in self._open:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self._open.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        rfile = sock.makefile("rb")
        request = b""
        while not request.endswith(b"\r\n\r\n"):
            line = rfile.readline()
            if not line:
                return
            request += line
        path = request.split(b" ")[1].decode()
        key = next(
            line.split(b":", 1)[1].strip()
            for line in request.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        accept = base64.b64encode(hashlib.sha1(key + GUID.encode()).digest())
        sock.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        peer = Peer(path)
        self.peers.append(peer)
        wfile = sock.makefile("wb", buffering=0)
        try:
            if path.startswith("/flood"):
                threading.Thread(target=self._record, args=(rfile, peer), daemon=True).start()
                query = dict(part.split("=") for part in path.partition("?")[2].split("&"))
                size = int(query.get("message_mib", "1")) * MIB
                payload = b"x" * size
                for _ in range(int(query.get("mib", "64")) * MIB // size):
                    write_frame(wfile, 2, payload)
                    peer.sent += len(payload)
            elif path.startswith("/mute"):
                self._mute(rfile, peer)
            elif path.startswith("/echo"):
                while True:
                    opcode, data = read_frame(rfile)
                    if opcode == 8:
                        write_frame(wfile, 8, data[:2])
                        return
                    write_frame(wfile, opcode, data)
            else:
                peer.done.wait()  # a sink: reads nothing until the test ends it
        except OSError:
            pass
        finally:
            peer.done.set()

    @staticmethod
    def _mute(rfile: object, peer: Peer) -> None:
        """Read every frame, a close too, and answer none (a server stuck in its close): the
        peer is ``done`` when the broker dropped the connection."""
        try:
            while True:
                opcode, data = read_frame(rfile)
                if (opcode, data) == (
                    8,
                    b"",
                ):  # the connection's end (the broker's close has a code)
                    return
                if opcode != 8:
                    peer.received.append(data)
        except (OSError, ValueError, struct.error):
            return

    @staticmethod
    def _record(rfile: object, peer: Peer) -> None:
        try:
            while True:
                opcode, data = read_frame(rfile)
                if opcode == 8:
                    return
                peer.received.append(data)
        except (OSError, ValueError, struct.error):
            return


@contextlib.contextmanager
def serving() -> Iterator[Server]:
    """A :class:`Server` until the block ends; then every peer's flood stops and it closes."""
    peers = Server()
    try:
        yield peers
    finally:
        for peer in peers.peers:
            peer.done.set()
        peers.close()
