"""The verified-token memo keeps a token's verdict (broker/identity/_verify.py ``Proven``): a
token seen again runs no claim rule, yet what depends on time is checked at every request, a
replaced issuer (a reload) decides anew, a token one byte away is never a hit, and the memo is
bounded.

Against a scripted issuer on loopback HTTPS (real keys, real signed tokens); the verifier's
clock is moved by hand where time matters.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from typing import Any

import jwt
import pytest

from k8s_agent_sandbox_awx.broker.identity import _verify
from k8s_agent_sandbox_awx.broker.identity._configured import ConfiguredIssuer
from k8s_agent_sandbox_awx.broker.identity._rejection import TokenRejected
from k8s_agent_sandbox_awx.broker.identity._verify import TokenVerifier, VerifiedTokens
from tests._support.oidc_issuer import AUDIENCE, ScriptedIssuer

pytestmark = pytest.mark.asyncio


class Issuers:
    """The trusted issuers as a configuration holds them: replaced whole on a reload."""

    def __init__(self, *issuers: ConfiguredIssuer) -> None:
        self.now: dict[str, ConfiguredIssuer] = {i.url: i for i in issuers}

    def __call__(self) -> dict[str, ConfiguredIssuer]:
        return self.now


@pytest.fixture
def rule_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times the claim rules ran (their spelling check, once per full check)."""
    runs = [0]
    real = _verify.spelled_twice  # type: ignore[attr-defined]

    def counting(claims: Any) -> str | None:
        runs[0] += 1
        return real(claims)

    monkeypatch.setattr(_verify, "spelled_twice", counting)
    yield runs


def _verifier(issuers: Issuers) -> TokenVerifier[ConfiguredIssuer]:
    return TokenVerifier(audience=AUDIENCE, issuers=issuers)


def _claims(token: str) -> dict[str, Any]:
    return dict(jwt.decode(token, options={"verify_signature": False}))


async def _rejected(verifier: TokenVerifier[Any], token: str) -> TokenRejected:
    with pytest.raises(TokenRejected) as info:
        await verifier.verify(f"Bearer {token}")
    return info.value


async def test_a_memoized_token_runs_no_claim_rule_again(
    issuer: ScriptedIssuer, rule_runs: list[int]
) -> None:
    verifier = _verifier(Issuers(ConfiguredIssuer(issuer.settings())))
    token = issuer.token("alice")
    callers = [(await verifier.verify(f"Bearer {token}"))[0] for _ in range(5)]
    assert rule_runs[0] == 1
    assert {c.subject for c in callers} == {"alice"} and callers[0].audience == AUDIENCE
    await verifier.aclose()


async def test_an_expired_token_is_refused_at_the_request_after_exp_even_memoized(
    issuer: ScriptedIssuer, rule_runs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier = _verifier(Issuers(ConfiguredIssuer(issuer.settings(clock_skew_seconds=5))))
    token = issuer.token("alice")
    exp = float(_claims(token)["exp"])
    await verifier.verify(f"Bearer {token}")
    now = time.time()
    verifier.verified._clock = lambda: now  # the memo itself would keep it
    clock = types.SimpleNamespace(time=lambda: exp + 5)  # within the skew: still accepted
    monkeypatch.setattr(_verify, "time", clock)
    assert (await verifier.verify(f"Bearer {token}"))[0].subject == "alice"
    clock.time = lambda: exp + 5.5  # past exp and the skew
    refused = await _rejected(verifier, token)
    assert refused.code == "token_expired"
    assert refused.identity == (issuer.url, "alice")  # its signature verified: for the audit
    assert rule_runs[0] == 1  # refused by the memo's own check, not a full verification
    assert len(verifier.verified) == 1
    await verifier.aclose()


async def test_a_not_yet_valid_time_is_checked_at_every_hit(
    issuer: ScriptedIssuer, monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier = _verifier(Issuers(ConfiguredIssuer(issuer.settings(clock_skew_seconds=0))))
    token = issuer.token("alice")
    nbf = float(_claims(token)["nbf"])
    await verifier.verify(f"Bearer {token}")
    monkeypatch.setattr(_verify, "time", types.SimpleNamespace(time=lambda: nbf - 60))
    assert (await _rejected(verifier, token)).code == "token_not_yet_valid"  # a clock set back
    await verifier.aclose()


async def test_a_reloaded_issuer_decides_anew_at_once(
    issuer: ScriptedIssuer, rule_runs: list[int]
) -> None:
    issuers = Issuers(ConfiguredIssuer(issuer.settings()))
    verifier = _verifier(issuers)
    token = issuer.token("alice", team="a")
    caller, _ = await verifier.verify(f"Bearer {token}")
    assert caller.attributes == {}
    # a reload: the same issuer, now with an attribute taken from the token
    issuers.now = Issuers(ConfiguredIssuer(issuer.settings(attributes=("team",)))).now
    caller, _ = await verifier.verify(f"Bearer {token}")
    assert caller.attributes == {"team": "a"} and rule_runs[0] == 2
    # a reload that accepts another audience only: the memoized token is refused at once
    other = issuer.settings(audiences=("https://other.test",))
    issuers.now = Issuers(ConfiguredIssuer(other)).now
    assert (await _rejected(verifier, token)).code == "audience_mismatch"
    # a reload without the issuer: its tokens are no longer trusted at all
    issuers.now = {}
    assert (await _rejected(verifier, token)).code == "unknown_issuer"
    await verifier.aclose()


async def test_a_token_one_byte_away_is_never_a_hit(
    issuer: ScriptedIssuer, rule_runs: list[int]
) -> None:
    verifier = _verifier(Issuers(ConfiguredIssuer(issuer.settings())))
    token = issuer.token("alice")
    await verifier.verify(f"Bearer {token}")
    head, payload, signature = token.split(".")
    middle = len(signature) // 2
    flipped = "A" if signature[middle] != "A" else "B"
    forged = f"{head}.{payload}.{signature[:middle]}{flipped}{signature[middle + 1 :]}"
    assert (await _rejected(verifier, forged)).code == "bad_signature"
    short = token[:-1]
    assert (await _rejected(verifier, short)).code in ("bad_signature", "token_malformed")
    assert rule_runs[0] == 1  # neither was taken for the memoized token
    # every single-byte change of the token misses the memo (its key is the whole token's)
    memo = verifier.verified
    for at in range(len(token)):
        changed = token[:at] + ("x" if token[at] != "x" else "y") + token[at + 1 :]
        assert memo.get(changed) is None, at
    assert memo.get(token) is not None
    await verifier.aclose()


async def test_the_memo_is_bounded(issuer: ScriptedIssuer) -> None:
    verifier = _verifier(Issuers(ConfiguredIssuer(issuer.settings())))
    verifier.verified = VerifiedTokens(max_entries=3)
    tokens = [issuer.token(f"user-{n}") for n in range(6)]
    for token in tokens:
        await verifier.verify(f"Bearer {token}")
    assert len(verifier.verified) == 3
    assert verifier.verified.get(tokens[0]) is None and verifier.verified.get(tokens[-1])
    await verifier.aclose()
