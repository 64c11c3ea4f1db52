"""``sandbox.ports.forward(port)``: a local listener that forwards to a sandbox's port.

Each connection to ``127.0.0.1:<local port>`` is forwarded on a connection of its own to the
broker: the forwarder reads the request head (at most :data:`MAX_HEAD` bytes), rewrites it
(``Host``: the broker's; ``Authorization``: the sandbox's token, read fresh for each
connection; the router headers; ``Connection: close``, unless the request is an upgrade such as
a WebSocket handshake) and then pipes bytes both ways, unparsed: request and response bodies
stream as they come, and after a ``101 Switching Protocols`` the WebSocket frames flow through
as they are. A local client that shuts its sending side after the request (``nc -N``) still
gets the answer: a request's end leaves the connection to the answer's (an upgrade's end, or
any failure, ends both directions). The local client's own ``Authorization``, ``Cookie``,
``Proxy-*`` and ``X-Sandbox-*`` headers are dropped (the broker would strip the first two
anyway).

Threads, also for :class:`AsyncPortForward` (the same forwarder behind an async context
manager: the event loop is never blocked, and a slow or stuck local client holds only its own
connection's threads). Bounded: a local client has :data:`HEAD_SECONDS` from the accept to send
its whole request head (then ``408``), and a forward holds at most :data:`MAX_CONNECTIONS`
connections at once (one more is answered ``503`` at once), so at most ``1 + 2 x
MAX_CONNECTIONS`` threads (the acceptor; per connection, one for each direction; the two share
the broker connection's TLS state only through :class:`~._tls_stream.TlsStream`). On exit
the listener and every connection are shut down and every thread is joined: nothing is left
behind. The token is never logged; a refusal the forwarder makes itself (the broker
unreachable, a head it cannot read or that came too late, too many connections) is a
plain-text ``502``/``400``/``408``/``503`` to the local client.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlsplit

from ._tls_stream import TlsStream
from .http._client_settings import client_settings

__all__ = ["ForwardTarget", "PortForward"]

logger = logging.getLogger("k8s_agent_sandbox_awx.ports")

MAX_HEAD = 64 * 1024
"""The largest request head (request line and headers) the forwarder reads."""
HEAD_SECONDS = 30.0
"""Seconds a local client has, from the accept, to send its whole request head (one deadline,
not one per read: a client trickling a byte at a time is answered ``408`` then)."""
MAX_CONNECTIONS = 64
"""Connections one forward serves at once (each holds two threads); one more is answered
``503`` (each forwarded request has a connection of its own: ``Connection: close``)."""
CONNECT_SECONDS = 10.0
"""Seconds to connect to the broker, and then again to complete TLS (each one deadline)."""
SEND_SECONDS = 300.0
"""Seconds one write to a peer may block (a peer that stops reading is cut off then)."""
_CHUNK = 64 * 1024
_DROPPED = frozenset(
    {
        "host",
        "authorization",
        "cookie",
        "connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
    }
)


@dataclass(frozen=True)
class ForwardTarget:
    """Where a forwarder's connections go: the broker (``config``), the router headers,
    the sandbox's credential source (read per connection), its port and name."""

    config: Any
    headers: dict[str, str]
    source: Callable[[], Any]
    port: int
    sandbox: str

    def token(self) -> str:
        credential = self.source().get_credential(self.config.broker_url)
        token: str = credential.token
        return token


