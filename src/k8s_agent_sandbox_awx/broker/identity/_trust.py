"""One trusted issuer at run time: :class:`IssuerTrust` checks a token's signature with the
issuer's keys (``jwks``) or has the Kubernetes API server review it (``tokenreview``).

The verifier (``_verify.TokenVerifier``) does everything else the same way for both: the
token's shape, the issuer, the claim rules and the verified-token memo (for ``jwks`` only: a
reviewed token is asked about again once its short review cache lapses, which is how a deleted
pod's token gets refused).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import jwt

from ._jwks import KeySet, KeysUnavailable
from ._rejection import IssuerUnavailable, TokenRejected, short
from ._settings import IssuerSettings, SettingsError
from ._tokenreview import (
    ReviewUnavailable,
    TokenReviewer,
    TokenReviews,
    reviewed_claims,
    spelled_audiences,
)

__all__ = ["IssuerTrust"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.identity")


REVIEW_RETRY_AFTER = 5
"""Seconds a caller waits before it retries when the API server, which has reviewed tokens
before, does not answer a TokenReview (``Retry-After`` of the 503 ``issuer_unavailable``)."""


class IssuerTrust:
    """How tokens of the issuer ``settings`` are checked (see the module). ``audiences``: the
    accepted audiences (the settings' or the broker's own); ``http``: a shared client factory
    for key fetches; ``reviewer``: the Kubernetes API client, needed for ``tokenreview``."""

    def __init__(
        self,
        settings: IssuerSettings,
        *,
        audiences: Sequence[str],
        http: Callable[[], httpx.AsyncClient] | None = None,
        reviewer: TokenReviewer | None = None,
        on_keys_removed: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.audiences = tuple(audiences)
        self.keys: KeySet | None = None
        self.reviews: TokenReviews | None = None
        if settings.verification == "tokenreview":
            if reviewer is None:
                raise SettingsError(
                    f"issuer {settings.name!r}",
                    "verification",
                    "'tokenreview' needs the broker's Kubernetes API client (the kubernetes "
                    "backend's connection); use 'jwks' without one",
                )
            self.reviews = TokenReviews(settings, reviewer, audiences=self.audiences)
        else:
            self.keys = KeySet(settings, http=http, on_keys_removed=on_keys_removed)

    def __repr__(self) -> str:
        return f"IssuerTrust(issuer={self.settings.name!r}, {self.settings.verification})"

    @property
    def memoizable(self) -> bool:
        """Whether a token verified this way may be remembered (``jwks``: its signature holds
        until the key leaves the JWKS; a review must be asked again)."""
        return self.keys is not None

    @property
    def ready(self) -> bool:
        if self.keys is not None:
            return self.keys.ready
        assert self.reviews is not None
        return self.reviews.ready

    def status(self) -> dict[str, Any]:
        part = self.keys if self.keys is not None else self.reviews
        assert part is not None
        return {**part.status(), "verification": self.settings.verification}

    @property
    def had_keys(self) -> bool:
        """Whether this issuer's keys were loaded (or its API server answered) since start."""
        if self.keys is not None:
            return self.keys.loaded_once
        assert self.reviews is not None
        return self.reviews.answered_once

    async def load(self) -> bool:
        """Fetch the keys (or probe the API server) now; whether it worked (a failure is
        logged, and retried on use)."""
        try:
            if self.keys is not None:
                await self.keys.refresh()
            else:
                assert self.reviews is not None
                await self.reviews.probe()
        except (KeysUnavailable, ReviewUnavailable) as exc:
            log.warning("issuer %r not ready: %s", self.settings.name, exc)
            return False
        return True

    async def aclose(self) -> None:
        if self.keys is not None:
            await self.keys.aclose()

    # -- verification --------------------------------------------------------------------------
    async def verified_claims(
        self, token: str, header: Mapping[str, Any], payload: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The token's claims once its signature holds (or the API server authenticated it);
        else :class:`TokenRejected`. The claim rules are the verifier's."""
        alg = header.get("alg")
        if alg not in self.settings.algorithms:
            raise TokenRejected(
                "algorithm_not_allowed",
                f"algorithm {short(alg)} is not allowed for issuer {self.settings.name!r}; "
                f"allowed: {', '.join(self.settings.algorithms)}",
            )
        if self.reviews is not None:
            return await self._reviewed(token, payload)
        return await self._signed(token, str(alg), header)

    async def _reviewed(self, token: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        assert self.reviews is not None
        exp = payload.get("exp")
        bound = float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else 0
        try:
            verdict = await self.reviews.review(
                token,
                exp=bound or time.time(),
                audiences=spelled_audiences(payload, self.audiences),
            )
        except ReviewUnavailable as exc:
            if self.reviews.answered_once:  # an outage of the API server: the token may be good
                raise IssuerUnavailable(f"{exc}; retry later", REVIEW_RETRY_AFTER) from None
            raise TokenRejected("bad_signature", f"{exc}; retry later") from None
        return reviewed_claims(verdict, payload, self.audiences, self.settings.name)

    async def _signed(self, token: str, alg: str, header: Mapping[str, Any]) -> dict[str, Any]:
        assert self.keys is not None
        iss = self.settings.url
        kid = header.get("kid")
        if not isinstance(kid, str):
            raise TokenRejected("bad_signature", "the token header has no 'kid' to select a key")
        try:
            key = await self.keys.key_for(kid, alg)
        except KeysUnavailable as exc:
            if self.keys.loaded_once:  # an outage of the issuer: the token may well be good
                detail = f"{exc}; its tokens cannot be checked until then: retry later"
                raise IssuerUnavailable(detail, max(1, round(self.keys.retry_in))) from None
            detail = f"{exc}; the signature cannot be checked"
            raise TokenRejected("bad_signature", detail) from None
        if key is None:
            raise TokenRejected(
                "bad_signature",
                f"issuer {iss!r} publishes no key with kid {short(kid, 60)} "
                "(rotated away or forged)",
                logged=f"issuer {iss!r} publishes no key with the token's kid (rotated away or "
                "forged)",
            )
        if key.algorithm_name != alg:
            raise TokenRejected(
                "algorithm_not_allowed",
                f"the token's algorithm {alg!r} does not match key {kid!r} ({key.algorithm_name})",
            )
        return _decode(token, key, alg, iss, kid)


def _decode(token: str, key: jwt.PyJWK, alg: str, iss: str, kid: str) -> dict[str, Any]:
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key=key.key,
            algorithms=[alg],
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
