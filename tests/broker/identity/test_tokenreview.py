"""TokenReview verification's own rules (broker/identity/_tokenreview.py) with a scripted
reviewer standing in for the API client: what counts as authenticated, the caches' bounds,
single flight, failures. The real API server's answers: tests/kube/test_identity_cluster.py.

The tokens are real JWTs signed at test time (the verifier checks their shape and claims
locally before it asks); the scripted reviewer answers as kube-apiserver 1.20 does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from k8s_agent_sandbox_awx.broker.identity._configured import configured_verifier
from k8s_agent_sandbox_awx.broker.identity._rejection import TokenRejected
from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings
from k8s_agent_sandbox_awx.broker.identity._tokenreview import (
    PROBE_TOKEN,
    Review,
    TokenReviews,
)
from k8s_agent_sandbox_awx.broker.identity._verify import TokenVerifier

pytestmark = pytest.mark.asyncio

ISSUER = "https://kubernetes.default.svc.cluster.local"
AUDIENCE = "https://broker.test"
KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class Reviewer:
    """Answers like the API server: authenticated for its known tokens; records each call."""

    def __init__(self) -> None:
        self.known: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, list[str] | None]] = []
        self.delay = 0.0
        self.fail: Exception | None = None

    def admit(self, token: str, username: str, audiences: Sequence[str] = (AUDIENCE,),
              extra: dict[str, list[str]] | None = None) -> None:  # fmt: skip
        self.known[token] = {
            "authenticated": True,
            "user": {"username": username, "uid": "u", "groups": [], "extra": extra or {}},
            "audiences": list(audiences),
        }

    async def token_review(
        self, token: str, audiences: Sequence[str] | None = None
    ) -> dict[str, Any]:
        self.calls.append((token, None if audiences is None else list(audiences)))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return self.known.get(token, {"authenticated": False, "error": "invalid bearer token"})


def token(namespace: str = "team-a", sa: str = "agent", pod: str | None = None,
          **claims: Any) -> str:  # fmt: skip
    now = int(time.time())
    info: dict[str, Any] = {"namespace": namespace, "serviceaccount": {"name": sa, "uid": "s"}}
    if pod:
        info["pod"] = {"name": pod, "uid": f"{pod}-uid"}
    payload = {"iss": ISSUER, "sub": f"system:serviceaccount:{namespace}:{sa}",
               "aud": [AUDIENCE], "iat": now, "nbf": now, "exp": now + 600,
               "kubernetes.io": info, **claims}  # fmt: skip
    return jwt.encode({k: v for k, v in payload.items() if v is not None}, KEY, "RS256",
                      headers={"kid": "k"})  # fmt: skip


def settings(**overrides: Any) -> IssuerSettings:
    values: dict[str, Any] = {"name": "cluster", "url": ISSUER, "provider": "kubernetes",
                              "audiences": (AUDIENCE,), "verification": "tokenreview"}  # fmt: skip
    values.update(overrides)
    return IssuerSettings(**values)


def verifier_for(reviewer: Reviewer, **overrides: Any) -> TokenVerifier[Any]:
    return configured_verifier([settings(**overrides)], audience=AUDIENCE, reviewer=reviewer)


async def rejected(verifier: TokenVerifier[Any], value: str) -> TokenRejected:
    with pytest.raises(TokenRejected) as info:
        await verifier.verify(f"Bearer {value}")
    assert value not in str(info.value)
    return info.value


async def test_a_reviewed_token_becomes_a_caller(reviewer: Reviewer) -> None:
    value = token(pod="agent-0")
    reviewer.admit(value, "system:serviceaccount:team-a:agent", extra={
        "authentication.kubernetes.io/pod-name": ["agent-0"],
        "authentication.kubernetes.io/pod-uid": ["agent-0-uid"],
    })  # fmt: skip
    verifier = verifier_for(reviewer)
    caller, issuer = await verifier.verify(f"Bearer {value}")
    assert (caller.subject, caller.provider, issuer.name) == (
        "system:serviceaccount:team-a:agent", "kubernetes", "cluster",
    )  # fmt: skip
    assert caller.attributes == {
        "namespace": "team-a", "service_account": "agent", "pod": "agent-0",
    }  # fmt: skip
    assert reviewer.calls == [(value, [AUDIENCE])]  # spec.audiences = the issuer's audiences
    assert len(verifier.verified) == 0  # never in the signature memo: asked again later
    assert verifier.readiness()["cluster"] == {
        "issuer": "cluster", "ready": True, "last_error": None, "verification": "tokenreview",
    }  # fmt: skip


async def test_an_audience_spelled_otherwise_is_reviewed_as_the_token_spells_it(
    reviewer: Reviewer,
) -> None:
    """The API server compares audiences exactly; the broker by the client's URL rule
    (``normalise_url``): a token for ``AUDIENCE/`` is reviewed for that spelling too."""
    value = token(aud=[AUDIENCE + ":443/"])
    reviewer.admit(value, "system:serviceaccount:team-a:agent", audiences=[AUDIENCE + ":443/"])
    caller, _ = await verifier_for(reviewer).verify(f"Bearer {value}")
    assert caller.audience == AUDIENCE
    assert reviewer.calls == [(value, [AUDIENCE, AUDIENCE + ":443/"])]


async def test_the_shape_and_claims_are_checked_before_any_review(reviewer: Reviewer) -> None:
    verifier = verifier_for(reviewer)
    cases = {
        "token_malformed": "not-a-jwt",
        "unknown_issuer": token(iss="https://other.test"),
        "token_expired": token(exp=int(time.time()) - 3600),
        "audience_mismatch": token(aud=["https://other.test"]),
        "missing_claim": token(sub=None),
        "algorithm_not_allowed": jwt.encode({"iss": ISSUER}, "k" * 32, "HS256"),
    }
    for code, value in cases.items():
        assert (await rejected(verifier, value)).code == code, code
    assert reviewer.calls == []


async def test_what_the_api_server_must_say(reviewer: Reviewer) -> None:
    verifier = verifier_for(reviewer)
    unknown = await rejected(verifier, token(sa="stranger"))
    assert unknown.code == "bad_signature" and "invalid bearer token" in unknown.detail
    other_audience = token(sa="b")
    reviewer.admit(other_audience, "system:serviceaccount:team-a:b", ["https://kubernetes"])
    error = await rejected(verifier, other_audience)
    assert error.code == "audience_mismatch"
    assert "for audiences ['https://kubernetes']" in error.detail
    someone_else = token(sa="c")
    reviewer.admit(someone_else, "system:serviceaccount:kube-system:admin")
    error = await rejected(verifier, someone_else)
    assert error.code == "bad_signature" and "but its sub is" in error.detail
    assert "team-a" not in error.logged  # the logs get no claim of an unproven token
    wrong_pod = token(sa="d", pod="p-1")
    reviewer.admit(wrong_pod, "system:serviceaccount:team-a:d",
                   extra={"authentication.kubernetes.io/pod-name": ["p-2"]})  # fmt: skip
    error = await rejected(verifier, wrong_pod)
    assert "bound to authentication.kubernetes.io/pod-name ['p-2']" in error.detail
    assert "p-1" in error.detail and "p-1" not in error.logged
    gone = token(sa="e", pod="p-3")
    reviewer.known[gone] = {"authenticated": False, "error": "[invalid bearer token, Token has "
                            "been invalidated]"}  # fmt: skip
    error = await rejected(verifier, gone)
    assert error.code == "token_revoked" and "its pod or secret is gone" in error.detail


async def test_a_positive_answer_is_cached_briefly_and_never_past_exp(reviewer: Reviewer) -> None:
    clock = Clock()
    value = token()
    reviewer.admit(value, "system:serviceaccount:team-a:agent")
    reviews = TokenReviews(settings(tokenreview_cache_seconds=10), reviewer,
                           audiences=[AUDIENCE], clock=clock)  # fmt: skip
    for _ in range(5):
        assert (await reviews.review(value, exp=clock.now + 600)).authenticated
    assert len(reviewer.calls) == 1 and reviews.hits == 4
    clock.now += 10.01
    await reviews.review(value, exp=clock.now + 600)
    assert len(reviewer.calls) == 2
    short = token(sa="short")
    reviewer.admit(short, "system:serviceaccount:team-a:short")
    await reviews.review(short, exp=clock.now + 2)  # exp in 2 s: cached at most that long
    clock.now += 2.01
    await reviews.review(short, exp=clock.now - 0.01)
    assert len(reviewer.calls) == 4


async def test_a_negative_answer_is_cached_for_seconds_only(reviewer: Reviewer) -> None:
    clock = Clock()
    reviews = TokenReviews(settings(tokenreview_negative_cache_seconds=2), reviewer,
                           audiences=[AUDIENCE], clock=clock)  # fmt: skip
    value = token(sa="later")
    assert not (await reviews.review(value, exp=clock.now + 600)).authenticated
    assert not (await reviews.review(value, exp=clock.now + 600)).authenticated
    assert len(reviewer.calls) == 1
    reviewer.admit(value, "system:serviceaccount:team-a:later")  # e.g. the informer caught up
    clock.now += 2.01
    assert (await reviews.review(value, exp=clock.now + 600)).authenticated


async def test_concurrent_reviews_of_one_token_share_one_request(reviewer: Reviewer) -> None:
    value = token()
    reviewer.admit(value, "system:serviceaccount:team-a:agent")
    reviewer.delay = 0.2
    verifier = verifier_for(reviewer)
    callers = await asyncio.gather(*(verifier.verify(f"Bearer {value}") for _ in range(10)))
    assert {c.subject for c, _ in callers} == {"system:serviceaccount:team-a:agent"}
    assert len(reviewer.calls) == 1


async def test_an_api_server_failure_is_refused_uncached_and_scrubbed(reviewer: Reviewer) -> None:
    value = token()
    reviewer.admit(value, "system:serviceaccount:team-a:agent")
    reviewer.fail = ConnectionError(f"connection refused while sending {value}")
    verifier = verifier_for(reviewer)
    error = await rejected(verifier, value)
    assert error.code == "bad_signature"
    assert "did not review the token of issuer 'cluster': ConnectionError" in error.detail
    assert "<token>" in error.detail and "retry later" in error.detail
    assert verifier.readiness()["cluster"]["ready"] is False
    reviewer.fail = None
    caller, _ = await verifier.verify(f"Bearer {value}")  # a failure is never cached
    assert caller.subject.endswith(":agent") and len(reviewer.calls) == 2


async def test_probe_and_load(reviewer: Reviewer) -> None:
    verifier = verifier_for(reviewer)
    assert verifier.readiness()["cluster"]["ready"] is False
    assert await verifier.load() == {"cluster": True}
    assert reviewer.calls == [(PROBE_TOKEN, [AUDIENCE])]
    reviewer.fail = PermissionError("tokenreviews.authentication.k8s.io is forbidden")
    assert await verifier.load() == {"cluster": False}
    assert "forbidden" in verifier.readiness()["cluster"]["last_error"]


async def test_review_from_a_status() -> None:
    review = Review.from_status({"authenticated": True, "audiences": ["a"], "user": {
        "username": "u", "extra": {"k": ["v"], "bad": "not-a-list"}}})  # fmt: skip
    assert review == Review(True, "u", {"k": ("v",)}, ("a",), "")
    assert Review.from_status({}) == Review(False)


@pytest.fixture
def reviewer() -> Reviewer:
    return Reviewer()


async def test_an_api_server_outage_after_it_answered_is_the_issuers_outage(
    reviewer: Reviewer,
) -> None:
    """Once the API server has reviewed tokens, its failure is an outage of that issuer (503
    ``issuer_unavailable``, retry after a few seconds, as for a JWKS issuer whose keys went
    stale), not a bad token: the token may well be good."""
    from k8s_agent_sandbox_awx.broker.identity._rejection import IssuerUnavailable

    first, second = token(jti="first"), token(jti="second")  # not the same token
    reviewer.admit(first, "system:serviceaccount:team-a:agent")
    reviewer.admit(second, "system:serviceaccount:team-a:agent")
    verifier = verifier_for(reviewer)
    await verifier.verify(f"Bearer {first}")
    reviewer.fail = ConnectionError(f"connection refused while sending {second}")
    with pytest.raises(IssuerUnavailable) as info:
        await verifier.verify(f"Bearer {second}")
    assert info.value.code == "issuer_unavailable" and info.value.retry_after >= 1
    assert "did not review the token of issuer 'cluster'" in info.value.detail
    assert second not in str(info.value) and "retry later" in info.value.detail
    reviewer.fail = None
    caller, _ = await verifier.verify(f"Bearer {second}")  # a failure is never cached
    assert caller.subject.endswith(":agent")
