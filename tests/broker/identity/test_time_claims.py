"""The time claims fuzzed (issue 26, item 10): ``exp``, ``nbf`` and ``iat`` with NaN,
infinities, huge, negative, fractional and non-numeric values, in both verification modes.

JWKS: tokens really signed by a scripted issuer on loopback HTTPS (tests/_support/oidc_issuer.py);
TokenReview: the claim rules run on the unsigned payload before any review, so an anonymous
caller's made-up token reaches them (the scripted reviewer of test_tokenreview.py answers as
kube-apiserver does; tests/kube/test_identity_cluster.py asks a real one). Every hostile value is
``401 token_malformed`` naming the claim; none is a 500 (NaN passed the expiry comparison and
then failed ``int()``; infinity and 1e308 failed converting to a date).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from k8s_agent_sandbox_awx.broker.identity._configured import configured_verifier
from k8s_agent_sandbox_awx.broker.identity._rejection import TokenRejected
from k8s_agent_sandbox_awx.broker.identity._verify import TokenVerifier
from tests._support import hostile_claims
from tests._support.hostile_claims import CASES, TIME_CLAIMS
from tests._support.oidc_issuer import AUDIENCE, ScriptedIssuer
from tests.broker.identity.test_tokenreview import ISSUER, Reviewer, verifier_for

pytestmark = pytest.mark.asyncio

GRID = [(claim, case) for claim in TIME_CLAIMS for case in CASES]


async def outcome(verifier: TokenVerifier[Any], token: str) -> str:
    """``ok``, or the refusal's code (its detail never holds the token)."""
    try:
        await verifier.verify(f"Bearer {token}")
    except TokenRejected as exc:
        assert token not in str(exc)
        if exc.code == "token_malformed":  # the rule named: a NumericDate's, or JSON's
            assert "NumericDate" in exc.detail or "not JSON" in exc.detail, exc.detail
        return exc.code
    return "ok"


def expected(case: str) -> str:
    return "ok" if CASES[case][1] else "token_malformed"


async def test_every_time_claim_signed_by_the_issuer(issuer: ScriptedIssuer) -> None:
    """JWKS: the signature verifies, then the claim rules refuse the value (they raised
    ``ValueError``/``OverflowError`` for NaN, infinity, 1e308 and a huge integer)."""
    verifier = configured_verifier([issuer.settings()], audience=AUDIENCE)
    key = issuer.current
    got = {}
    for claim, case in GRID:
        token = hostile_claims.signed(
            issuer.claims("alice"), claim, hostile_claims.literal(case, claim),
            key.private, key.algorithm, key.kid,
        )  # fmt: skip
        got[claim, case] = await outcome(verifier, token)
        # seen again: the verified-token memo must not have kept a token it refused
        got[claim, case + " (again)"] = await outcome(verifier, token)
    want = {(c, k): expected(k) for c, k in GRID}
    want |= {(c, k + " (again)"): expected(k) for c, k in GRID}
    assert got == want
    await verifier.aclose()


async def test_every_time_claim_in_tokenreview_mode() -> None:
    """TokenReview: the claim rules run first, on the token as sent: a hostile value is
    refused before any review; an acceptable one is then reviewed (and this reviewer, like the
    API server, does not know a made-up token: ``bad_signature``)."""
    reviewer = Reviewer()
    verifier = verifier_for(reviewer)
    now = int(time.time())
    claims = {
        "iss": ISSUER, "sub": "system:serviceaccount:team-a:agent", "aud": [AUDIENCE],
        "iat": now, "nbf": now, "exp": now + 600,
        "kubernetes.io": {"namespace": "team-a", "serviceaccount": {"name": "agent"}},
    }  # fmt: skip
    got = {}
    for claim, case in GRID:
        token = hostile_claims.unsigned(claims, claim, hostile_claims.literal(case, claim))
        got[claim, case] = await outcome(verifier, token)
    want = {(c, k): "bad_signature" if CASES[k][1] else "token_malformed" for c, k in GRID}
    assert got == want
    reviewed = len(reviewer.calls)
    assert reviewed == sum(1 for _, k in GRID if CASES[k][1])  # only the acceptable ones


async def test_a_token_whose_payload_holds_nan_elsewhere_is_not_json(
    issuer: ScriptedIssuer,
) -> None:
    """NaN and Infinity are not JSON (RFC 8259): anywhere in a token's header or payload, the
    token is malformed, so no such value reaches a policy, an attribute or whoami's answer."""
    verifier = configured_verifier([issuer.settings()], audience=AUDIENCE)
    key = issuer.current
    for text in ("NaN", "Infinity", "-Infinity", "1e999"):
        token = hostile_claims.signed(
            issuer.claims("alice"), "ref", text, key.private, key.algorithm, key.kid
        )
        with pytest.raises(TokenRejected) as info:
            await verifier.verify(f"Bearer {token}")
        assert info.value.code == "token_malformed" and "not JSON" in info.value.detail, text
    await verifier.aclose()
