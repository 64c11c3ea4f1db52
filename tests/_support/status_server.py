"""Users' servers in a sandbox that answer with what the test chooses, byte for byte (a local
sandbox's ports are the host's, so the broker reaches them there), for the tests of what a
sandbox's answers may do to the broker's answers, metrics and logs.

- :func:`raw_server`: every request (its head read whole) answered by ``answer(conn, head)``;
- :func:`status_server`: the status its path names (``GET /status/NNN`` -> ``NNN``, any three
  digits, the reason phrase ``Chosen``), and two more paths (any path under them):
  ``/slow...``, a chunked answer whose first chunk comes at once and whose end comes when the
  broker goes away (or 10 s later); ``/broken...``, a chunked answer cut off after its first
  chunk (the connection closed).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable, Iterator

_STATUS = re.compile(rb"^[A-Z]+ /status/(\d{3})")

Answer = Callable[[socket.socket, bytes], None]


def _serve_one(conn: socket.socket, answer: Answer) -> None:
    with conn:
        conn.settimeout(5)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                return
            head += chunk
        with contextlib.suppress(OSError):
            answer(conn, head)


@contextlib.contextmanager
def raw_server(answer: Answer) -> Iterator[int]:
    """A server on a free port of 127.0.0.1 (yielded) until the block ends: each connection on
    a thread of its own, its request's head read, then ``answer(conn, head)``."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_serve_one, args=(conn, answer), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _status_answer(conn: socket.socket, head: bytes) -> None:
    target = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b"/"
    if target.startswith((b"/slow", b"/broken")):
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        if target.startswith(b"/slow"):
            conn.settimeout(10)
            conn.recv(1)  # until the broker goes away (or 10 s)
            conn.sendall(b"0\r\n\r\n")
        return
    match = _STATUS.match(head)
    status = match.group(1) if match else b"200"
    conn.sendall(b"HTTP/1.1 " + status + b" Chosen\r\nContent-Length: 2\r\n"
                 b"Connection: close\r\n\r\nok")  # fmt: skip


@contextlib.contextmanager
def status_server() -> Iterator[int]:
    """:func:`raw_server` answering as the module says."""
    with raw_server(_status_answer) as port:
        yield port
