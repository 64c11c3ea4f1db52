"""Run an ASGI app with uvicorn under the ``[server]`` settings.

- TLS from the certificate and key files, re-loaded when they change (``_tls``).
- SIGTERM or SIGINT: stop accepting (the listening socket is closed), let in-flight requests
  and streams finish for up to ``shutdown_grace_seconds`` (uvicorn's graceful shutdown: it waits
  for every connection, a streaming response included, then cancels what is left), then return,
  so that the process exits 0. A second signal closes what is left at once.
- ``/healthz`` and ``/readyz`` in front of the app (``_probes``).
- Deadlines for connections that have not completed a request (``_http``): the TLS handshake
  and a request's head ``request_head_seconds``, an idle connection ``keep_alive_seconds``
  (before its first request too); a malformed request costs one warning, no traceback.
- One start-up message once both listeners accept connections (``Started broker process
  [PID]``: the API address, the metrics address, and what the caller adds, e.g. the backend and
  the configuration file), in place of uvicorn's "Started server process" line; the metrics
  listener's own uvicorn lifecycle lines (a second "Started", "Shutting down", "Finished") are
  left out, its warnings and errors are not.
- ``serve`` (the process's own server, ``broker serve``) freezes what exists once it accepts
  connections (``gc.freeze``): the modules, configuration and clients made at start-up are
  then skipped by every full collection, which here took 12-19 ms with them, a pause of every
  request in flight (docs/performance.md, "Concurrency").
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final

import uvicorn

from ..config import MetricsSettings, ServerSettings
from ._dates import FreshDateServer
from ._http import deadline_protocol, handshake_deadline
from ._logs import TEXT_LOGGING, JsonFormatter, TextFormatter
from ._probes import ASGIApp, ReadinessCheck, with_probes
from ._tls import ReloadingCertificate
from ._ws import ws_protocol

__all__ = ["ListenError", "ServedApp", "bind", "run_server", "serve"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.server")

_TRACE = 5  # uvicorn's "trace" level

_UVICORN_START: Final = "Started server process [%d]"  # uvicorn's line, replaced by the broker's
_UVICORN_WEBSOCKET: Final = '%s - "WebSocket %s"'
"""How uvicorn's line for each WebSocket handshake begins (then ``[accepted]``, ``403`` or the
status of a refusal): its target with the query string, which no broker message carries (the
access log records the handshake)."""
_in_metrics_server: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "_in_metrics_server", default=False
)


class _OneStartLine(logging.Filter):
    """On uvicorn's ``uvicorn.error`` logger while ``broker serve`` runs: drops uvicorn's
    "Started server process" (the broker writes its own start message), its line for each
    WebSocket handshake (:data:`_UVICORN_WEBSOCKET`) and the metrics listener's informational
    lifecycle lines (they repeat the API server's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _UVICORN_START:
            return False
        if isinstance(record.msg, str) and record.msg.startswith(_UVICORN_WEBSOCKET):
            return False
        return not (_in_metrics_server.get() and record.levelno <= logging.INFO)


@contextlib.contextmanager
def _one_start_line() -> Iterator[None]:
    logger = logging.getLogger("uvicorn.error")
    only = _OneStartLine()
    logger.addFilter(only)
    try:
        yield
    finally:
        logger.removeFilter(only)


def _log_started(api: str, metrics: str | None, about: Mapping[str, str]) -> None:
    """The one start-up message: ``Started broker process [PID]: API URL, metrics URL, KEY
    VALUE...`` (``about``: the caller's facts, none of them secret), its facts as JSON fields
    too (``pid``, ``api``, ``metrics``, and ``about``'s keys)."""
    pid = os.getpid()
    facts: dict[str, object] = {"pid": pid, "api": api}
    if metrics is not None:
        facts["metrics"] = metrics
    facts.update(about)
    parts = [f"API {api}", f"metrics {metrics}" if metrics else "no metrics listener"]
    parts += [f"{key} {value}" for key, value in about.items()]
    log.info("Started broker process [%d]: %s", pid, ", ".join(parts), extra={"fields": facts})


@dataclass(frozen=True)
class ServedApp:
    """What ``broker serve`` runs: the ASGI app and its readiness check (``None``: ready);
    ``metrics``: the app that answers ``GET /metrics`` on ``[metrics] listen`` (``None``: no
    metrics listener); ``degraded``: what is degraded without making it unready (``/readyz``'s
    ``degraded``)."""

    app: ASGIApp
    ready: ReadinessCheck | None = None
    metrics: ASGIApp | None = None
    degraded: ReadinessCheck | None = None


class ListenError(OSError):
    """The listen address cannot be bound (the message names it and why)."""


def bind(host: str, port: int, key: str = "server.listen") -> socket.socket:
    """A listening TCP socket on ``host:port`` (``::``: IPv6 and, where the system allows,
    IPv4 too); ``key``: the configuration key an error names."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ListenError(f"cannot listen on {shown} ({key}): {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        raise ListenError(f"cannot listen on {shown} ({key}): {why}") from None
    return sock


class _Server(FreshDateServer):
    """uvicorn's server (its ``Date`` re-made at every tick), with the broker's signal
    handling and a started callback."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_started: Callable[[], None] | None,
        handshake_seconds: float,
    ) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._handshake_seconds = handshake_seconds

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own re-raises the signal after the shutdown (the process then dies of
        # SIGTERM); the broker returns, and exits 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {signum: signal.signal(signum, self._on_signal) for signum in signals}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.should_exit:
            log.warning("%s again: closing the remaining connections now", name)
            self.force_exit = True
            return
        grace = self.config.timeout_graceful_shutdown
        log.info("%s: no new connections; in-flight requests get up to %ss", name, grace)
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        reaper = asyncio.create_task(_close_finished(self.server_state.connections))
        try:
            await super().shutdown(sockets=sockets)
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        with handshake_deadline(asyncio.get_running_loop(), self._handshake_seconds):
            await super().startup(sockets=sockets)
        if self.started and self._on_started is not None:
            self._on_started()


WS_PING_SECONDS: Final = 20.0
"""How often the broker pings a caller's WebSocket, and how long it waits for the pong before
it closes the WebSocket (uvicorn's defaults)."""

CLOSE_WAIT: Final = 1.0
"""Seconds a connection with nothing left to send may wait for its peer's TLS close during
the shutdown before it is dropped."""


def _nothing_to_send(transport: Any) -> bool:
    """Whether a closing transport has sent everything (TLS layer, and the TCP transport under
    it where asyncio exposes it); the kernel still delivers what it holds after a drop."""
    inner = getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)
    return bool(transport.get_write_buffer_size() == 0) and (
        inner is None or inner.get_write_buffer_size() == 0
    )


