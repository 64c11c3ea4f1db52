"""Why a sandbox could not be reached: one answer for the HTTP and the WebSocket paths.

A connection the broker could not make is the broker's ``502``; which one says what failed:

- the sandbox's port refused the connection, straight to it (the pod's IP, the local host):
  ``port_not_listening`` for a port request (:func:`._ports.not_listening`);
- through a router, the router's own answer that it could not connect to the sandbox (upstream's
  routers, the Python and the Go one: ``502 {"detail": "Could not connect to the backend
  sandbox: ID"}``, ``ID`` the X-Sandbox-ID they were sent) is ``port_not_listening`` for a port
  request and ``sandbox_unreachable`` naming the pod IP it was sent for the runtime's port
  (:func:`router_not_connected`); its ``504 {"detail": "Timed out waiting for the backend
  sandbox: ID"}`` (the Python router's proxy timeout, ``PROXY_TIMEOUT_SECONDS``, 180 s by
  default, passed without an answer) is ``sandbox_timeout`` naming that setting; any other
  answer of the router is relayed;
- a TLS failure (the router's certificate not verified, or no TLS where ``https`` was asked):
  ``sandbox_unreachable`` naming TLS verification and ``router_ca_file``;
- a router that cannot be reached: ``sandbox_unreachable`` naming the router's address;
- anything else: ``sandbox_unreachable`` (the path's own words).

Never a header, a token or the request's path in a detail: addresses and reasons only.
"""

from __future__ import annotations

import errno
import json
import socket
import ssl
from collections.abc import AsyncIterator
from typing import TypeVar

import httpx

from ..backends._interface import Route
from ..common._errors import ApiError
from ._ports import not_listening
from ._relay import Answer

__all__ = ["ROUTER_NOT_CONNECTED", "connect_failure", "router_not_connected", "tls_failure"]

ROUTER_NOT_CONNECTED = "Could not connect to the backend sandbox: "
"""How upstream's routers begin the detail of their ``502`` for a sandbox they could not
connect to (the sandbox's id follows)."""
ROUTER_TIMED_OUT = "Timed out waiting for the backend sandbox: "
"""How upstream's Python router begins the detail of its ``504``: the sandbox did not answer
within its proxy timeout (the sandbox's id follows)."""
MAX_ROUTER_ANSWER = 4096
"""The largest router ``502`` the broker reads to recognise it (a larger one is relayed)."""
_UNREACHABLE_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT}
)

E = TypeVar("E", bound=BaseException)


def cause(exc: BaseException, kind: type[E]) -> E | None:
    """``exc`` or the first exception of ``kind`` it was raised from (or while handling)."""
    seen: BaseException | None = exc
    for _ in range(16):  # httpx -> httpcore -> anyio -> the socket's error; never a loop
        if seen is None:
            return None
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _why(exc: BaseException) -> str:
    error = cause(exc, OSError)
    if error is not None and error.strerror:
        return error.strerror
    return type(error or exc).__name__


def tls_failure(route: Route, error: ssl.SSLError, name: str, port: int | None) -> ApiError:
    """The answer for a TLS handshake with the route's server (a router) that failed."""
    to = f"port {port} of sandbox {name!r}" if port is not None else f"sandbox {name!r}"
    where = f"{'the router at ' if route.via_router else ''}{route.host}:{route.port}"
    if isinstance(error, ssl.SSLCertVerificationError):
        why = error.verify_message or error.reason or type(error).__name__
        return ApiError(
            502,
            "sandbox_unreachable",
            f"the connection to {to} was refused: TLS verification of {where} failed ({why}); "
            "its certificate must be signed by the CA the backend trusts for it (Kubernetes: "
            "backend.kubernetes.router_ca_file)",
        )
    return ApiError(
        502,
        "sandbox_unreachable",
        f"the connection to {to} failed: the TLS handshake with {where} failed "
        f"({error.reason or type(error).__name__}); check that it serves TLS (Kubernetes: an "
        "https:// backend.kubernetes.router_url) and that backend.kubernetes.router_ca_file "
        "is its CA",
    )


def _router_unreachable(route: Route, name: str, timed_out: bool, why: str) -> ApiError:
    return ApiError(
        502,
        "sandbox_unreachable",
        f"cannot connect to the router at {route.host}:{route.port} "
        f"(backend.kubernetes.router_url; {'timed out' if timed_out else why}): nothing was "
        f"sent to sandbox {name!r}; check that the router runs and that router_url is its "
        "Service's address",
    )


