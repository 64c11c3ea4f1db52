"""Token verification: every rejection has a precise code and reason.

The same verifier serves the local broker (its issuers from ``testing``) and a configured
broker (``ConfiguredIssuer``s from ``IssuerSettings``): each issuer's signature check or
TokenReview is an ``IssuerTrust`` (``_trust``); the token's shape, the issuer, the claim rules
and the verified-token memo are here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, NoReturn, TypeVar

import httpx

from ..._urls import normalise_url
from ._issuer import VerifiableIssuer
from ._policy import Caller
from ._providers import spelled_twice
from ._rejection import TokenRejected
from ._rejection import short as _short
from ._settings import ALLOWED_ALGORITHMS, IssuerSettings
from ._tokenreview import TokenReviewer
from ._trust import IssuerTrust

__all__ = ["ALLOWED_ALGORITHMS", "Proven", "TokenRejected", "TokenVerifier", "VerifiedTokens"]


def token_fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


MAX_NUMERIC_DATE: Final = 253402300799
"""The latest NumericDate a time claim may hold: 9999-12-31T23:59:59Z (the last second a
date can name; a later one, an infinity or NaN is ``token_malformed``, never a 500)."""


def _not_json(constant: str) -> NoReturn:
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: JSON, but no number a claim can mean
        raise ValueError(f"{text[:20]} is out of range")
    return value


def _b64json(segment: str, what: str) -> dict[str, Any]:
    try:
        raw = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
        # NaN and Infinity are not JSON (RFC 8259), nor a number too large for a float
        value = json.loads(raw, parse_constant=_not_json, parse_float=_finite)
    except (binascii.Error, ValueError, RecursionError) as exc:  # too deeply nested JSON
        raise TokenRejected(
            "token_malformed",
            f"the token's {what} is not base64url-encoded JSON (NaN, Infinity and numbers "
            "beyond a double's range are not JSON)",
        ) from exc
    if not isinstance(value, dict):
        raise TokenRejected("token_malformed", f"the token's {what} is not a JSON object")
    return value


T = TypeVar("T")
I = TypeVar("I", bound=VerifiableIssuer)  # noqa: E741


class VerifiedTokens(Generic[T]):
    """Tokens whose signature was verified, so a token seen again costs no signature check.

    Keyed by the SHA-256 digest of the exact token string (the token itself is not kept): a
    different string with the same claims, or a forged signature, is a miss. An entry lives
    until the token's ``exp`` and at most ``max_age`` seconds (the JWKS cache time, so a key
    that leaves the JWKS unannounced stops being trusted as soon as a refetch could notice);
    at most ``max_entries`` entries, least recently used first out. Thread-safe. What depends
    on time is not the memo's to decide: the verifier keeps a token's verdict here (a
    :class:`Proven`) and checks its time claims and revocation again on every use.
    """

    def __init__(
        self,
        *,
        max_entries: int = 4096,
        max_age: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self.max_entries = max_entries
        self.max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        # digest -> (valid until, issuer url, value)
        self._entries: OrderedDict[bytes, tuple[float, str, T]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @staticmethod
    def _digest(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def get(self, token: str) -> T | None:
        key = self._digest(token)
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if now >= entry[0]:
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return entry[2]

    def put(self, token: str, value: T, *, issuer_url: str, exp: float) -> None:
        now = self._clock()
        until = min(exp, now + self.max_age)
        if until <= now:
            return
        key = self._digest(token)
        with self._lock:
            self._entries[key] = (until, issuer_url, value)
            self._entries.move_to_end(key)
            if len(self._entries) > self.max_entries:
                for stale in [k for k, e in self._entries.items() if now >= e[0]]:
                    del self._entries[stale]
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def forget_issuer(self, issuer_url: str) -> None:
        with self._lock:
            for key in [k for k, e in self._entries.items() if e[1] == issuer_url]:
                del self._entries[key]


@dataclass(frozen=True, slots=True)
class Proven(Generic[I]):
    """What a verified token proved, as the memo keeps it: everything that does not depend on
    time (the signature, the issuer, the audience, the subject, the claims' spellings, the
    caller's attributes), decided once for the exact token and the ``issuer`` object it was
    decided with. A hit counts only if that object is still the trusted one (a reloaded or
    replaced issuer is another object: its rules decide anew); the time claims (``times``) and
    the revocation list are checked again at every use. Every request of the token gets the
    same ``caller``: a frozen :class:`Caller` whose attributes and claims nothing writes to."""

    claims: dict[str, Any]
    issuer: I
    caller: Caller
    times: dict[str, float]


class TokenVerifier(Generic[I]):
    """Verifies bearer tokens of the trusted issuers: each issuer's ``IssuerTrust`` (its JWKS,
    fetched over HTTPS and cached, or TokenReview) and the claim rules with its settings.

    ``audience`` (the broker's URL) and ``skew_seconds`` apply to an issuer whose settings give
    none; ``http`` is a client factory every issuer's key fetches share (the local broker's),
    else each issuer makes its own from its settings (``ca_file``, ``timeout_seconds``);
    ``reviewer`` (the Kubernetes API client) serves ``tokenreview`` issuers."""

    def __init__(
        self,
        *,
        audience: str,
        issuers: Callable[[], Mapping[str, I]],
        http: Callable[[], httpx.AsyncClient] | None = None,
        skew_seconds: int = 30,
        max_token_bytes: int = 16 * 1024,
        is_revoked: Callable[[Mapping[str, Any], str], bool] | None = None,
        jwks_cache_seconds: float = 300.0,
        reviewer: TokenReviewer | None = None,
    ) -> None:
        self.audience = audience
        self._issuers = issuers
        self._http = http
        self._reviewer = reviewer
        self.skew = skew_seconds
        self.max_token_bytes = max_token_bytes
        self._is_revoked = is_revoked
        self._trust: dict[str, tuple[I, IssuerTrust]] = {}
        self._fetches_before = 0  # of the key sets replaced since (an issuer object changed)
        self.verified: VerifiedTokens[Proven[I]] = VerifiedTokens(max_age=jwks_cache_seconds)
        self._forgotten = 0  # bumped by forget(): a verification begun before is not cached

    @property
    def jwks_fetches(self) -> int:
        """Successful key fetches, over all issuers."""
        return self._fetches_before + sum(
            t.keys.refreshes for _, t in self._trust.values() if t.keys is not None
        )

    def trust_for(self, issuer: I) -> IssuerTrust:
        """The run-time verification of ``issuer`` (made on first use)."""
        entry = self._trust.get(issuer.url)
        if entry is not None and entry[0] is issuer:
            return entry[1]
        if entry is not None and entry[1].keys is not None:
            self._fetches_before += entry[1].keys.refreshes
        settings = issuer.settings
        trust = IssuerTrust(
            settings,
            audiences=settings.audiences or (self.audience,),
            http=self._http,
            reviewer=self._reviewer,
            on_keys_removed=self.forget_tokens,
        )
        self._trust[issuer.url] = (issuer, trust)
        return trust

    def forget_tokens(self, issuer_url: str) -> None:
        """Drop the tokens verified with ``issuer_url``'s keys (a key left its JWKS)."""
        self._forgotten += 1
        self.verified.forget_issuer(issuer_url)

    def forget(self, issuer_url: str) -> None:
        """Drop the cached JWKS of ``issuer_url`` and the tokens verified with it (called when
        an issuer retires a key)."""
        self.forget_tokens(issuer_url)
        entry = self._trust.get(issuer_url)
        if entry is not None and entry[1].keys is not None:
            entry[1].keys.forget()

    async def load(self) -> dict[str, bool]:
        """Fetch every issuer's keys (or probe the API server) now, e.g. before serving; by
        issuer name, whether it worked (failures are logged and retried on use)."""
        return {i.settings.name: await self.trust_for(i).load() for i in self._issuers().values()}

    def had_keys(self) -> dict[str, bool]:
        """By issuer name, whether its keys were loaded (or its API server answered) once
        since start."""
        return {i.settings.name: self.trust_for(i).had_keys for i in self._issuers().values()}

    def readiness(self) -> dict[str, dict[str, Any]]:
        """By issuer name, its status (``ready``: keys loaded, or the API server answered)."""
        return {i.settings.name: self.trust_for(i).status() for i in self._issuers().values()}

    async def aclose(self) -> None:
        for _, trust in self._trust.values():
            await trust.aclose()

    async def verify(self, authorization: str | None) -> tuple[Caller, I]:
        if not authorization:
            raise TokenRejected(
                "token_missing",
                "no Authorization header: send 'Authorization: Bearer <OIDC token>'",
            )
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise TokenRejected(
                "token_malformed",
                "the Authorization header must be 'Bearer <token>' (another scheme or no token)",
            )
        if len(token) > self.max_token_bytes:
            raise TokenRejected(
                "token_too_large",
                f"the token is {len(token)} bytes; the limit is {self.max_token_bytes} bytes",
            )
        seen = self.verified.get(token)
        if seen is not None and self._issuers().get(seen.issuer.url) is seen.issuer:
            return self._still_valid(seen, token), seen.issuer  # the same, still trusted issuer
        forgotten = self._forgotten
        parts = token.split(".")
        if len(parts) != 3:
            raise TokenRejected(
                "token_malformed",
                f"a JWT has 3 dot-separated parts; this token has {len(parts)}",
            )
        header = _b64json(parts[0], "header")
        alg = header.get("alg")
        if alg not in ALLOWED_ALGORITHMS:
            allowed = f"allowed: {', '.join(sorted(ALLOWED_ALGORITHMS))}"
            raise TokenRejected(
                "algorithm_not_allowed",
                f"algorithm {_short(alg)} is not allowed; {allowed}",
                logged=f"the token's algorithm (its header's 'alg') is not allowed; {allowed}",
            )
        unverified = _b64json(parts[1], "payload")
        iss = unverified.get("iss")
        if not isinstance(iss, str) or not iss:
            raise TokenRejected("missing_claim", "the token has no 'iss' (issuer) claim")
        issuer = self._issuers().get(iss)
        if issuer is None:
            fix = "use a token from a trusted issuer"
            raise TokenRejected(
                "unknown_issuer",
                f"issuer {_short(iss)} is not trusted by this broker; {fix}",
                logged=f"the token's issuer ('iss') is not trusted by this broker; {fix}",
            )
        trust = self.trust_for(issuer)
        if not trust.memoizable:  # the claim rules first: no review of an expired token
            self._check_claims(unverified, issuer, token)
        claims = await trust.verified_claims(token, header, unverified)
        caller = self._proven(claims, issuer, token)
        if trust.memoizable and forgotten == self._forgotten:  # no key retired meanwhile
            until = min(caller.expires_at, time.time() + issuer.settings.jwks_cache_seconds)
            proven = Proven(claims, issuer, caller, _numeric_dates(claims))
            self.verified.put(token, proven, issuer_url=issuer.url, exp=until)
        return caller, issuer

    def _proven(self, claims: Mapping[str, Any], issuer: I, token: str) -> Caller:
        """The claim rules on claims whose signature verified: a refusal names the identity
        they prove (``TokenRejected.identity``, for the audit log)."""
        try:
            return self._check_claims(claims, issuer, token)
        except TokenRejected as exc:
            exc.identity = _identity(claims, issuer)
            raise

    def _still_valid(self, seen: Proven[I], token: str) -> Caller:
        """A memoized token's caller, once what depends on time holds again now: its
        ``exp``, ``nbf`` and ``iat`` against the clock, and the revocation list."""
        try:
            self._check_times(seen.times, seen.issuer.settings)
            if self._is_revoked is not None and self._is_revoked(seen.claims, token):
                raise TokenRejected("token_revoked", "the token was revoked; get a fresh token")
        except TokenRejected as exc:
            exc.identity = _identity(seen.claims, seen.issuer)
            raise
        return seen.caller

    def counters(self) -> dict[str, dict[str, Any]]:
        """By issuer name, for metrics: ``verification``, ``ready`` and the counters of its key
        set (``refreshes``, ``failures``, ``kid_refetches``, ``rate_limited``) or of its
        TokenReviews (``reviews``, ``failures``, ``hits``); never a key or a token."""
        found: dict[str, dict[str, Any]] = {}
        for issuer in self._issuers().values():
            trust = self.trust_for(issuer)
            part: Any = trust.keys if trust.keys is not None else trust.reviews
            names = ("refreshes", "failures", "kid_refetches", "rate_limited", "reviews", "hits")
            found[issuer.settings.name] = {
                "verification": issuer.settings.verification,
                "ready": trust.ready,
                **{name: getattr(part, name) for name in names if hasattr(part, name)},
            }
        return found

    def _audience(self, claims: Mapping[str, Any], settings: IssuerSettings) -> str:
        """The first accepted audience the token's ``aud`` holds (the issuer's audiences, or
        the broker's URL)."""
        accepted = settings.audiences or (self.audience,)
        aud = claims.get("aud")
        if aud is None:
            raise TokenRejected("missing_claim", "the token has no 'aud' (audience) claim")
        audiences = [aud] if isinstance(aud, str) else aud
        given = (
            {normalise_url(a) for a in audiences if isinstance(a, str)}
            if isinstance(audiences, list)
            else set()
        )  # the client's rule: a trailing slash or a default port is the same URL
        matched = [a for a in accepted if normalise_url(a) in given]
        if not matched:
            wanted = (
                f"this broker's URL {self.audience!r}"
                if not settings.audiences
                else (f"any audience issuer {settings.name!r} is accepted for: {list(accepted)}")
            )
            fix = "request a token with that audience"
            raise TokenRejected(
                "audience_mismatch",
                f"the token's audience {_short(aud)} does not contain {wanted}; {fix}",
                logged=f"the token's audience ('aud') does not contain {wanted}; {fix}",
            )
        return matched[0]

    def _check_claims(self, claims: Mapping[str, Any], issuer: I, token: str) -> Caller:
        settings = issuer.settings
        audience = self._audience(claims, settings)
        times = _numeric_dates(claims)
        self._check_times(times, settings)
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub:
            raise TokenRejected("missing_claim", "the token has no 'sub' (subject) claim")
        doubled = spelled_twice(claims)
        if doubled is not None:
            why = (
                "is spelled two ways (a key with dots and a nested claim) with different "
                "values; a policy and the caller's attributes would read different ones: use a "
                "token with one spelling"
            )
            raise TokenRejected(
                "token_malformed",
                f"the token's claim {_short(doubled, 80)} {why}",
                logged=f"a claim of the token {why}",
            )
        if self._is_revoked is not None and self._is_revoked(claims, token):
            raise TokenRejected("token_revoked", "the token was revoked; get a fresh token")
        return Caller(
            provider=issuer.provider,
            issuer=issuer.url,
            subject=sub,
            audience=audience,
            expires_at=int(times["exp"]),
            attributes=issuer.attributes_from(claims),
            claims=dict(claims),
        )

    def _check_times(self, times: Mapping[str, float], settings: IssuerSettings) -> None:
        """The time claims against the clock now, with the issuer's (else the broker's) skew:
        ``exp`` present and not past, ``nbf`` and ``iat`` not ahead."""
        skew = self.skew if settings.clock_skew_seconds is None else settings.clock_skew_seconds
        now = time.time()
        if "exp" not in times:
            raise TokenRejected("missing_claim", "the token has no 'exp' (expiry) claim")
        if now > times["exp"] + skew:
            raise TokenRejected(
                "token_expired",
                f"the token expired {int(now - times['exp'])} s ago (allowed skew {skew:g} s); "
                "get a fresh token",
            )
        if "nbf" in times and now + skew < times["nbf"]:
            raise TokenRejected(
                "token_not_yet_valid",
                f"the token is not valid for another {int(times['nbf'] - now)} s (nbf; allowed "
                f"skew {skew:g} s); check the clocks",
            )
        if "iat" in times and now + skew < times["iat"]:
            raise TokenRejected(
                "token_not_yet_valid",
                f"the token was issued {int(times['iat'] - now)} s in the future (iat; allowed "
                f"skew {skew:g} s); check the clocks",
            )


def _identity(claims: Mapping[str, Any], issuer: VerifiableIssuer) -> tuple[str, str] | None:
    """The ``(issuer, subject)`` verified claims prove, for a refusal's audit line."""
    sub = claims.get("sub")
    return (issuer.url, sub) if isinstance(sub, str) and sub else None


def _numeric_dates(claims: Mapping[str, Any]) -> dict[str, float]:
    """The time claims the token has (``exp``, ``nbf``, ``iat``): each a finite number of
    seconds from 0 to :data:`MAX_NUMERIC_DATE` (a fraction allowed), else ``token_malformed``
    (a string, a boolean, NaN, an infinity, a negative date or one past year 9999)."""
    times: dict[str, float] = {}
    for name in ("exp", "nbf", "iat"):
        value = claims.get(name)
        if value is None:
            continue
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        if number is None or not 0 <= number <= MAX_NUMERIC_DATE or not math.isfinite(number):
            rule = (
                f"claim {name!r} must be a NumericDate: a number of seconds since 1970 from 0 "
                f"to {MAX_NUMERIC_DATE} (9999-12-31T23:59:59Z)"
            )
            raise TokenRejected("token_malformed", f"{rule}, not {_short(value, 40)}", logged=rule)
        times[name] = float(number)
    return times
