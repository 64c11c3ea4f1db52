"""The runtime's one HTTP server: its request handler, the route table and ``serve``.

One runtime serves one sandbox (``python -m k8s_agent_sandbox_awx.broker.runtime``, see
:mod:`._main`), speaking the protocol of upstream's python runtime plus the deployed runtimes'
extensions: ``GET /`` (health), the legacy endpoints (:mod:`._legacy`), the file API
(:mod:`._file_api`), managed commands (:mod:`._commands`) and code contexts (:mod:`._code`).
``ThreadingHTTPServer``: one thread per connection, HTTP/1.1 keep-alive.

NO ISOLATION: commands run as host processes with the user's privileges. Development and tests
only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import socketserver
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import _code, _commands, _file_api, _legacy, _process
from ._command import Limits
from ._http import Exchange, drain, send_json
from ._paths import Roots

Endpoint = Callable[["Handler"], None]

_process.at_exit(_legacy.kill_running)  # what runs dies with the runtime
_process.at_exit(_commands.kill_all)
_process.at_exit(_code.kill_all)


class Handler(BaseHTTPRequestHandler):
    """One connection's requests (an :class:`._http.Exchange` for the endpoints)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # small replies are not held back by Nagle + delayed ACK
    server_version = "agent-sandbox-local-runtime"
    sys_version = ""
    base_dir: str = "/"
    exec_timeout: float = _legacy.DEFAULT_EXEC_TIMEOUT
    commands: _commands.CommandManager
    code: _code.CodeManager
    fs_roots: Roots

    def log_message(self, format: str, *args: Any) -> None:
        return  # quiet: the broker logs requests

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        path = urllib.parse.urlsplit(self.path).path
        endpoint = route(method, path)
        if endpoint is None:
            if method == "POST":
                drain(self)
            send_json(self, 404, {"detail": f"no route for {method} {path}"})
            return
        endpoint(self)


def _health(exchange: Exchange) -> None:
    send_json(exchange, 200, {"status": "ok", "message": "local sandbox runtime"})


def _commands_get(handler: Handler) -> None:
    handler.commands.handle(handler, "GET")


def _commands_post(handler: Handler) -> None:
    handler.commands.handle(handler, "POST")


def _code_get(handler: Handler) -> None:
    handler.code.handle(handler, "GET")


def _code_post(handler: Handler) -> None:
    handler.code.handle(handler, "POST")


EXACT: dict[tuple[str, str], Endpoint] = {
    ("GET", "/"): _health,
    ("GET", "/list"): _legacy.list_endpoint,
    ("GET", "/commands"): _commands_get,
    ("POST", "/execute"): _legacy.execute,
    ("POST", "/upload"): _legacy.upload_endpoint,
    ("POST", "/commands"): _commands_post,
    **{("GET", path): _file_api.handle for path in _file_api.GET_ROUTES},
    **{("POST", path): _file_api.handle for path in _file_api.POST_ROUTES},
}
"""The routes by method and exact path."""
PREFIXES: list[tuple[str, str, Endpoint]] = [
    ("GET", "/download/", _legacy.download_endpoint),
    ("GET", "/list/", _legacy.list_endpoint),
    ("GET", "/exists/", _legacy.exists_endpoint),
    ("GET", "/commands/", _commands_get),
    ("POST", "/commands/", _commands_post),
    ("GET", "/code/", _code_get),
    ("POST", "/code/", _code_post),
]
"""The routes by method and the start of the path (its rest is the endpoint's argument)."""


def route(method: str, path: str) -> Endpoint | None:
    """The endpoint of ``method path`` (``None``: no route, a ``404``)."""
    endpoint = EXACT.get((method, path))
    if endpoint is not None:
        return endpoint
    for route_method, prefix, candidate in PREFIXES:
        if method == route_method and path.startswith(prefix):
            return candidate
    return None


LISTEN_BACKLOG = 128
"""Connections the listening socket queues before they are accepted (socketserver's default,
5, overflowed when a caller followed 64 commands at once: a Unix socket then refuses more)."""


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """:class:`ThreadingHTTPServer` on a Unix socket (an isolated sandbox's runtime: the broker
    reaches it through a socket file, whatever the sandbox's network)."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG


class _TCPServer(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG


def serve(
    host: str,
    port: int,
    base_dir: str,
    port_file: str | None = None,
    unix_socket: str | None = None,
) -> None:
    """Serve the protocol on ``host:port`` (or on the Unix socket ``unix_socket``) for
    ``base_dir`` until killed. ``port`` 0: a port the system picks, written (once the socket
    listens) to ``port_file``, which the broker reads: no other process can take it between the
    choice and the bind. A Unix socket is listening once its file exists."""
    signal.signal(signal.SIGTERM, _process.exit_now)
    base_dir = os.path.realpath(base_dir)
    os.makedirs(base_dir, exist_ok=True)
    handler = _handler_class(base_dir, tcp=unix_socket is None)
    server: socketserver.BaseServer
    if unix_socket is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(unix_socket)  # a socket left by an earlier runtime of this sandbox
        server = UnixHTTPServer(unix_socket, handler)
    else:
        tcp = tcp_server(host, port, handler)
        if port_file:
            report_port(port_file, int(tcp.server_address[1]))
        server = tcp
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        _process.run_cleanups()


class DualStackHTTPServer(_TCPServer):
    """:class:`ThreadingHTTPServer` on ``::`` that takes IPv4 too (``IPV6_V6ONLY`` off), as
    every interface of a pod, whatever its cluster's IP families."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class IPv6HTTPServer(_TCPServer):
    address_family = socket.AF_INET6


def tcp_server(host: str, port: int, handler: type[Handler]) -> ThreadingHTTPServer:
    """The listening server for ``--host``: ``::`` (the image's default) is every interface,
    IPv6 and IPv4, and falls back to ``0.0.0.0`` on a system without IPv6; another IPv6
    address (``::1``) is IPv6 only; anything else (``0.0.0.0``, ``127.0.0.1``) IPv4."""
    server: ThreadingHTTPServer
    if host == "::":
        try:
            server = DualStackHTTPServer((host, port), handler)
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            server = _TCPServer(("0.0.0.0", port), handler)  # noqa: S104 (no IPv6)
    elif ":" in host:
        server = IPv6HTTPServer((host, port), handler)
    else:
        server = _TCPServer((host, port), handler)
    server.daemon_threads = True
    return server


def _handler_class(base_dir: str, *, tcp: bool) -> type[Handler]:
    """The request handler of one runtime: its base directory, limits, commands and roots."""
    exec_timeout = float(
        os.environ.get("SANDBOX_EXEC_TIMEOUT_SECONDS") or _legacy.DEFAULT_EXEC_TIMEOUT
    )
    commands = _commands.CommandManager(base_dir, Limits.from_environ(os.environ, exec_timeout))
    code = _code.CodeManager(base_dir, _code.CodeLimits.from_environ(os.environ, exec_timeout))
    return type(
        "Handler",
        (Handler,),
        {
            "base_dir": base_dir,
            "exec_timeout": exec_timeout,
            "commands": commands,
            "code": code,
            "fs_roots": Roots.of(base_dir),  # the file API's roots, as they are at start
            "disable_nagle_algorithm": tcp,  # TCP_NODELAY: not an option of a Unix socket
        },
    )


def report_port(path: str, port: int) -> None:
    """Write ``port`` to ``path`` atomically: a reader sees no file or the whole number."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="ascii") as fh:
        fh.write(f"{port}\n")
    os.replace(partial, path)
