"""The request gate: what every request passes before the broker acts on it.

- the request target: origin-form only (:func:`origin_form`; a data-plane request's router
  headers, method and normal-form target are :mod:`..dataplane._data_request`'s);
- the caller: a bearer token verified against the trusted issuers (:class:`Gate`:
  ``authenticate``, over :class:`.identity._verify.TokenVerifier`; a refusal is ``401`` with a
  ``WWW-Authenticate`` challenge);
- the body: JSON of at most :data:`MAX_JSON_BODY` bytes (:meth:`Gate.json_body`).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import HTTPConnection, Request
from starlette.types import Scope

from ..identity._policy import Caller
from ..identity._rejection import IssuerUnavailable, TokenRejected
from ..identity._verify import TokenVerifier
from ._errors import ApiError
from ._observed import note_caller, note_rejection

MAX_JSON_BODY = 1024 * 1024


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
            note_rejection(exc.code, exc.logged, exc.identity, authorization)
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
