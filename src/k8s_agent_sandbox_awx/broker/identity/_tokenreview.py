"""Kubernetes tokens verified by the API server itself: :class:`TokenReviews`.

A TokenReview (``authentication.k8s.io/v1``) with ``spec.audiences`` = the issuer's accepted
audiences; the answer counts only when ``status.authenticated`` is true and
``status.audiences`` names one of them. ``status.user.username`` is the subject
(``system:serviceaccount:NS:SA``, which must equal the token's ``sub``) and
``status.user.extra`` the bound pod's name and uid (which must equal the token's). Unlike a JWKS
check, it notices a token whose pod (or secret) was deleted.

Answers are cached by the SHA-256 of the token (never the token): a positive one for
``tokenreview_cache_seconds`` and at most until the token's ``exp``, a negative one for
``tokenreview_negative_cache_seconds`` (a few seconds at most: the API server itself caches a
positive review for 10 s, so a deleted pod's token is refused within about the sum). Concurrent
reviews of one token share one request. The reviewer is anything with the
``token_review(token, audiences)`` coroutine of the broker's Kubernetes API client
(``KubeClient``); its errors become :class:`ReviewUnavailable`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from ..._urls import normalise_url
from ._providers import claim_at
from ._rejection import TokenRejected, short
from ._settings import IssuerSettings

__all__ = ["PROBE_TOKEN", "Review", "ReviewUnavailable", "TokenReviewer", "TokenReviews"]

PROBE_TOKEN: Final = "e30.e30.e30"  # noqa: S105 (no secret: refused everywhere)
"""What :meth:`TokenReviews.probe` sends: a JWT of empty objects, refused by every server."""
_POD_NAME: Final = "authentication.kubernetes.io/pod-name"
_POD_UID: Final = "authentication.kubernetes.io/pod-uid"


class TokenReviewer(Protocol):
    """What a TokenReview needs of the broker's Kubernetes API client."""

    async def token_review(
        self, token: str, audiences: Sequence[str] | None = None
    ) -> dict[str, Any]: ...


class ReviewUnavailable(Exception):
    """The API server gave no verdict (unreachable, refused the broker, ...)."""


@dataclass(frozen=True)
class Review:
    """The API server's verdict (a TokenReview's ``status``)."""

    authenticated: bool
    username: str = ""
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    audiences: tuple[str, ...] = ()
    error: str = ""

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> Review:
        user = status.get("user") if isinstance(status.get("user"), dict) else {}
        assert isinstance(user, dict)
        raw_extra = user.get("extra") if isinstance(user.get("extra"), dict) else {}
        assert isinstance(raw_extra, dict)
        extra = {
            str(k): tuple(str(v) for v in values)
            for k, values in raw_extra.items()
            if isinstance(values, list)
        }
        audiences = status.get("audiences")
        return cls(
            authenticated=status.get("authenticated") is True,
            username=str(user.get("username") or ""),
            extra=extra,
            audiences=tuple(str(a) for a in audiences) if isinstance(audiences, list) else (),
            error=str(status.get("error") or ""),
        )


