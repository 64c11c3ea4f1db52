"""The errors a token verification raises: a ``401`` with a code and a reason, or (an issuer
whose keys the broker had and has lost) a ``503``."""

from __future__ import annotations

__all__ = ["IssuerUnavailable", "TokenRejected", "short"]


class TokenRejected(Exception):
    """A 401: ``code`` is one of the broker API's 401 codes; ``detail`` never holds the token;
    ``logged`` (default: ``detail``) is what the logs get.
    ``identity``: the ``(iss, sub)`` the token proved when its signature verified and a claim
    rule refused it after (expired, wrong audience, revoked); ``None`` when nothing was proven
    (malformed, forged, unknown issuer), so that a refusal is never attributed to an identity
    a forger named."""

    def __init__(self, code: str, detail: str, *, logged: str | None = None) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.logged = detail if logged is None else logged
        """The reason the audit log gets: ``detail`` without the token's own claims where the
        detail quotes them (a forged token's ``iss`` or ``kid`` is the caller's text)."""
        self.identity: tuple[str, str] | None = None


class IssuerUnavailable(Exception):
    """A 503 ``issuer_unavailable``: the token's issuer had keys since the broker started, but
    its last good keys are past ``jwks_max_stale_seconds`` and cannot be fetched again (an
    outage of that issuer, not a bad token). ``retry_after``: seconds until the next fetch may
    be tried. ``detail`` never holds the token."""

    code = "issuer_unavailable"

    def __init__(self, detail: str, retry_after: int) -> None:
        super().__init__(f"{self.code}: {detail}")
        self.detail = detail
        self.retry_after = retry_after


def short(value: object, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters (claims echoed in a reason stay readable)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
