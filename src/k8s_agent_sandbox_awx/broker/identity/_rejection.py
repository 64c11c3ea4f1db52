"""The one error a token verification raises: a ``401`` with a code and a reason."""

from __future__ import annotations

__all__ = ["TokenRejected", "short"]


class TokenRejected(Exception):
    """A 401: ``code`` is one of the broker API's 401 codes; ``detail`` never holds the token.
    ``identity``: the ``(iss, sub)`` the token proved when its signature verified and a claim
    rule refused it after (expired, wrong audience, revoked); ``None`` when nothing was proven
    (malformed, forged, unknown issuer), so that a refusal is never attributed to an identity
    a forger named."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.identity: tuple[str, str] | None = None


def short(value: object, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters (claims echoed in a reason stay readable)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