class TokenReviews:
    """The reviews of one issuer's tokens (see the module). ``ready``: the API server has
    answered (a review or :meth:`probe`) and its last call did not fail. Counters for
    metrics: ``reviews`` (requests sent), ``failures``, ``hits`` (answers from the cache)."""

    def __init__(
        self,
        settings: IssuerSettings,
        reviewer: TokenReviewer,
        *,
        audiences: Sequence[str],
        clock: Callable[[], float] = time.time,
        max_entries: int = 4096,
    ) -> None:
        self.settings = settings
        self.audiences = tuple(audiences)
        self._reviewer = reviewer
        self._clock = clock
        self._max_entries = max_entries
        self._cache: OrderedDict[bytes, tuple[float, Review]] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Task[Review]] = {}
        self.ready = False
        self.answered_once = False
        """Whether the API server ever gave a verdict (see ``KeySet.loaded_once``)."""
        self.last_error: str | None = None
        self.reviews = 0
        self.failures = 0
        self.hits = 0

    def __repr__(self) -> str:
        return f"TokenReviews(issuer={self.settings.name!r})"

    def status(self) -> dict[str, Any]:
        return {"issuer": self.settings.name, "ready": self.ready, "last_error": self.last_error}

    async def probe(self) -> None:
        """One review of :data:`PROBE_TOKEN` (at start, and for readiness): raises
        :class:`ReviewUnavailable` when the API server gives no verdict."""
        await self._ask(PROBE_TOKEN)

    async def review(
        self, token: str, *, exp: float, audiences: Sequence[str] | None = None
    ) -> Review:
        """The verdict on ``token`` (whose ``exp`` bounds a cached positive answer), reviewed
        for ``audiences`` (default: the issuer's; :func:`spelled_audiences` adds the token's
        own spelling of them)."""
        key = hashlib.sha256(token.encode()).digest()
        now = self._clock()
        cached = self._cache.get(key)
        if cached is not None and now < cached[0]:
            self._cache.move_to_end(key)
            self.hits += 1
            return cached[1]
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._ask(token, audiences))
            self._inflight[key] = task
            task.add_done_callback(lambda _t: self._inflight.pop(key, None))
        verdict = await asyncio.shield(task)
        self._remember(key, verdict, exp)
        return verdict

    def _remember(self, key: bytes, verdict: Review, exp: float) -> None:
        now = self._clock()
        if verdict.authenticated:
            until = min(now + self.settings.tokenreview_cache_seconds, exp)
        else:
            until = now + self.settings.tokenreview_negative_cache_seconds
        if until <= now:
            return
        self._cache[key] = (until, verdict)
        self._cache.move_to_end(key)
        if len(self._cache) > self._max_entries:
            for stale in [k for k, (u, _) in self._cache.items() if now >= u]:
                del self._cache[stale]
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)

    async def _ask(self, token: str, audiences: Sequence[str] | None = None) -> Review:
        self.reviews += 1
        try:
            status = await self._reviewer.token_review(token, list(audiences or self.audiences))
        except Exception as exc:  # the client's typed errors; re-raised as one type
            self.failures += 1
            self.ready = False
            text = str(exc).replace(token, "<token>") or type(exc).__name__
            self.last_error = f"{type(exc).__name__}: {text}"
            raise ReviewUnavailable(
                f"the Kubernetes API server did not review the token of issuer "
                f"{self.settings.name!r}: {self.last_error}"
            ) from exc
        self.ready, self.answered_once, self.last_error = True, True, None
        verdict = Review.from_status(status)
        if token in verdict.error:  # no server echoes it; never let one through
            verdict = dataclasses.replace(verdict, error=verdict.error.replace(token, "<token>"))
        return verdict


def spelled_audiences(payload: Mapping[str, Any], accepted: Sequence[str]) -> list[str]:
    """``accepted``, and after them each of the token's ``aud`` values that is one of them by
    the client's URL rule (``normalise_url``) but spelled otherwise: the API server compares
    audiences exactly, the broker as its clients do."""
    aud = payload.get("aud")
    given = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    wanted = {normalise_url(a) for a in accepted}
    extra = [
        a for a in given if isinstance(a, str) and a not in accepted and normalise_url(a) in wanted
    ]
    return [*accepted, *extra]


def reviewed_claims(
    verdict: Review, payload: Mapping[str, Any], accepted: Sequence[str], issuer: str
) -> dict[str, Any]:
    """The token's claims, once ``verdict`` authenticates it for one of ``accepted`` and
    agrees with its ``sub`` and bound pod; else :class:`TokenRejected`."""
    if not verdict.authenticated:
        invalidated = any(w in verdict.error.lower() for w in ("invalidated", "not found"))
        raise TokenRejected(
            "token_revoked" if invalidated else "bad_signature",
            f"the Kubernetes API server did not authenticate the token of issuer {issuer!r}"
            f" ({short(verdict.error or 'no reason given', 200)})"
            + ("; its pod or secret is gone: get a fresh token" if invalidated else ""),
        )
    if not {normalise_url(a) for a in verdict.audiences} & {normalise_url(a) for a in accepted}:
        raise TokenRejected(
            "audience_mismatch",
            f"the Kubernetes API server authenticated the token for audiences "
            f"{list(verdict.audiences)}, none of {list(accepted)}; request a token with one",
        )
    if verdict.username != payload.get("sub"):
        as_who = f"the Kubernetes API server reviewed the token as {short(verdict.username)}"
        raise TokenRejected(
            "bad_signature",
            f"{as_who}, but its sub is {short(payload.get('sub'))}",
            logged=f"{as_who}, but its sub is another",
        )
    bound = ((_POD_NAME, "kubernetes.io.pod.name"), (_POD_UID, "kubernetes.io.pod.uid"))
    for extra, claim in bound:
        reviewed, carried = verdict.extra.get(extra), claim_at(payload, claim)
        if reviewed is not None and (len(reviewed) != 1 or reviewed[0] != carried):
            bound_to = f"the Kubernetes API server reviewed the token as bound to {extra} "
            bound_to += f"{list(reviewed)}"
            raise TokenRejected(
                "bad_signature",
                f"{bound_to}, but its {claim} is {short(carried)}",
                logged=f"{bound_to}, but its {claim} is another",
            )
    return dict(payload)
