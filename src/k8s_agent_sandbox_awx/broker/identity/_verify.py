"""Token verification for the local broker: every rejection has a precise code and reason."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import httpx
import jwt

from ._issuer import TrustedIssuer
from ._policy import Caller

ALLOWED_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384"}
)


class TokenRejected(Exception):
    """A 401: ``code`` is one of the broker API's 401 codes; ``detail`` never holds the token."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


def _short(value: object, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters (claims echoed in a reason stay readable)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def token_fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _b64json(segment: str, what: str) -> dict[str, Any]:
    try:
        raw = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
        value = json.loads(raw)
    except (binascii.Error, ValueError, RecursionError) as exc:  # too deeply nested JSON
        raise TokenRejected(
            "token_malformed", f"the token's {what} is not base64url-encoded JSON"
        ) from exc
    if not isinstance(value, dict):
        raise TokenRejected("token_malformed", f"the token's {what} is not a JSON object")
    return value


T = TypeVar("T")


class VerifiedTokens(Generic[T]):
    """Tokens whose signature was verified, so a token seen again costs no signature check.

    Keyed by the SHA-256 digest of the exact token string (the token itself is not kept): a
    different string with the same claims, or a forged signature, is a miss. An entry lives
    until the token's ``exp`` and at most ``max_age`` seconds (the JWKS cache time, so a key
    that leaves the JWKS unannounced stops being trusted as soon as a refetch could notice);
    at most ``max_entries`` entries, least recently used first out. Thread-safe. Only the
    signature is cached: the caller still applies the claim rules (expiry, audience,
    revocation) on every use.
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


class TokenVerifier:
    """Verifies bearer tokens against the trusted issuers' JWKS (fetched over HTTPS, cached)."""

    def __init__(
        self,
        *,
        audience: str,
        issuers: Callable[[], Mapping[str, TrustedIssuer]],
        http: Callable[[], httpx.AsyncClient],
        skew_seconds: int = 30,
        max_token_bytes: int = 16 * 1024,
        is_revoked: Callable[[Mapping[str, Any], str], bool] | None = None,
        jwks_cache_seconds: float = 300.0,
    ) -> None:
        self.audience = audience
        self._issuers = issuers
        self._http = http
        self.skew = skew_seconds
        self.max_token_bytes = max_token_bytes
        self._is_revoked = is_revoked
        self._cache_seconds = jwks_cache_seconds
        self._jwks: dict[str, tuple[float, dict[str, jwt.PyJWK]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.jwks_fetches = 0
        self.verified: VerifiedTokens[tuple[dict[str, Any], TrustedIssuer]] = VerifiedTokens(
            max_age=jwks_cache_seconds
        )
        self._forgotten = 0  # bumped by forget(): a verification begun before is not cached

    def forget(self, issuer_url: str) -> None:
        """Drop the cached JWKS of ``issuer_url`` and the tokens verified with it (called when
        an issuer retires a key)."""
        self._forgotten += 1
        self._jwks.pop(issuer_url, None)
        self.verified.forget_issuer(issuer_url)

    async def _fetch_jwks(self, issuer: TrustedIssuer) -> dict[str, jwt.PyJWK]:
        client = self._http()
        try:
            disco = await client.get(f"{issuer.url}/.well-known/openid-configuration")
            disco.raise_for_status()
            jwks_uri = disco.json()["jwks_uri"]
            resp = await client.get(jwks_uri)
            resp.raise_for_status()
            raw_keys = resp.json()["keys"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise TokenRejected(
                "bad_signature",
                f"cannot fetch the JWKS of issuer {issuer.url!r} to verify the signature: "
                f"{type(exc).__name__}",
            ) from exc
        self.jwks_fetches += 1
        keys: dict[str, jwt.PyJWK] = {}
        for raw in raw_keys:
            try:
                keys[str(raw.get("kid", ""))] = jwt.PyJWK(raw)
            except jwt.PyJWKError:
                continue
        self._jwks[issuer.url] = (time.monotonic(), keys)
        return keys

    async def _key_for(self, issuer: TrustedIssuer, kid: str) -> jwt.PyJWK | None:
        lock = self._locks.setdefault(issuer.url, asyncio.Lock())
        async with lock:
            cached = self._jwks.get(issuer.url)
            fresh = cached is not None and time.monotonic() - cached[0] < self._cache_seconds
            if cached is not None and fresh and kid in cached[1]:
                return cached[1][kid]
            keys = await self._fetch_jwks(issuer)  # unknown kid: refetch once
            return keys.get(kid)

    async def verify(self, authorization: str | None) -> tuple[Caller, TrustedIssuer]:
        """The caller an ``Authorization`` header's bearer token proves, and its issuer;
        TokenRejected (the code and a reason naming the rule) otherwise."""
        token = self._bearer(authorization)
        seen = self.verified.get(token)
        if seen is not None and self._issuers().get(seen[1].url) is seen[1]:  # still trusted
            return self._check_claims(seen[0], seen[1], token), seen[1]
        forgotten = self._forgotten
        header, issuer = self._unverified(token)
        claims = await self._verified_claims(token, header, issuer)
        caller = self._check_claims(claims, issuer, token)
        if forgotten == self._forgotten:  # no key retired while the JWKS was being fetched
            self.verified.put(token, (claims, issuer), issuer_url=issuer.url, exp=caller.expires_at)
        return caller, issuer

    def _bearer(self, authorization: str | None) -> str:
        """The token of a ``Bearer`` Authorization header, within the size limit."""
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
        return token

    def _unverified(self, token: str) -> tuple[dict[str, Any], TrustedIssuer]:
        """The token's header and its trusted issuer, before the signature is checked: the
        JWT's shape, an algorithm the broker allows and the issuer it names."""
        parts = token.split(".")
        if len(parts) != 3:
            raise TokenRejected(
                "token_malformed",
                f"a JWT has 3 dot-separated parts; this token has {len(parts)}",
            )
        header = _b64json(parts[0], "header")
        alg = header.get("alg")
        if alg not in ALLOWED_ALGORITHMS:
            raise TokenRejected(
                "algorithm_not_allowed",
                f"algorithm {_short(alg)} is not allowed; allowed: "
                f"{', '.join(sorted(ALLOWED_ALGORITHMS))}",
            )
        iss = _b64json(parts[1], "payload").get("iss")
        if not isinstance(iss, str) or not iss:
            raise TokenRejected("missing_claim", "the token has no 'iss' (issuer) claim")
        issuer = self._issuers().get(iss)
        if issuer is None:
            raise TokenRejected(
                "unknown_issuer",
                f"issuer {_short(iss)} is not trusted by this broker; use a token from a trusted "
                "issuer",
            )
        if alg not in issuer.algorithms:
            raise TokenRejected(
                "algorithm_not_allowed",
                f"algorithm {alg!r} is not allowed for issuer {iss!r}; allowed: "
                f"{', '.join(sorted(issuer.algorithms))}",
            )
        return header, issuer

    async def _verified_claims(
        self, token: str, header: Mapping[str, Any], issuer: TrustedIssuer
    ) -> dict[str, Any]:
        """The token's claims once its signature verifies with the issuer's key ``kid``."""
        alg, kid, iss = header.get("alg"), header.get("kid"), issuer.url
        if not isinstance(kid, str):
            raise TokenRejected("bad_signature", "the token header has no 'kid' to select a key")
        key = await self._key_for(issuer, kid)
        if key is None:
            raise TokenRejected(
                "bad_signature",
                f"issuer {iss!r} publishes no key with kid {_short(kid, 60)} "
                "(rotated away or forged)",
            )
        if key.algorithm_name != alg:
            raise TokenRejected(
                "algorithm_not_allowed",
                f"the token's algorithm {alg!r} does not match key {kid!r} ({key.algorithm_name})",
            )
        try:
            claims: dict[str, Any] = jwt.decode(  # the signature only: the claim rules are ours
                token,
                key=key.key,
                algorithms=[str(alg)],
                options={
                    "verify_signature": True,
                    "verify_aud": False,
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                    "verify_iss": False,
                    "require": [],
                },
            )
        except jwt.InvalidSignatureError as exc:
            raise TokenRejected(
                "bad_signature", f"the signature does not verify with issuer {iss!r}'s key {kid!r}"
            ) from exc
        except jwt.PyJWTError as exc:
            raise TokenRejected(
                "token_malformed", f"the token cannot be decoded: {type(exc).__name__}"
            ) from exc
        return claims

    def _audience(self, aud: Any, issuer: TrustedIssuer) -> str:
        """The first audience ``issuer`` is accepted for that the token's ``aud`` names."""
        audiences = [aud] if isinstance(aud, str) else aud
        accepted = list(issuer.audiences)
        found = [a for a in accepted if a in audiences] if isinstance(audiences, list) else []
        if found:
            return found[0]
        if accepted == [self.audience]:
            wanted = f"this broker's URL {self.audience!r}; request a token with that audience"
        else:
            wanted = (
                f"an audience this broker accepts from issuer {issuer.url!r} ({accepted}); "
                "request a token with one of them"
            )
        raise TokenRejected(
            "audience_mismatch", f"the token's audience {_short(aud)} does not contain {wanted}"
        )

    def _check_claims(self, claims: Mapping[str, Any], issuer: TrustedIssuer, token: str) -> Caller:
        aud = claims.get("aud")
        if aud is None:
            raise TokenRejected("missing_claim", "the token has no 'aud' (audience) claim")
        audience = self._audience(aud, issuer)
        now = time.time()
        times: dict[str, float] = {}
        for name in ("exp", "nbf", "iat"):
            value = claims.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TokenRejected("token_malformed", f"claim {name!r} must be a NumericDate")
            times[name] = float(value)
        if "exp" not in times:
            raise TokenRejected("missing_claim", "the token has no 'exp' (expiry) claim")
        if now > times["exp"] + self.skew:
            raise TokenRejected(
                "token_expired",
                f"the token expired {int(now - times['exp'])} s ago (allowed skew {self.skew} s); "
                "get a fresh token",
            )
        if "nbf" in times and now + self.skew < times["nbf"]:
            raise TokenRejected(
                "token_not_yet_valid",
                f"the token is not valid for another {int(times['nbf'] - now)} s (nbf; allowed "
                f"skew {self.skew} s); check the clocks",
            )
        if "iat" in times and now + self.skew < times["iat"]:
            raise TokenRejected(
                "token_not_yet_valid",
                f"the token was issued {int(times['iat'] - now)} s in the future (iat; allowed "
                f"skew {self.skew} s); check the clocks",
            )
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub:
            raise TokenRejected("missing_claim", "the token has no 'sub' (subject) claim")
        if self._is_revoked is not None and self._is_revoked(claims, token):
            raise TokenRejected("token_revoked", "the token was revoked; get a fresh token")
        return Caller(
            provider=issuer.provider,
            issuer=issuer.url,
            subject=sub,
            audience=audience,
            expires_at=int(times["exp"]),
            attributes=issuer.attributes_from(claims),
        )


class Revocations:
    """The tokens no longer accepted (``401 token_revoked``), by their ``jti`` and by their
    digest (the token itself is not kept); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._revoked: set[str] = set()

    def revoke(self, token: str) -> None:
        """Refuse ``token`` from now on (its ``jti`` read without verifying it: a revocation
        only ever refuses)."""
        with self._lock:
            self._revoked.add("sha256:" + token_fingerprint(token))
            with contextlib.suppress(jwt.PyJWTError, RecursionError):  # revoked by digest
                jti = jwt.decode(token, options={"verify_signature": False}).get("jti")
                if isinstance(jti, str):
                    self._revoked.add(f"jti:{jti}")

    def is_revoked(self, claims: Mapping[str, Any], token: str) -> bool:
        jti = claims.get("jti")
        with self._lock:
            if isinstance(jti, str) and f"jti:{jti}" in self._revoked:
                return True
            return "sha256:" + token_fingerprint(token) in self._revoked
