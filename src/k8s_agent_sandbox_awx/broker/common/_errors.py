"""The broker's own error answers: :class:`ApiError` (``{"detail", "code"}``), marked as the
broker's by a header that no forwarded answer carries."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse, Response

BROKER_ERROR_HEADER = "Agent-Sandbox-Broker-Error"
"""Set (to the error code) on every error answer the broker itself makes, never on a
forwarded one: the client re-sends after a 401 only when it carries a token code."""
BROKER_ERROR_HEADER_RAW = BROKER_ERROR_HEADER.lower().encode("latin-1")

BACKEND_RETRY_AFTER = 2
"""Seconds a ``503 backend_unavailable`` asks the client to wait (``Retry-After``): the same
on both planes, both dialects and WebSocket handshakes."""


class ApiError(Exception):
    """An error response of the broker API (``{"detail", "code"}``). ``logged``: the reason the
    audit log gets (default: ``detail``), given where the detail quotes what the caller sent (a
    path, a header's or a body's value): the logs name the input and the rule, never its value
    (docs/broker/operate.md); the caller's answer quotes it."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        headers: Mapping[str, str] | None = None,
        *,
        logged: str | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = dict(headers or {})
        self.logged = detail if logged is None else logged

    def response(self) -> Response:
        # the mark of the broker's own answers: stripped from every forwarded answer, so a
        # sandbox runtime cannot pass its answer off as the broker's (docs/broker-api.md)
        headers = {**self.headers, BROKER_ERROR_HEADER: self.code}
        return JSONResponse(
            {"detail": self.detail, "code": self.code}, self.status, headers=headers
        )
