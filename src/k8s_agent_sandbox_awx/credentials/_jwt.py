"""Client-side JWT inspection: decode without verifying, pin the audience, check expiry.

Everything here is pure (no I/O, the clock is a parameter), so the sync path and a future async
path share it. The broker verifies signatures; the client only refuses to *send* a token that
is expired or meant for another service.

Rules (documented in ``docs/credentials.md``):

- A token "looks like a JWT" when it has exactly three ``.``-separated parts and the first part
  starts with ``eyJ`` (the base64url encoding of ``{"``). Such a token must decode (base64url
  header and payload, each a JSON object, standard JSON without ``NaN``/``Infinity``, nested at
  most ``MAX_CLAIM_DEPTH`` levels) or it is a :class:`MalformedTokenError`, whatever made the
  decoding fail. Any other token is opaque and passes through unchanged (no audience or expiry
  check is possible).
- Expired: ``now > exp + CLOCK_SKEW_SECONDS``.
- Audience: ``aud`` (a string or a list of strings) must contain the broker URL, compared with
  :func:`normalise_url`. A JWT without ``aud`` is refused.
- Cache lifetime of a non-file credential: until ``exp - min(60 s, 10 % of the lifetime)``, never
  past ``exp``; a token without ``exp`` (or an opaque token) is cached for ``DEFAULT_TTL_SECONDS``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .. import _urls
from ._credential import Credential
from ._credential_errors import (
    AudienceMismatchError,
    EmptyCredentialError,
    MalformedTokenError,
    TokenExpiredError,
)

__all__ = [
    "CLOCK_SKEW_SECONDS",
    "DEFAULT_TTL_SECONDS",
    "MAX_CACHE_MARGIN_SECONDS",
    "MAX_CLAIM_DEPTH",
    "DecodedToken",
    "cache_deadline",
    "check_credential",
    "clear_claims_cache",
    "decode_token",
    "looks_like_jwt",
    "normalise_url",
    "redact",
]

CLOCK_SKEW_SECONDS = 30.0
"""A token is refused as expired only when ``now > exp + CLOCK_SKEW_SECONDS``."""

DEFAULT_TTL_SECONDS = 60.0
"""How long a non-file credential without ``exp`` (or an opaque token) stays in the cache."""

MAX_CACHE_MARGIN_SECONDS = 60.0
"""A cached credential is dropped ``min(60 s, 10 % of its lifetime)`` before its ``exp``."""

CACHE_MARGIN_FRACTION = 0.1

MAX_TOKEN_CHARS = 64 * 1024
"""Longer tokens are refused (MalformedTokenError): no real OIDC token is that large."""

MAX_CLAIM_DEPTH = 32
"""How deeply a JWT's header or payload may nest (objects and arrays): real OIDC claims nest a
few levels; deeper JSON is refused (MalformedTokenError), so that decoding never depends on the
caller's stack depth and nothing that shows the claims can exceed Python's recursion limit."""

_B64URL = re.compile(r"[A-Za-z0-9_-]*")
_JWT_LIKE = re.compile(r"eyJ[A-Za-z0-9_=+/-]*\.[A-Za-z0-9_=+/-]*\.[A-Za-z0-9_=+/-]*")


@dataclass(frozen=True, eq=False)
class DecodedToken:
    """The unverified header and payload of a JWT (never the signature)."""

    header: Mapping[str, Any]
    payload: Mapping[str, Any]
    exp: float | None
    iat: float | None
    audiences: tuple[str, ...]
    """The ``aud`` claim as a tuple (empty if absent)."""
    normalised_audiences: frozenset[str]

    def claims(self) -> dict[str, dict[str, Any]]:
        """A JSON-ready copy: ``{"header": {...}, "payload": {...}}``."""
        return {"header": dict(self.header), "payload": dict(self.payload)}


class _DecodeError(ValueError):
    """Internal: why a JWT-looking token failed to decode (never contains the token)."""


def looks_like_jwt(token: str) -> bool:
    """True when ``token`` has three dot-separated parts and a header starting with ``eyJ``."""
    return token.startswith("eyJ") and token.count(".") == 2


def normalise_url(url: str) -> str:
    """The comparison form of a URL: scheme and host lower-cased, default port dropped.

    A trailing slash is ignored (``https://b.example/`` equals ``https://b.example``); the path is
    otherwise compared exactly and a query or fragment is kept. A string that is not an absolute
    URL is only stripped of surrounding whitespace and one trailing slash. (The one URL rule,
    shared with the broker: ``k8s_agent_sandbox_awx._urls``.)
    """
    return _urls.normalise_url(url)


def _b64_json(segment: str, what: str) -> dict[str, Any]:
    if not _B64URL.fullmatch(segment):
        raise _DecodeError(f"the {what} is not base64url (characters outside A-Z a-z 0-9 - _)")
    try:
        raw = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
    except (binascii.Error, ValueError):
        raise _DecodeError(f"the {what} is not valid base64url") from None
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        value = None  # nested far deeper than the limit: refused below
    except (UnicodeDecodeError, ValueError):
        raise _DecodeError(f"the {what} is not UTF-8 JSON (RFC 8259)") from None
    if value is None or _too_deep(value):
        raise _DecodeError(f"the {what} is nested more than {MAX_CLAIM_DEPTH} levels deep")
    if not isinstance(value, dict):
        raise _DecodeError(f"the {what} is JSON but not an object")
    return value


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _too_deep(value: object) -> bool:
    """True when ``value`` nests objects/arrays more than ``MAX_CLAIM_DEPTH`` levels (no
    recursion: an explicit stack)."""
    stack: list[tuple[Iterable[object], int]] = [([value], 0)]
    while stack:
        items, depth = stack.pop()
        for item in items:
            if isinstance(item, dict | list):
                if depth >= MAX_CLAIM_DEPTH:
                    return True
                stack.append((item.values() if isinstance(item, dict) else item, depth + 1))
    return False


def _number(payload: Mapping[str, Any], claim: str) -> float | None:
    value = payload.get(claim)
    if value is None:
        return None
    if not isinstance(value, bool) and isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:
            pass
        else:
            if math.isfinite(number):  # 1e400 parses as inf: a token that would never expire
                return number
    raise _DecodeError(f"the {claim!r} claim is not a number of seconds since the epoch")


@functools.lru_cache(maxsize=128)
def _decode_cached(token: str) -> DecodedToken:
    header_b64, payload_b64, _signature = token.split(".")
    header = _b64_json(header_b64, "header")
    payload = _b64_json(payload_b64, "payload")
    exp = _number(payload, "exp")
    iat = _number(payload, "iat")
    aud = payload.get("aud")
    if aud is None:
        audiences: tuple[str, ...] = ()
    elif isinstance(aud, str):
        audiences = (aud,)
    elif isinstance(aud, list) and all(isinstance(a, str) for a in aud):
        audiences = tuple(aud)
    else:
        raise _DecodeError("the 'aud' claim is neither a string nor a list of strings")
    return DecodedToken(
        header=header,
        payload=payload,
        exp=exp,
        iat=iat,
        audiences=audiences,
        normalised_audiences=frozenset(normalise_url(a) for a in audiences),
    )


def decode_token(token: str, *, provider: str = "", source: str = "") -> DecodedToken | None:
    """Decode a JWT's header and payload without verifying it; ``None`` for an opaque token.

    Decoded tokens are memoised per token string, so re-reading an unchanged file is cheap.
    Raises :class:`MalformedTokenError` when the token looks like a JWT but does not decode.
    """
    if not looks_like_jwt(token):
        return None
    try:
        return _decode_cached(token)
    except _DecodeError as exc:
        why = str(exc)
    except Exception as exc:  # any other decoding failure is a malformed token too
        why = f"{type(exc).__name__} while decoding it"  # its message may quote the token
    raise MalformedTokenError(
        f"The token from {_origin(provider, source)} looks like a JWT (three dot-separated "
        f"parts, header starting with 'eyJ') but cannot be decoded: {why}. Check that the "
        "source holds exactly one OIDC token (a JWT) and nothing else.",
        provider=provider,
        source=source,
    )


def clear_claims_cache() -> None:
    """Forget every memoised decoded token."""
    _decode_cached.cache_clear()


def _origin(provider: str, source: str) -> str:
    if provider and source:
        return f"{provider!r} ({source})"
    return repr(provider) if provider else (source or "the credential source")


def _timestamp(seconds: float) -> str:
    try:
        return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return f"{seconds:.0f} (seconds since the epoch)"


def check_token_text(token: str, *, provider: str, source: str) -> str:
    """Refuse a token that cannot be sent in an ``Authorization`` header; return it stripped.

    Surrounding whitespace (a file's trailing newline) is removed. Empty is an
    :class:`EmptyCredentialError`; inner whitespace, control or non-ASCII characters, or more than
    ``MAX_TOKEN_CHARS`` characters are a :class:`MalformedTokenError`.
    """
    text = token.strip()
    if not text:
        raise EmptyCredentialError(
            f"The credential from {_origin(provider, source)} is empty. Put exactly one OIDC "
            "token there, or remove the source so that discovery can continue.",
            provider=provider,
            source=source,
        )
    if len(text) > MAX_TOKEN_CHARS:
        raise MalformedTokenError(
            f"The credential from {_origin(provider, source)} is {len(text)} characters long; "
            f"the limit is {MAX_TOKEN_CHARS}. The source must hold a single OIDC token.",
            provider=provider,
            source=source,
        )
    if not (text.isascii() and text.isprintable()) or " " in text:
        raise MalformedTokenError(
            f"The credential from {_origin(provider, source)} contains whitespace, control or "
            "non-ASCII characters, so it cannot be sent as a bearer token. The source must hold "
            "a single OIDC token and nothing else.",
            provider=provider,
            source=source,
        )
    return text


def check_credential(credential: Credential, audience: str, now: float) -> DecodedToken | None:
    """Refuse an expired token or one whose ``aud`` does not contain ``audience``.

    Returns the decoded token (``None`` for an opaque token, which passes unchecked).
    """
    provider, source = credential.provider, credential.source
    decoded = decode_token(credential.token, provider=provider, source=source)
    if decoded is None:
        return None
    if decoded.exp is not None and now > decoded.exp + CLOCK_SKEW_SECONDS:
        raise TokenExpiredError(
            f"The token from {_origin(provider, source)} expired at {_timestamp(decoded.exp)} "
            f"({now - decoded.exp:.0f} s ago; {CLOCK_SKEW_SECONDS:.0f} s of clock skew allowed). "
            "The source must supply a fresh token: a projected token is refreshed by the kubelet, "
            "a CI token lives as long as its job; re-run the job or check the machine's clock.",
            provider=provider,
            source=source,
        )
    if normalise_url(audience) not in decoded.normalised_audiences:
        found = ", ".join(repr(a) for a in decoded.audiences) or "no 'aud' claim"
        raise AudienceMismatchError(
            f"The token from {_origin(provider, source)} is for {found}, not for the broker "
            f"{audience!r}; it is not sent, so that a token meant for another service never "
            "leaves this process. Issue the token with audience = the broker URL (projected "
            "volume 'audience:', GitLab 'id_tokens: ... aud:'), or fix AGENT_SANDBOX_BROKER_URL "
            "if it is mistyped. URLs are compared with scheme and host lower-cased, the default "
            "port dropped and a trailing slash ignored.",
            provider=provider,
            source=source,
        )
    return decoded


def cache_deadline(decoded: DecodedToken | None, now: float) -> float:
    """Until when (wall clock) a non-file credential may be served from the cache.

    ``exp - min(MAX_CACHE_MARGIN_SECONDS, 10 % of the lifetime)``, never past ``exp``; the
    lifetime is ``exp - iat`` (or ``exp - now`` without a usable ``iat``). Without ``exp``:
    ``now + DEFAULT_TTL_SECONDS``. A deadline at or before ``now`` means "do not cache".
    """
    if decoded is None or decoded.exp is None:
        return now + DEFAULT_TTL_SECONDS
    exp = decoded.exp
    start = decoded.iat if decoded.iat is not None and decoded.iat < exp else now
    lifetime = max(exp - start, 0.0)
    margin = min(MAX_CACHE_MARGIN_SECONDS, CACHE_MARGIN_FRACTION * lifetime)
    return min(exp - margin, exp)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """Remove anything that looks like a JWT, and every given secret, from ``text``."""
    for secret in secrets:
        if secret and len(secret) >= 8:
            text = text.replace(secret, "<redacted>")
    return _JWT_LIKE.sub("<redacted-jwt>", text)