class _Refusal(Exception):
    def __init__(self, status: str, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def _read_head(conn: socket.socket, deadline: float) -> tuple[bytes, bytes]:
    """The request head (without its blank line) and whatever of the body came with it, by
    ``deadline`` (``time.monotonic()``; then ``408``)."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD:
            raise _Refusal("431 Request Header Fields Too Large", "the request head is too large")
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            conn.settimeout(left)
            chunk = conn.recv(_CHUNK)
        except TimeoutError:
            raise _Refusal(
                "408 Request Timeout",
                f"the request head did not arrive within {HEAD_SECONDS:g} s of the connection",
            ) from None
        if not chunk:
            raise ConnectionError("the local client closed the connection")
        data += chunk
    conn.settimeout(None)
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def rewrite_head(head: bytes, target: ForwardTarget, token: str) -> tuple[bytes, bool]:
    """The head sent to the broker for ``head`` (and whether it is an upgrade).

    The head is checked first (:func:`_check_head`): a header hidden in a line the forwarder
    keeps (a bare CR or LF, a NUL, a folded line) would reach the broker as a header of its own,
    before the forwarder's router headers, and point the credential added here elsewhere (the
    runtime's API, another port or sandbox); and a ``Host`` that is not a loopback name is a web
    page that reached the listener under its own name (DNS rebinding): both are refused."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[1].startswith(b"/"):
        raise _Refusal("400 Bad Request", "send an origin-form request ('GET /path HTTP/1.1')")
    _check_head(parts, lines[1:])
    url = urlsplit(target.config.broker_url)
    prefix = url.path.rstrip("/").encode("ascii")
    kept: list[bytes] = []
    upgrade = False
    for line in lines[1:]:
        name, sep, _ = line.partition(b":")
        key = name.strip().lower().decode("latin-1")
        if not sep or key in _DROPPED or key.startswith(("x-sandbox-", "proxy-")):
            continue
        if key == "upgrade":
            upgrade = True
        kept.append(line)
    ours = [f"Host: {url.netloc}", f"Authorization: Bearer {token}"]
    ours += [f"{k}: {v}" for k, v in target.headers.items()]
    ours.append("Connection: Upgrade" if upgrade else "Connection: close")
    first = b" ".join((parts[0], prefix + parts[1], parts[2]))
    rebuilt = [first, *kept, *(line.encode("latin-1") for line in ours)]
    return b"\r\n".join(rebuilt) + b"\r\n\r\n", upgrade


_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
"""An HTTP token (RFC 9110, section 5.6.2): a method, a header's name."""
_TARGET = re.compile(rb"^/[\x21-\x7e]*$")
"""An origin-form request target: visible ASCII, no space, no control character."""
_VERSION = re.compile(rb"^HTTP/1\.[01]$")
_VALUE = re.compile(rb"^[\t\x20-\x7e\x80-\xff]*$")
"""A header's value: no control character but HTAB (so no CR, LF or NUL)."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
"""The ``Host`` names the forwarder serves (any port): the names of its own listener."""


def _check_head(request_line: list[bytes], fields: list[bytes]) -> None:
    """400 for a head that the broker's parser could read otherwise than the forwarder does;
    421 for a ``Host`` that is not a loopback name."""
    method, path, version = request_line
    if not (_TOKEN.match(method) and _TARGET.match(path) and _VERSION.match(version)):
        raise _Refusal(
            "400 Bad Request",
            "the request line is malformed (a method, an origin-form target without spaces or "
            "control characters, HTTP/1.0 or HTTP/1.1)",
        )
    hosts: list[bytes] = []
    for line in fields:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name) or not _VALUE.match(value):
            raise _Refusal(
                "400 Bad Request",
                "a header line is malformed (a bare CR or LF, a NUL or another control "
                "character, a folded line, or a name that is not a token); send one "
                "'Name: value' per CRLF-ended line",
            )
        if name.lower() == b"host":
            hosts.append(value.strip())
    if len(hosts) > 1:
        raise _Refusal("400 Bad Request", "the request has more than one Host header")
    if hosts and _host_name(hosts[0]) not in LOOPBACK_HOSTS:
        shown = hosts[0][:100].decode("latin-1")
        raise _Refusal(
            "421 Misdirected Request",
            f"Host {shown!r} is not this listener's: it serves only requests for 127.0.0.1, "
            "localhost or [::1] (a page of another name that reached it, by DNS rebinding, "
            "must not use the sandbox's credential); use the forward's url",
        )


def _host_name(host: bytes) -> str:
    """The name of a ``Host`` value, in lower case, without its port."""
    text = host.decode("latin-1").lower()
    if text.startswith("["):
        name, bracket, _ = text.partition("]")
        return name + bracket
    return text.rpartition(":")[0] if ":" in text else text


def _connect(config: Any) -> _Stream:
    """A connection to the broker (TLS with the broker's CA settings for ``https://``): a
    :class:`TlsStream`, whose TLS state the forwarder's two threads may share (an
    :class:`ssl.SSLSocket` read in one thread and written in another is not safe)."""
    url = urlsplit(config.broker_url)
    secure = url.scheme == "https"
    host = url.hostname or "127.0.0.1"
    sock = socket.create_connection((host, url.port or (443 if secure else 80)), CONNECT_SECONDS)
    if not secure:
        sock.settimeout(None)
        return sock
    verify = client_settings(config)["verify"]
    context = verify if isinstance(verify, ssl.SSLContext) else ssl.create_default_context()
    # A renegotiation (TLS 1.2) would make a write wait for the reader's thread: refused (it
    # is also refused for the client's other connections on this context; TLS 1.3 has none).
    context.options |= ssl.OP_NO_RENEGOTIATION
    try:
        tls = TlsStream(sock, context, server_hostname=host)
        tls.handshake(CONNECT_SECONDS)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return tls


class _Stream(Protocol):
    """What the forwarder pipes: a socket, or a :class:`TlsStream`."""

    def recv(self, size: int, /) -> bytes: ...

    def sendall(self, data: bytes, /) -> None: ...

    def shutdown(self, how: int, /) -> None: ...

    def close(self) -> None: ...


def _send_timeout(stream: _Stream) -> None:
    """A write to ``stream`` blocks at most :data:`SEND_SECONDS` (then it fails: the peer
    stopped reading), while reads wait as long as the peer is quiet (a WebSocket may be)."""
    sock = stream.raw if isinstance(stream, TlsStream) else stream
    seconds = int(SEND_SECONDS)
    value = seconds.to_bytes(8, "little") + (0).to_bytes(8, "little")  # struct timeval
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):  # a system without it: writes block as before
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def _pipe(source: _Stream, sink: _Stream, keep_on_end: bool = False) -> None:
    """Copy ``source`` to ``sink`` until either ends; then shut both down. ``keep_on_end``:
    at ``source``'s clean end, leave both open (the other direction goes on: a local client
    that half-closes after its request still gets the answer); a failure still ends both."""
    try:
        while chunk := source.recv(_CHUNK):
            sink.sendall(chunk)
        if keep_on_end:
            return
    except (OSError, ValueError):
        pass
    for sock in (source, sink):
        _shutdown(sock)


def _shutdown(sock: _Stream) -> None:
    with contextlib.suppress(OSError, ValueError):
        sock.shutdown(socket.SHUT_RDWR)


class PortForward:
    """A running forward (a context manager): ``url`` (``http://127.0.0.1:<port>``) and
    ``port``, the local listener's; :meth:`close` (or the ``with`` block's end) stops it."""

    def __init__(self, target: ForwardTarget, local_port: int = 0) -> None:
        if isinstance(local_port, bool) or not isinstance(local_port, int):
            raise TypeError(f"local_port must be an int (0: any free port), not {local_port!r}")
        if not 0 <= local_port <= 65535:
            raise ValueError(f"local_port {local_port} is not a TCP port (0..65535)")
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", local_port))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._sockets: set[_Stream] = set()
        self._threads: set[threading.Thread] = set()
        self._serving = 0  # connections being served (at most MAX_CONNECTIONS)
        self._closed = False
        self._acceptor = threading.Thread(
            target=self._accept, name=f"port-forward-{self.port}", daemon=True
        )
        self._acceptor.start()
        logger.info("forwarding %s to port %d of sandbox %s", self.url, target.port, target.sandbox)

    def __repr__(self) -> str:
        target = self._target
        return f"PortForward(url={self.url!r}, sandbox={target.sandbox!r}, port={target.port})"

    def __enter__(self) -> PortForward:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            deadline = time.monotonic() + HEAD_SECONDS
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                busy = self._serving >= MAX_CONNECTIONS
                if not busy:
                    self._serving += 1
                    self._sockets.add(conn)
            if busy:
                _busy(conn)
                continue
            self._start(self._serve, conn, deadline)

    def _start(self, run: Callable[..., None], *args: Any) -> threading.Thread:
        name = f"port-forward-{self.port}-connection"
        thread = threading.Thread(target=self._run, args=(run, *args), name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return thread

    def _run(self, run: Callable[..., None], *args: Any) -> None:
        try:
            run(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _serve(self, conn: socket.socket, deadline: float) -> None:
        upstream: _Stream | None = None
        try:
            upstream, upgrade = self._open(conn, deadline)
            if upstream is not None:
                # A request's end (not an upgrade's) leaves the answer to come: the broker was
                # sent "Connection: close" and ends the connection after its answer.
                up = self._start(_pipe, conn, upstream, not upgrade)
                _pipe(upstream, conn)
                up.join()
        finally:
            for sock in (conn, upstream):
                if sock is not None:
                    with self._lock:
                        self._sockets.discard(sock)
                    _shutdown(sock)
                    sock.close()
            with self._lock:
                self._serving -= 1

    def _open(self, conn: socket.socket, deadline: float) -> tuple[_Stream | None, bool]:
        """The broker connection for ``conn``, its rewritten head sent (``None``: refused),
        and whether the request is an upgrade (a WebSocket's)."""
        try:
            head, rest = _read_head(conn, deadline)
        except _Refusal as refusal:
            _refuse(conn, refusal.status, refusal.text)
            return None, False
        except OSError:  # the local client went away
            return None, False
        try:
            rewritten, upgrade = rewrite_head(head, self._target, self._target.token())
            upstream = _connect(self._target.config)
        except _Refusal as refusal:
            _refuse(conn, refusal.status, refusal.text)
            return None, False
        except Exception as exc:  # no token (its error never holds one), no broker
            what = f"{type(exc).__name__}: {str(exc)[:300]}"
            logger.warning("port forward %s: cannot forward a connection (%s)", self.url, what)
            _refuse(conn, "502 Bad Gateway", f"cannot reach the broker ({what})")
            return None, False
        with self._lock:
            closed = self._closed
            if not closed:
                self._sockets.add(upstream)
        if closed:
            upstream.close()
            return None, False
        for sock in (conn, upstream):
            _send_timeout(sock)
        try:
            upstream.sendall(rewritten + rest)
        except OSError:
            _refuse(conn, "502 Bad Gateway", "the connection to the broker broke")
        return upstream, upgrade  # closed by the caller either way

    def close(self) -> None:
        """Stop listening, end every forwarded connection and join every thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets = list(self._sockets)
        _shutdown(self._listener)
        self._listener.close()
        for sock in sockets:
            _shutdown(sock)
        self._acceptor.join(5.0)
        while True:
            with self._lock:
                threads = [t for t in self._threads if t is not threading.current_thread()]
            if not threads:
                break
            for thread in threads:
                thread.join(5.0)
        logger.info("stopped forwarding %s", self.url)


def _refuse(conn: socket.socket, status: str, text: str) -> None:
    """A plain-text answer of the forwarder's own (never with a token in it)."""
    body = f"agent-sandbox-awx port forward: {text}\n".encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    with contextlib.suppress(OSError):
        conn.sendall(head.encode() + body)


def _busy(conn: socket.socket) -> None:
    """``503`` to a connection over :data:`MAX_CONNECTIONS` (from the acceptor: never blocks
    it for long), then closed."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.recv(MAX_HEAD)  # what the client sent already (unread, the close would reset)
    with contextlib.suppress(OSError):
        conn.settimeout(1.0)
        _refuse(
            conn,
            "503 Service Unavailable",
            f"this forward serves at most {MAX_CONNECTIONS} connections at once and all are "
            "busy; retry when one has ended (each request has a connection of its own)",
        )
    _shutdown(conn)
    conn.close()
