"""An issuer's keys (broker/identity/_jwks.py): discovery, cache, the last good keys, the
unknown-kid rate limit, single flight, the bearer token file, filtering, limits.

Everything runs against a scripted issuer on loopback HTTPS (tests/_support/oidc_issuer.py)
with keys and tokens made at test time; a hand-moved clock stands in for time where the cache
lifetime matters.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.broker.identity._configured import configured_verifier
from k8s_agent_sandbox_awx.broker.identity._jwks import KeySet, KeysUnavailable
from k8s_agent_sandbox_awx.broker.identity._rejection import TokenRejected
from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings
from k8s_agent_sandbox_awx.broker.identity._verify import TokenVerifier
from tests._support.oidc_issuer import AUDIENCE, DISCOVERY, JWKS, ScriptedIssuer, SigningKey
from tests._support.scripted_https import Reply

pytestmark = pytest.mark.asyncio


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def verifier_for(*settings: IssuerSettings) -> TokenVerifier[Any]:
    return configured_verifier(list(settings), audience=AUDIENCE)


async def verify(verifier: TokenVerifier[Any], token: str) -> Any:
    caller, _ = await verifier.verify(f"Bearer {token}")
    return caller


async def rejected(verifier: TokenVerifier[Any], token: str) -> TokenRejected:
    with pytest.raises(TokenRejected) as info:
        await verifier.verify(f"Bearer {token}")
    return info.value


def forged_kid(issuer: ScriptedIssuer) -> str:
    return issuer.sign(issuer.claims(), headers={"kid": uuid.uuid4().hex})


# ------------------------------------------------------------------------------ where keys are


async def test_discovery_then_the_jwks_and_a_token_verifies(issuer: ScriptedIssuer) -> None:
    verifier = verifier_for(issuer.settings())
    assert verifier.readiness()["scripted"]["ready"] is False
    caller = await verify(verifier, issuer.token("alice"))
    assert (caller.issuer, caller.subject, caller.audience) == (issuer.url, "alice", AUDIENCE)
    assert [r.target for r in issuer.requests] == [DISCOVERY, JWKS]
    status = verifier.readiness()["scripted"]
    assert status["ready"] is True and status["keys"] == 1 and status["last_error"] is None
    assert verifier.jwks_fetches == 1
    await verifier.aclose()


async def test_an_explicit_jwks_url_skips_discovery(issuer: ScriptedIssuer) -> None:
    verifier = verifier_for(issuer.settings(jwks_url=issuer.url + JWKS, discovery=False))
    assert (await verify(verifier, issuer.token())).subject == "user"
    assert issuer.hits(DISCOVERY) == 0 and issuer.hits(JWKS) == 1
    await verifier.aclose()


async def test_a_discovery_document_naming_another_issuer_is_refused(
    issuer: ScriptedIssuer,
) -> None:
    issuer.discovered_issuer = "https://accounts.example.com"
    verifier = verifier_for(issuer.settings())
    error = await rejected(verifier, issuer.token())
    assert error.code == "bad_signature"
    assert "names issuer 'https://accounts.example.com', not the configured url" in error.detail
    assert "set url to exactly the issuer" in error.detail
    assert issuer.hits(JWKS) == 0  # never asked for keys it named
    assert verifier.readiness()["scripted"]["ready"] is False
    await verifier.aclose()


async def test_a_discovered_jwks_uri_must_be_https(issuer: ScriptedIssuer) -> None:
    issuer.jwks_uri = "http://127.0.0.1:1/keys"
    verifier = verifier_for(issuer.settings())
    assert "has no https jwks_uri" in (await rejected(verifier, issuer.token())).detail
    await verifier.aclose()


async def test_an_untrusted_certificate_says_to_set_ca_file(issuer: ScriptedIssuer) -> None:
    verifier = verifier_for(issuer.settings(ca_file=None))  # the system's trust store
    detail = (await rejected(verifier, issuer.token())).detail
    assert "CERTIFICATE_VERIFY_FAILED" in detail and "set ca_file" in detail
    await verifier.aclose()


# ------------------------------------------------------------------------------ rotation


async def test_key_rotation_one_refetch_old_tokens_until_the_key_is_removed(
    issuer: ScriptedIssuer,
) -> None:
    verifier = verifier_for(issuer.settings(jwks_min_refetch_seconds=0.3))
    old_key = issuer.current
    old = issuer.token("old")
    await verify(verifier, old)
    issuer.rotate()
    for sub in ("new-1", "new-2", "new-3"):  # a new kid: one refetch, then known
        await verify(verifier, issuer.token(sub))
    assert issuer.hits(JWKS) == 2
    assert (await verify(verifier, issuer.token("old-2", key=old_key))).subject == "old-2"
    assert (await verify(verifier, old)).subject == "old"  # the memo, still trusted

    issuer.retire(old_key.kid)
    await asyncio.sleep(0.35)  # the unknown-kid refetch interval
    newest = issuer.rotate()  # a newer kid makes the broker refetch and see the removal
    await verify(verifier, issuer.token("newest", key=newest))
    assert issuer.hits(JWKS) == 3
    assert len(verifier.verified) == 0  # a key left the JWKS: the memo of the issuer dropped
    error = await rejected(verifier, old)
    assert error.code == "bad_signature" and "publishes no key with kid" in error.detail
    assert issuer.hits(JWKS) == 3  # the unknown-kid refetch waits for its interval
    await verifier.aclose()


# ------------------------------------------------------------------------------ failures


async def test_a_failing_refresh_keeps_the_last_good_keys_up_to_the_bound(
    issuer: ScriptedIssuer, caplog: pytest.LogCaptureFixture
) -> None:
    """Decision: the last good keys are kept for at most jwks_max_stale_seconds after they
    were fetched (default 12 x jwks_cache_seconds); retries back off from 1 s up to the
    refetch interval; the failure streak is logged once."""
    clock = Clock()
    settings = issuer.settings(
        jwks_cache_seconds=10, jwks_max_stale_seconds=60, jwks_min_refetch_seconds=5
    )
    keys = KeySet(settings, clock=clock)
    kid, alg = issuer.current.kid, issuer.current.algorithm
    assert await keys.key_for(kid, alg) is not None
    issuer.replies[JWKS] = Reply(500, {"error": "down"})
    caplog.set_level(logging.DEBUG, "k8s_agent_sandbox_awx.broker.identity")

    clock.now += 11  # stale: a refresh is tried, fails, the last good key still serves
    assert await keys.key_for(kid, alg) is not None
    await keys.settled()  # (the refresh runs in the background)
    assert (keys.failures, issuer.hits(JWKS)) == (1, 2)
    assert "answered 500" in (keys.last_error or "") and keys.ready
    clock.now += 0.5  # within the first backoff (1 s): no fetch
    assert await keys.key_for(kid, alg) is not None
    assert issuer.hits(JWKS) == 2
    attempts = []
    for _ in range(9):  # backoff 1, 2, 4, 5, 5, ... (capped at the refetch interval)
        clock.now += 5.01
        assert await keys.key_for(kid, alg) is not None
        await keys.settled()
        attempts.append(issuer.hits(JWKS))
    assert clock.now - 1000 < 60
    assert attempts[-1] - attempts[0] == 8  # one try per 5 s once backed off
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "keeping its 1 last good keys" in warnings[0].getMessage()

    clock.now = 1000 + 61  # past the bound: dropped, refused, not ready
    with pytest.raises(KeysUnavailable, match="answered 500; next try in"):
        await keys.key_for(kid, alg)
    assert not keys.ready and keys.status()["keys"] == 0

    del issuer.replies[JWKS]  # the issuer is back: the next try (after the backoff) loads
    clock.now += 5.01
    assert await keys.key_for(kid, alg) is not None
    assert keys.ready and keys.last_error is None and keys.backoff_seconds == 0
    await keys.aclose()


async def test_with_no_keys_yet_a_failure_is_refused_and_backs_off(
    issuer: ScriptedIssuer,
) -> None:
    clock = Clock()
    issuer.replies[JWKS] = Reply(503, {})
    keys = KeySet(issuer.settings(), clock=clock)
    for _ in range(5):
        with pytest.raises(KeysUnavailable, match=r"the JWKS at .* answered 503"):
            await keys.key_for(issuer.current.kid, "RS256")
    assert issuer.hits(JWKS) == 1  # the next try waits for the backoff
    clock.now += 1.01
    with pytest.raises(KeysUnavailable):
        await keys.key_for(issuer.current.kid, "RS256")
    assert issuer.hits(JWKS) == 2
    await keys.aclose()


# ------------------------------------------------------------------------------ the kid flood


async def test_an_unknown_kid_flood_costs_one_fetch_per_interval(
    issuer: ScriptedIssuer,
) -> None:
    clock = Clock()
    keys = KeySet(issuer.settings(jwks_min_refetch_seconds=30), clock=clock)
    assert await keys.key_for(issuer.current.kid, "RS256") is not None
    results = await asyncio.gather(*(keys.key_for(uuid.uuid4().hex, "RS256") for _ in range(50)))
    assert results == [None] * 50
    for _ in range(50):
        clock.now += 0.5
        assert await keys.key_for(uuid.uuid4().hex, "RS256") is None
    assert issuer.hits(JWKS) == 2  # the load and ONE refetch in those 25 s
    clock.now += 5.01  # 30 s since that refetch
    assert await keys.key_for(uuid.uuid4().hex, "RS256") is None
    assert issuer.hits(JWKS) == 3
    assert (keys.kid_refetches, keys.rate_limited) == (2, 50)  # the 49 joined the refetch
    await keys.aclose()


async def test_a_rotation_burst_shares_one_refetch_and_every_token_verifies(
    issuer: ScriptedIssuer,
) -> None:
    verifier = verifier_for(issuer.settings(jwks_min_refetch_seconds=30))
    await verify(verifier, issuer.token())
    issuer.rotate()
    issuer.replies[JWKS] = Reply(200, {"keys": [k.jwk() for k in issuer.keys]}, delay=0.2)
    callers = await asyncio.gather(*(verify(verifier, issuer.token(f"n{i}")) for i in range(20)))
    assert len(callers) == 20 and issuer.hits(JWKS) == 2
    await verifier.aclose()


async def test_the_flood_through_the_verifier(issuer: ScriptedIssuer) -> None:
    verifier = verifier_for(issuer.settings(jwks_min_refetch_seconds=30))
    await verify(verifier, issuer.token())
    errors = await asyncio.gather(
        *(verifier.verify(f"Bearer {forged_kid(issuer)}") for _ in range(40)),
        return_exceptions=True,
    )
    assert all(isinstance(e, TokenRejected) and e.code == "bad_signature" for e in errors)
    assert issuer.hits(JWKS) == 2
    await verifier.aclose()


# ------------------------------------------------------------------------------ single flight


async def test_concurrent_first_verifications_share_one_fetch(issuer: ScriptedIssuer) -> None:
    issuer.replies[JWKS] = Reply(200, {"keys": [issuer.current.jwk()]}, delay=0.3)
    verifier = verifier_for(issuer.settings())
    callers = await asyncio.gather(*(verify(verifier, issuer.token(f"u{i}")) for i in range(20)))
    assert sorted(c.subject for c in callers) == sorted(f"u{i}" for i in range(20))
    assert (issuer.hits(DISCOVERY), issuer.hits(JWKS)) == (1, 1)
    await verifier.aclose()


async def test_a_slow_jwks_never_blocks_verifications_with_cached_keys(
    issuer: ScriptedIssuer, tmp_path: Path
) -> None:
    async with ScriptedIssuer(tmp_path) as slow:
        slow.replies[JWKS] = Reply(200, {"keys": [slow.current.jwk()]}, delay=1.5)
        verifier = verifier_for(issuer.settings(), slow.settings(name="slow"))
        await verify(verifier, issuer.token("warm"))
        issuer.replies[JWKS] = Reply(200, {"keys": [issuer.current.jwk()]}, delay=1.5)
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        pending = [
            asyncio.create_task(verifier.verify(f"Bearer {forged_kid(issuer)}")),  # refetches
            asyncio.create_task(verifier.verify(f"Bearer {slow.token('first')}")),  # first load
        ]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        callers = [await verify(verifier, issuer.token(f"fast-{i}")) for i in range(20)]
        elapsed = time.monotonic() - started
        assert len(callers) == 20 and elapsed < 1.0, elapsed
        assert not any(task.done() for task in pending)  # the slow fetches still under way
        results = await asyncio.gather(*pending, return_exceptions=True)
        tick.cancel()
        assert isinstance(results[0], TokenRejected)
        assert results[1][0].subject == "first"  # type: ignore[index]
        assert max(gaps) < 0.5, max(gaps)  # the loop kept turning (a fetch takes 1.5 s)
        await verifier.aclose()


# ------------------------------------------------------------------------------ the bearer token


async def test_the_token_file_is_sent_and_read_again_on_every_fetch(
    issuer: ScriptedIssuer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token_file = tmp_path / "token"
    token_file.write_text("first-secret-token\n")
    keys = KeySet(issuer.settings(token_file=str(token_file)))
    await keys.refresh()
    assert issuer.authorizations(DISCOVERY) == ["Bearer first-secret-token"]
    assert issuer.authorizations(JWKS) == ["Bearer first-secret-token"]
    token_file.write_text("second-secret-token")  # the kubelet rotated it
    await keys.refresh()
    assert issuer.authorizations(JWKS)[-1] == "Bearer second-secret-token"
    issuer.replies[JWKS] = Reply(500, {})
    with pytest.raises(KeysUnavailable) as failed:
        await keys.refresh()
    shown = " ".join([repr(keys), str(keys.status()), str(failed.value), caplog.text])
    assert "secret-token" not in shown
    await keys.aclose()


async def test_an_unreadable_or_empty_token_file_is_named(
    issuer: ScriptedIssuer, tmp_path: Path
) -> None:
    missing = tmp_path / "nope"
    keys = KeySet(issuer.settings(token_file=str(missing)))
    with pytest.raises(KeysUnavailable, match=f"cannot read token_file {missing}"):
        await keys.refresh()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    keys = KeySet(issuer.settings(token_file=str(empty)))
    with pytest.raises(KeysUnavailable, match="is empty: it must hold a bearer token"):
        await keys.refresh()
    assert issuer.hits(DISCOVERY) == 0


async def test_an_anonymous_refusal_says_to_configure_token_file(
    issuer: ScriptedIssuer, tmp_path: Path
) -> None:
    issuer.replies[DISCOVERY] = Reply(403, {"message": "forbidden: system:anonymous"})
    with pytest.raises(KeysUnavailable, match=r"anonymous request.*set token_file"):
        await KeySet(issuer.settings()).refresh()
    token_file = tmp_path / "token"
    token_file.write_text("t")
    with pytest.raises(KeysUnavailable, match=f"token of token_file {token_file}.*discovery"):
        await KeySet(issuer.settings(token_file=str(token_file))).refresh()


async def test_the_token_never_goes_to_a_discovered_jwks_uri_elsewhere(
    issuer: ScriptedIssuer, tmp_path: Path
) -> None:
    """Google's discovery names keys on another host: the broker's bearer token (if one is
    configured) stays with the issuer's own origin unless ca_file pins a private CA."""
    async with ScriptedIssuer(tmp_path) as elsewhere:
        elsewhere.keys = issuer.keys
        issuer.jwks_uri = elsewhere.url + JWKS
        context = ssl.create_default_context(cafile=str(issuer.ca_file))
        context.load_verify_locations(cafile=str(elsewhere.ca_file))
        async with httpx.AsyncClient(verify=context, follow_redirects=False) as client:
            token_file = tmp_path / "token"
            token_file.write_text("broker-token")
            settings = issuer.settings(token_file=str(token_file), ca_file=None)
            keys = KeySet(settings, http=lambda: client)
            assert await keys.key_for(issuer.current.kid, "RS256") is not None
        assert issuer.authorizations(DISCOVERY) == ["Bearer broker-token"]
        assert elsewhere.authorizations(JWKS) == [None]