async def _close_finished(connections: set[Any]) -> None:
    """During the shutdown: drop the connections that finished their last response and only
    wait for the peer's TLS close_notify (an idle keep-alive client holds that forever), so
    that they do not hold the process for the whole grace. Connections still answering are
    left to finish."""
    closing_since: dict[int, float] = {}
    while True:
        await asyncio.sleep(0.1)
        now = asyncio.get_running_loop().time()
        for connection in list(connections):
            transport = getattr(connection, "transport", None)
            if transport is None or not transport.is_closing():
                continue
            since = closing_since.setdefault(id(connection), now)
            if now - since >= CLOSE_WAIT and _nothing_to_send(transport):
                transport.abort()


class _MetricsServer(FreshDateServer):
    """The metrics listener: plain HTTP, stopped with the broker (it handles no signal)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.up.set()


def _uvicorn_config(
    app: ASGIApp, settings: ServerSettings, log_format: str = "text"
) -> uvicorn.Config:
    config = uvicorn.Config(
        app,
        log_level=_TRACE if settings.log_level == "trace" else settings.log_level,
        # the broker writes its own access log (broker.observability; access_log toggles it)
        access_log=False,
        # JSON: the broker's handler on uvicorn's loggers (_configure_logging), not uvicorn's
        log_config=None if log_format == "json" else TEXT_LOGGING,  # its lines escaped too
        lifespan="auto",
        interface="asgi3",
        http=deadline_protocol(settings.request_head_seconds),
        ws=ws_protocol(),
        # a caller's WebSocket messages: at most this (1009 over it); pings every 20 s, a
        # caller that answers none for 20 s is closed (uvicorn's defaults, made explicit)
        ws_max_size=settings.websocket_max_message_bytes,
        ws_ping_interval=WS_PING_SECONDS,
        ws_ping_timeout=WS_PING_SECONDS,
        loop="asyncio",
        server_header=False,
        proxy_headers=False,  # the client address is the peer's: no forwarded header trusted
        timeout_keep_alive=math.ceil(settings.keep_alive_seconds),
    )
    # a float works (asyncio.wait_for); uvicorn's annotation says int
    config.timeout_graceful_shutdown = settings.shutdown_grace_seconds  # type: ignore[assignment]
    return config


def _url(scheme: str, listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def run_server(
    served: ServedApp,
    settings: ServerSettings,
    *,
    on_started: Callable[[str], None] | None = None,
    sock: socket.socket | None = None,
    metrics: MetricsSettings | None = None,
    on_metrics_started: Callable[[str], None] | None = None,
    log_format: str = "text",
    about: Mapping[str, str] | None = None,
) -> None:
    """Serve ``served`` until a signal stops it (see the module's docstring).

    ``on_started(url)``: called once the server accepts connections, with the address it
    listens on (``https://127.0.0.1:8443``). ``sock``: a listening socket to use instead of
    binding ``settings.host:port``. ``metrics``: where ``served.metrics`` listens (plain HTTP;
    ``on_metrics_started(url)`` once it does), stopped with the broker. ``about``: facts for
    the start-up message (``{"backend": "local", "config": PATH}``; never a secret). Raises
    ``TLSFilesError`` or :class:`ListenError` before serving when the certificate pair or an
    address cannot be used."""
    certificate = ReloadingCertificate(settings.tls_cert_file, settings.tls_key_file)
    listener = sock or bind(settings.host, settings.port)
    metrics_listener = None
    if metrics is not None and served.metrics is not None:
        try:
            metrics_listener = bind(metrics.host, metrics.port, "metrics.listen")
        except ListenError:
            listener.close()
            raise
    probed = with_probes(served.app, served.ready, served.degraded)
    config = _uvicorn_config(probed, settings, log_format)
    config.load()
    config.ssl = certificate.context  # the ONE context; the watcher re-loads the pair into it
    url = _url("https", listener)
    metrics_url = None if metrics_listener is None else _url("http", metrics_listener) + "/metrics"

    def started() -> None:
        _log_started(url, metrics_url, about or {})
        if on_started is not None:
            on_started(url)

    server = _Server(config, started, settings.request_head_seconds)
    watcher = asyncio.create_task(certificate.watch(settings.tls_reload_seconds))
    side = None
    with _one_start_line():
        try:
            if metrics_listener is not None and served.metrics is not None:
                side = await _start_metrics(
                    served.metrics, metrics_listener, settings.request_head_seconds
                )
                if on_metrics_started is not None:
                    on_metrics_started(_url("http", metrics_listener))
            await server.serve(sockets=[listener])
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            listener.close()
            await _stop_metrics(side, metrics_listener)


async def _start_metrics(
    app: ASGIApp, listener: socket.socket, head_seconds: float
) -> tuple[_MetricsServer, asyncio.Task[None]]:
    config = uvicorn.Config(
        app,
        log_config=None,  # the broker's server configured uvicorn's loggers already
        log_level=None,
        access_log=False,
        lifespan="off",
        interface="asgi3",
        http=deadline_protocol(head_seconds),
        ws="none",
        loop="asyncio",
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=1,
    )
    server = _MetricsServer(config)
    task = asyncio.create_task(_serve_metrics(server, listener))
    up = asyncio.create_task(server.up.wait())
    await asyncio.wait({task, up}, return_when=asyncio.FIRST_COMPLETED)
    up.cancel()
    if task.done():
        task.result()  # its failure, raised here
    return server, task


async def _serve_metrics(server: _MetricsServer, listener: socket.socket) -> None:
    _in_metrics_server.set(True)  # this task's context only: its lifecycle lines are dropped
    await server.serve(sockets=[listener])


async def _stop_metrics(
    side: tuple[_MetricsServer, asyncio.Task[None]] | None, listener: socket.socket | None
) -> None:
    if side is not None:
        server, task = side
        server.should_exit = True
        await task
    if listener is not None:
        listener.close()


def _configure_logging(level: str, log_format: str = "text") -> None:
    """The broker's own messages on standard error, at ``level``: text (``TextFormatter``;
    uvicorn's loggers get it too, through ``TEXT_LOGGING``), or JSON lines (``"log":
    "broker"``) for the broker's and uvicorn's loggers alike. Either way a value a message
    quotes cannot end its line or forge another."""
    numeric = _TRACE if level == "trace" else level.upper()
    names = (
        ("k8s_agent_sandbox_awx", "uvicorn") if log_format == "json" else ("k8s_agent_sandbox_awx",)
    )
    for name in names:
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
            logger.addHandler(handler)
        logger.setLevel(numeric)
        if log_format == "json":
            logger.propagate = False


def serve(
    served: ServedApp,
    settings: ServerSettings,
    *,
    on_started: Callable[[str], None] | None = None,
    metrics: MetricsSettings | None = None,
    on_metrics_started: Callable[[str], None] | None = None,
    log_format: str = "text",
    about: Mapping[str, str] | None = None,
) -> None:
    """Run the server in this thread until SIGTERM or SIGINT (then it returns): see
    :func:`run_server`; ``log_format``: ``[logging] format``. Once it accepts connections,
    what the start-up made is frozen out of the garbage collector's full collections (see
    the module's docstring)."""
    _configure_logging(settings.log_level, log_format)

    def started(url: str) -> None:
        gc.collect()
        gc.freeze()  # start-up's objects live as long as the process: no full pass needs them
        if on_started is not None:
            on_started(url)

    asyncio.run(
        run_server(
            served,
            settings,
            on_started=started,
            metrics=metrics,
            on_metrics_started=on_metrics_started,
            log_format=log_format,
            about=about,
        )
    )
