"""What a data-plane request names: its router headers (the sandbox, its namespace, the port,
the timeout), its method and its target, checked before the forward looks anything up
(:func:`data_request`; a WebSocket handshake's router headers: :func:`router_headers`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from starlette.requests import HTTPConnection, Request

from ..backends._interface import RUNTIME_PORT
from ..common._errors import ApiError
from ..common._gate import origin_form
from ..common._metadata import DNS_LABEL
from ._target import CODE as TARGET_CODE
from ._target import NonNormalTarget, Target, checked_target, port_target

DEFAULT_DATA_PLANE_TIMEOUT = 300.0
"""Seconds the router waits for a sandbox's answer when the request names no
X-Sandbox-Timeout."""
_PORT = re.compile(r"^[0-9]{1,5}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
"""Data-plane methods without a request body (one sent with them is refused)."""


@dataclass(frozen=True)
class DataRequest:
    """A data-plane request's router headers and its checked target."""

    sandbox_id: str
    namespace: str
    port: int
    timeout: float
    target: Target

    @property
    def port_request(self) -> bool:
        """A request to a port of the user's own (not the runtime's: docs/broker-api.md,
        "Ports"): its target is forwarded as sent (:func:`._target.port_target`)."""
        return self.port != RUNTIME_PORT


def data_request(request: Request) -> DataRequest:
    """The router headers (X-Sandbox-ID, -Namespace, -Port, -Timeout) and the target of a
    data-plane request, checked (400 naming the header or the rule); its method too
    (:func:`_check_method`). The target of a request to the runtime's port is in normal form
    (:func:`._target.checked_target`); a port request's is forwarded as sent
    (:func:`._target.port_target`)."""
    _check_method(request)
    sandbox_id, namespace, port, timeout = router_headers(request)
    if _CONTROL.search(request.scope["path"]):  # the whole decoded path ("%3F" included)
        raise ApiError(
            400, "invalid_path", "the path contains control characters (after URL decoding)"
        )
    # The one target every decision is made on, and the bytes that are forwarded.
    try:
        check = port_target if port != RUNTIME_PORT else checked_target
        target = check(origin_form(request.scope))
    except NonNormalTarget as exc:
        raise ApiError(400, TARGET_CODE, exc.detail) from None
    return DataRequest(sandbox_id, namespace, port, timeout, target)


def _check_method(request: Request) -> None:
    """What the router forwards is what was checked: the method is in upper case (HTTP
    methods are case-sensitive, RFC 9110 section 9.1, and the router's HTTP client sends
    ``post`` as ``POST``, which would run as a method other than the one checked and counted),
    and a method without a body (:data:`BODYLESS`) carries none. ``CONNECT`` asks for a
    tunnel, which the data plane does not open (a ``2xx`` to it makes the broker's server and
    its HTTP clients switch protocols, so no answer could be relayed)."""
    method = request.method
    shown = method if len(method) <= 20 else method[:17] + "..."
    if method == "CONNECT":
        raise ApiError(
            400,
            "invalid_method",
            "CONNECT asks for a tunnel, which the broker does not open to a sandbox: send the "
            "request itself (a WebSocket to a port of the sandbox for a two-way stream)",
        )
    if method != method.upper():
        raise ApiError(
            400,
            "invalid_method",
            f"the request method {shown!r} is not in upper case: HTTP methods are "
            f"case-sensitive (RFC 9110, section 9.1); send {shown.upper()!r}",
        )
    length = request.headers.get("content-length", "0").strip()
    if method in BODYLESS and ("transfer-encoding" in request.headers or length != "0"):
        raise ApiError(
            400,
            "invalid_request",
            f"a {method} request to a sandbox carries no body (it would not be forwarded); "
            "send it without one (no Content-Length other than 0, no Transfer-Encoding)",
        )


def router_headers(request: HTTPConnection) -> tuple[str, str, int, float]:
    """The router headers of ``request`` (X-Sandbox-ID, -Namespace, -Port, -Timeout), checked:
    400 ``invalid_header`` naming the header and its rule (a WebSocket handshake's too)."""
    headers = request.headers
    sandbox_id = headers.get("x-sandbox-id", "")
    if len(sandbox_id) > 63 or not DNS_LABEL.match(sandbox_id):
        raise ApiError(
            400,
            "invalid_header",
            "X-Sandbox-ID must be a DNS-1123 label (lowercase alphanumerics and '-', at most "
            "63 characters)",
        )
    namespace = headers.get("x-sandbox-namespace", "default")
    if len(namespace) > 63 or not DNS_LABEL.match(namespace):
        raise ApiError(400, "invalid_header", "X-Sandbox-Namespace must be a DNS-1123 label")
    raw_port = headers.get("x-sandbox-port", str(RUNTIME_PORT))
    # ASCII digits only: str.isdigit() is true for the Latin-1 superscripts, which int() refuses
    if not _PORT.match(raw_port) or not 1 <= int(raw_port) <= 65535:
        raise ApiError(400, "invalid_header", "X-Sandbox-Port must be an integer from 1 to 65535")
    timeout = DEFAULT_DATA_PLANE_TIMEOUT
    raw_timeout = headers.get("x-sandbox-timeout")
    if raw_timeout is not None:
        try:
            timeout = float(raw_timeout)
        except ValueError:
            timeout = -1.0
        if not 0 < timeout <= 86400:
            raise ApiError(
                400,
                "invalid_header",
                "X-Sandbox-Timeout must be a positive number of seconds (at most 86400)",
            )
    return sandbox_id, namespace, int(raw_port), timeout