# ------------------------------------------------------------------------------ limits


async def test_redirects_are_never_followed(issuer: ScriptedIssuer) -> None:
    issuer.replies[JWKS] = Reply(302, {}, headers={"Location": issuer.url + "/elsewhere"})
    with pytest.raises(KeysUnavailable, match=r"answered 302.*redirects are never followed"):
        await KeySet(issuer.settings()).refresh()
    assert issuer.hits("/elsewhere") == 0


async def test_an_oversized_answer_is_refused(issuer: ScriptedIssuer) -> None:
    issuer.replies[JWKS] = Reply(200, {"keys": [issuer.current.jwk()], "pad": "x" * 10_000})
    with pytest.raises(KeysUnavailable, match="is over 2048 bytes"):
        await KeySet(issuer.settings(max_document_bytes=2048)).refresh()


async def test_a_timeout_is_named(issuer: ScriptedIssuer) -> None:
    issuer.replies[DISCOVERY] = Reply(200, {}, delay=2)
    started = time.monotonic()
    with pytest.raises(
        KeysUnavailable,
        match=r"timed out: no answer within 0.3 s \(timeout_seconds, one deadline for the whole",
    ):
        await KeySet(issuer.settings(timeout_seconds=0.3)).refresh()
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize(
    ("document", "message"),
    [({"nokeys": []}, "not a key set"), ({"keys": "x"}, "not a key set")],
)
async def test_a_jwks_that_is_not_a_key_set(
    issuer: ScriptedIssuer, document: dict[str, Any], message: str
) -> None:
    issuer.replies[JWKS] = Reply(200, document)
    with pytest.raises(KeysUnavailable, match=message):
        await KeySet(issuer.settings()).refresh()


