"""Why a sandbox could not be reached: one answer for the HTTP and the WebSocket paths.

A connection the broker could not make is the broker's ``502``; which one says what failed:

- the sandbox's port refused the connection, straight to it (the pod's IP, the local host):
  ``port_not_listening`` for a port request (:func:`._ports.not_listening`);
- through a router, the router's own answer that it could not connect to the sandbox (upstream's
  routers, the Python and the Go one: ``502 {"detail": "Could not connect to the backend
  sandbox: ID"}``, ``ID`` the X-Sandbox-ID they were sent) is ``port_not_listening`` for a port
  request (:func:`router_not_connected`); any other answer of the router is relayed;
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

from ._errors import ApiError
from ._ports import not_listening
from .backends._interface import Route

__all__ = ["ROUTER_NOT_CONNECTED", "connect_failure", "router_not_connected", "tls_failure"]

ROUTER_NOT_CONNECTED = "Could not connect to the backend sandbox: "
"""How upstream's routers begin the detail of their ``502`` for a sandbox they could not
connect to (the sandbox's id follows)."""
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


def says_not_connected(route: Route, status: int, body: bytes) -> bool:
    """Whether a router answered ``status`` and ``body`` because it could not connect to the
    sandbox (see the module): upstream's ``502`` naming the X-Sandbox-ID the route sent."""
    if not route.via_router or status != 502 or len(body) > MAX_ROUTER_ANSWER:
        return False
    sent = dict(route.headers).get(b"x-sandbox-id", b"").decode("latin-1")
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    return isinstance(answer, dict) and answer.get("detail") == ROUTER_NOT_CONNECTED + sent


async def router_not_connected(
    response: httpx.Response, route: Route, name: str, port: int
) -> AsyncIterator[bytes]:
    """The raw body of ``response`` to relay, unless it is the router's answer that it could
    not connect to ``port``: then :func:`._ports.not_listening` is raised. Only a small ``502``
    with a length through a router is read first (see :data:`MAX_ROUTER_ANSWER`)."""
    length = response.headers.get("content-length", "")
    small = length.isdigit() and int(length) <= MAX_ROUTER_ANSWER
    if not (route.via_router and response.status_code == 502 and small):
        return response.aiter_raw()
    body = b"".join([chunk async for chunk in response.aiter_raw()])
    if says_not_connected(route, response.status_code, body):
        raise not_listening(name, port, via_router=True)
    return _replay(body)


async def _replay(body: bytes) -> AsyncIterator[bytes]:
    yield body