def connect_failure(
    route: Route, exc: BaseException, name: str, port: int | None
) -> ApiError | None:
    """The answer for a connection to ``route`` that could not be made (``exc``; ``port``:
    the port of a port request, ``None`` for the runtime's), or ``None`` when no rule of this
    module says more than the path's own default (see the module)."""
    tls = cause(exc, ssl.SSLError)
    if tls is not None:
        return tls_failure(route, tls, name, port)
    timed_out = isinstance(exc, httpx.ConnectTimeout)  # a WebSocket's TimeoutError: any step
    if route.via_router and (isinstance(exc, httpx.ConnectError) or timed_out or _unreachable(exc)):
        return _router_unreachable(route, name, timed_out, _why(exc))
    if port is not None and not route.via_router and cause(exc, ConnectionRefusedError):
        return not_listening(name, port)
    return None


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server could not be reached (refused, no route, no name)."""
    error = cause(exc, OSError)
    return isinstance(error, socket.gaierror) or (
        error is not None and error.errno in _UNREACHABLE_ERRNOS
    )


def _router_says(route: Route, status: int, body: bytes) -> str | None:
    """What a router's own error answer says (:data:`ROUTER_NOT_CONNECTED` or
    :data:`ROUTER_TIMED_OUT`) when it is about the X-Sandbox-ID the route sent; else ``None``."""
    if not route.via_router or status not in (502, 504) or len(body) > MAX_ROUTER_ANSWER:
        return None
    sent = dict(route.headers).get(b"x-sandbox-id", b"").decode("latin-1")
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    detail = answer.get("detail") if isinstance(answer, dict) else None
    for says, code in ((ROUTER_NOT_CONNECTED, 502), (ROUTER_TIMED_OUT, 504)):
        if status == code and detail == says + sent:
            return says
    return None


def says_not_connected(route: Route, status: int, body: bytes) -> bool:
    """Whether a router answered ``status`` and ``body`` because it could not connect to the
    sandbox (see the module): upstream's ``502`` naming the X-Sandbox-ID the route sent."""
    return _router_says(route, status, body) == ROUTER_NOT_CONNECTED


def _router_error(route: Route, says: str, name: str, port: int | None) -> ApiError:
    if says == ROUTER_TIMED_OUT:
        return ApiError(
            504,
            "sandbox_timeout",
            f"the router at {route.host}:{route.port} gave up waiting for sandbox {name!r} "
            "(its proxy timeout: PROXY_TIMEOUT_SECONDS of upstream's router, 180 s by default); "
            "the request may have reached the sandbox. A command that runs longer needs a "
            "runtime with streamed commands (this project's), or the router's "
            "PROXY_TIMEOUT_SECONDS raised (docs/broker/kubernetes.md, 'Long requests')",
        )
    if port is not None:
        return not_listening(name, port, via_router=True)
    pod_ip = dict(route.headers).get(b"x-sandbox-pod-ip", b"").decode("latin-1")
    how = (
        f"its pod IP {pod_ip} did not answer"
        if pod_ip
        else "its claim has no pod IP yet and the Sandbox has no Service (template service: true)"
    )
    return ApiError(
        502,
        "sandbox_unreachable",
        f"the router at {route.host}:{route.port} could not connect to sandbox {name!r}: {how}",
    )


async def router_not_connected(
    response: Answer, route: Route, name: str, port: int | None
) -> AsyncIterator[bytes]:
    """The raw body of ``response`` to relay, unless it is the router's own answer that it
    could not connect to the sandbox (``port``: that of a port request, raised as
    :func:`._ports.not_listening`; ``None``, the runtime's: ``sandbox_unreachable``) or that
    the sandbox did not answer in its time (``sandbox_timeout``): see the module. Only a small
    ``502`` or ``504`` with a length through a router is read first (:data:`MAX_ROUTER_ANSWER`)."""
    length = response.headers.get("content-length", "")
    small = length.isdigit() and int(length) <= MAX_ROUTER_ANSWER
    if not (route.via_router and response.status_code in (502, 504) and small):
        return response.aiter_raw()
    body = b"".join([chunk async for chunk in response.aiter_raw()])
    says = _router_says(route, response.status_code, body)
    if says is not None:
        raise _router_error(route, says, name, port)
    return _replay(body)


async def _replay(body: bytes) -> AsyncIterator[bytes]:
    yield body