# ------------------------------------------------------------------------------ filtering


async def test_keys_are_filtered_to_the_pinned_algorithms(issuer: ScriptedIssuer) -> None:
    ec_key = SigningKey("ES256")
    rs384 = SigningKey("RS384")
    encryption = SigningKey("RS256")
    issuer.extra_jwks = [
        encryption.jwk(use="enc"),
        ec_key.jwk(),  # an EC key for an RS256-pinned issuer
        rs384.jwk(),  # alg RS384: not pinned
        {"kty": "oct", "kid": "shared", "k": "c2VjcmV0"},
        {"kty": "RSA", "kid": "broken", "n": "AQAB"},  # unusable
    ]
    verifier = verifier_for(issuer.settings())
    await verify(verifier, issuer.token())
    assert verifier.readiness()["scripted"]["ignored_keys"] == 5
    for key in (encryption, rs384):
        error = await rejected(verifier, issuer.token(key=key))
        assert error.code in ("bad_signature", "algorithm_not_allowed"), error
    error = await rejected(verifier, issuer.token(key=encryption))
    assert "publishes no key with kid" in error.detail
    error = await rejected(verifier, issuer.token(key=ec_key))
    assert error.code == "algorithm_not_allowed" and "not allowed for issuer" in error.detail
    await verifier.aclose()


async def test_a_key_without_alg_serves_each_pinned_algorithm_of_its_type(
    issuer: ScriptedIssuer,
) -> None:
    rsa_key = issuer.current
    issuer.replies[JWKS] = Reply(200, {"keys": [rsa_key.jwk(alg=None)]})
    verifier = verifier_for(issuer.settings(algorithms=["RS256", "PS256"]))
    ps256 = issuer.sign(issuer.claims("ps"), headers={"alg": "PS256"})
    assert (await verify(verifier, issuer.token("rs"))).subject == "rs"
    assert (await verify(verifier, ps256)).subject == "ps"
    await verifier.aclose()


async def test_no_key_for_the_pinned_algorithms_is_a_failure(issuer: ScriptedIssuer) -> None:
    with pytest.raises(KeysUnavailable, match=r"no signing key for the pinned algorithms"):
        await KeySet(issuer.settings(algorithms=("ES256",))).refresh()
