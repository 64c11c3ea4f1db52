"""Scripted broker answers that repeat a secret (the caller's token, another bearer token, a
JWT), each in another part of the answer, and what an error shows of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

ECHO_CALLER_TOKEN = "opaque-caller-token-0123456789"
ECHO_OTHER_JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJzb21lb25lIn0.c2lnbmF0dXJlLW9mLWFub3RoZXI"
ECHO_OTHER_BEARER = "0p4qu3-4cc355-t0k3n-fr0m-3ls3wh3r3"


class TokenEcho:
    """One server answer that repeats a secret: ``op`` (``"whoami"``, ``"list"`` or
    ``"create"``) gets ``answer`` from a scripted broker and must raise ``error`` (the name of
    an exception class the package exports). The client's token is ``CALLER_TOKEN``."""

    CALLER_TOKEN = ECHO_CALLER_TOKEN

    def __init__(self, name: str, op: str, error: str, answer: Callable[[], Any]) -> None:
        self.name, self.op, self.error, self.answer = name, op, error, answer

    def handler(self, request: Any) -> Any:
        if request.method == "DELETE":
            return httpx.Response(204)
        return self.answer()

    def secrets(self) -> list[str]:
        """What must never show: the caller's token, the other tokens and each JWT part."""
        jwt_parts = ECHO_OTHER_JWT.split(".")[1:]
        return [ECHO_CALLER_TOKEN, ECHO_OTHER_BEARER, *jwt_parts, jwt_parts[0][:12]]


def token_echoes() -> list[TokenEcho]:
    """Scripted broker answers (for httpx.MockTransport) that repeat the caller's token
    (``ECHO_CALLER_TOKEN``), a bearer token or a JWT, each in another part of the answer."""

    def sandbox(**extra: Any) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "name": "sbx-1",
            "namespace": "default",
            "phase": "Pending",
            "router": {"sandbox_id": "sbx-1", "namespace": "default", "port": 8888},
        }
        obj.update(extra)
        return obj

    caller = ECHO_CALLER_TOKEN
    return [
        TokenEcho(
            "401 detail repeats the Authorization header",
            "whoami",
            "BrokerAuthenticationError",
            lambda: httpx.Response(
                401,
                json={"code": "token_revoked", "detail": f"got Authorization: Bearer {caller}"},
            ),
        ),
        TokenEcho(
            "400 detail is an object with the headers and a JWT",
            "whoami",
            "BrokerError",
            lambda: httpx.Response(
                400,
                json={
                    "code": "invalid_request",
                    "detail": {"authorization": f"Bearer {caller}", "jwt": ECHO_OTHER_JWT},
                },
            ),
        ),
        TokenEcho(
            "the caller's bare token and another bearer token in a text body",
            "whoami",
            "BrokerUnavailableError",
            lambda: httpx.Response(
                502, text=f"upstream rejected Bearer {ECHO_OTHER_BEARER}; you sent {caller}"
            ),
        ),
        TokenEcho(
            "a JWT cut by the length limit of a text body",
            "whoami",
            "BrokerError",
            lambda: httpx.Response(400, text="x" * 264 + " " + ECHO_OTHER_JWT),
        ),
        TokenEcho(
            "a redirect to a URL with a token",
            "whoami",
            "BrokerRedirectError",
            lambda: httpx.Response(
                307, headers={"Location": f"https://elsewhere.example/?t={ECHO_OTHER_JWT}"}
            ),
        ),
        TokenEcho(
            "a Retry-After header with a bearer token",
            "whoami",
            "BrokerQuotaError",
            lambda: httpx.Response(
                429,
                json={"code": "rate_limited", "detail": "slow down"},
                headers={"Retry-After": f"Bearer {ECHO_OTHER_BEARER}"},
            ),
        ),
        TokenEcho(
            "a 200 answer that is not JSON",
            "whoami",
            "BrokerProtocolError",
            lambda: httpx.Response(200, text=f"hello {ECHO_OTHER_JWT}"),
        ),
        TokenEcho(
            "a Sandbox object with a token in a bad field",
            "list",
            "BrokerProtocolError",
            lambda: httpx.Response(
                200,
                json={"items": [sandbox(router={"sandbox_id": "s", "port": ECHO_OTHER_JWT})]},
            ),
        ),
        TokenEcho(
            "a Failed sandbox whose message has a token",
            "create",
            "SandboxFailedError",
            lambda: httpx.Response(
                201,
                json=sandbox(
                    phase="Failed",
                    reason=f"Bearer {ECHO_OTHER_BEARER}",
                    message=f"pull failed with {ECHO_OTHER_JWT}",
                ),
            ),
        ),
    ]


def leaked(error: BaseException, echo: TokenEcho) -> list[str]:
    """The secrets of ``echo`` found in anything ``error`` shows: str, repr, notes and the
    text attributes (``detail``, ``location``, ``reason``)."""
    shown = [str(error), repr(error), *getattr(error, "__notes__", [])]
    shown += [str(getattr(error, name, "")) for name in ("detail", "location", "reason")]
    return [secret for secret in echo.secrets() if any(secret in text for text in shown)]
