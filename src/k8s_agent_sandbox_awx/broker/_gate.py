"""The request gate: what every request passes before the broker acts on it.

- the request target: origin-form only (:func:`origin_form`), and for the data plane in normal
  form (:func:`data_request`, see :mod:`._target`), with the router's headers and the method
  checked (upper case; no body on a method without one);
- the caller: a bearer token verified against the trusted issuers (:class:`Gate`:
  ``authenticate``, over :class:`.identity._verify.TokenVerifier`; a refusal is ``401`` with a
  ``WWW-Authenticate`` challenge);
- the body: JSON of at most :data:`MAX_JSON_BODY` bytes (:meth:`Gate.json_body`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from starlette.requests import HTTPConnection, Request
from starlette.types import Scope

from ._errors import ApiError
from ._metadata import DNS_LABEL
from ._observed import note_caller, note_rejection
from ._target import CODE as TARGET_CODE
from ._target import NonNormalTarget, Target, checked_target, port_target
from .backends._interface import RUNTIME_PORT
from .identity._policy import Caller
from .identity._rejection import IssuerUnavailable, TokenRejected
from .identity._verify import TokenVerifier

MAX_JSON_BODY = 1024 * 1024
DEFAULT_DATA_PLANE_TIMEOUT = 300.0
"""Seconds the router waits for a sandbox's answer when the request names no
X-Sandbox-Timeout."""
_PORT = re.compile(r"^[0-9]{1,5}$")
BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
"""Data-plane methods without a request body (one sent with them is refused)."""


def origin_form(scope: Scope) -> bytes:
    """The request target (path and query, raw) if it is origin-form ('/' + path), else 400.

    The absolute form (``http://host:port/path``), the authority form (``host:port``), the
    asterisk form and anything else not starting with '/' (``@host:port/path``) are refused:
    such a target must never become part of the authority of the URL the router forwards to.
    """
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    if not raw_path.startswith(b"/"):
        raise ApiError(
            400,
            "invalid_path",
            "the request target must be origin-form ('/' followed by the path, as in "
            "'GET /download/file HTTP/1.1'), not an absolute URL, an authority or '*'",
        )
    query: bytes = scope.get("query_string") or b""
    target = raw_path + b"?" + query if query else raw_path
    if b"#" in target or not target.isascii():
        raise ApiError(
            400,
            "invalid_path",
            "the request target has a fragment ('#') or a non-ASCII byte; percent-encode them",
        )
    return target


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
    sandbox_id, namespace, port, timeout = _router_headers(request)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in request.url.path):
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
    and a method without a body (:data:`BODYLESS`) carries none."""
    method = request.method
    shown = method if len(method) <= 20 else method[:17] + "..."
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


def _router_headers(request: HTTPConnection) -> tuple[str, str, int, float]:
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


def auth_header(detail: str) -> str:
    """The ``WWW-Authenticate`` challenge of a refused token (RFC 6750)."""
    safe = detail.replace("\\", "\\\\").replace('"', "'")
    safe = safe.encode("ascii", "replace").decode("ascii")
    return f'Bearer error="invalid_token", error_description="{safe}"'


class Gate:
    """Authentication and bodies: ``verifier`` checks the bearer tokens of the trusted
    issuers (the local broker's, or a configuration's)."""

    def __init__(self, verifier: TokenVerifier[Any]) -> None:
        self.verifier = verifier

    async def authenticate(self, request: HTTPConnection) -> Caller:
        """The caller of ``request``, as its token proves it; 401 otherwise (either is noted
        for the access and audit logs: :mod:`._observed`)."""
        authorization = request.headers.get("authorization")
        try:
            caller, _ = await self.verifier.verify(authorization)
        except TokenRejected as exc:
            note_rejection(exc.code, exc.detail, exc.identity, authorization)
            raise ApiError(
                401, exc.code, exc.detail, {"WWW-Authenticate": auth_header(exc.detail)}
            ) from None
        except IssuerUnavailable as exc:  # that issuer's outage: retryable, not a bad token
            note_rejection(exc.code, exc.detail, None, authorization)
            raise ApiError(
                503, exc.code, exc.detail, {"Retry-After": str(exc.retry_after)}
            ) from None
        note_caller(caller, authorization)
        return caller

    async def json_body(self, request: Request) -> Any:
        """The body as JSON (an empty body: ``{}``); 413 beyond :data:`MAX_JSON_BODY`."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_JSON_BODY:
            raise ApiError(413, "too_large", f"the body is over {MAX_JSON_BODY} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_JSON_BODY:
                raise ApiError(413, "too_large", f"the body is over {MAX_JSON_BODY} bytes")
        if not body.strip():
            return {}
        try:
            return json.loads(body)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", f"the body is not valid JSON: {exc}") from None

    async def close(self) -> None:
        await self.verifier.aclose()
