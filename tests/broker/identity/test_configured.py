"""A configured broker's verification (``configured_verifier`` over ``IssuerSettings``): every
check the local broker makes, per issuer (audiences, pinned algorithms, skew), the
verified-token memo, provider attributes, and the settings' own rules.

Against a scripted issuer on loopback HTTPS with real keys (tests/_support/oidc_issuer.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from k8s_agent_sandbox_awx.broker.identity._configured import (
    ConfiguredIssuer,
    configured_verifier,
)
from k8s_agent_sandbox_awx.broker.identity._jwks import select_keys
from k8s_agent_sandbox_awx.broker.identity._rejection import TokenRejected
from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings, SettingsError
from k8s_agent_sandbox_awx.broker.identity._verify import TokenVerifier
from tests._support.oidc_issuer import AUDIENCE, JWKS, ScriptedIssuer, SigningKey
from tests._support.scripted_https import Reply


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned(header: dict[str, Any], payload: dict[str, Any], signature: bytes = b"") -> str:
    head = _b64(json.dumps(header).encode()) + "." + _b64(json.dumps(payload).encode())
    return head + "." + _b64(signature)


def verifier_for(*settings: IssuerSettings) -> TokenVerifier[ConfiguredIssuer]:
    return configured_verifier(list(settings), audience=AUDIENCE)


async def rejected(verifier: TokenVerifier[Any], token: str) -> TokenRejected:
    with pytest.raises(TokenRejected) as info:
        await verifier.verify(f"Bearer {token}")
    assert token not in str(info.value)
    return info.value


# ------------------------------------------------------------------------------ algorithms


@pytest.mark.asyncio
async def test_algorithm_confusion_is_refused(issuer: ScriptedIssuer) -> None:
    verifier = verifier_for(issuer.settings())  # pinned: RS256 (the default)
    claims = issuer.claims()
    # HS256 signed with the issuer's public key as the secret
    public = issuer.current.private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = {"alg": "HS256", "typ": "JWT", "kid": issuer.current.kid}
    head = _b64(json.dumps(header).encode()) + "." + _b64(json.dumps(claims).encode())
    hs256 = head + "." + _b64(hmac.new(public, head.encode(), hashlib.sha256).digest())
    error = await rejected(verifier, hs256)
    assert (error.code, "'HS256'" in error.detail) == ("algorithm_not_allowed", True)
    # none
    error = await rejected(verifier, _unsigned({"alg": "none"}, claims))
    assert (error.code, "'none'" in error.detail) == ("algorithm_not_allowed", True)
    # an ES256 token (its key published too) for an RS256-pinned issuer
    ec_key = SigningKey("ES256")
    issuer.extra_jwks = [ec_key.jwk()]
    error = await rejected(verifier, issuer.token(key=ec_key))
    assert error.code == "algorithm_not_allowed"
    assert "'ES256' is not allowed for issuer 'scripted'; allowed: RS256" in error.detail
    # PS256 in the header over a key published as RS256
    both = verifier_for(issuer.settings(name="both", algorithms=("RS256", "PS256")))
    ps256 = issuer.sign(claims, headers={"alg": "PS256"})
    error = await rejected(both, ps256)
    assert error.code == "algorithm_not_allowed" and "does not match key" in error.detail
    assert issuer.hits(JWKS) == 1  # the pinning refuses before any key is fetched
    await verifier.aclose()
    await both.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("algorithm", ["ES256", "ES384", "ES512", "EdDSA", "PS512", "RS384"])
async def test_each_pinnable_algorithm(tmp_path: Any, algorithm: str) -> None:
    async with ScriptedIssuer(tmp_path, algorithm=algorithm) as signer:
        verifier = verifier_for(signer.settings(algorithms=[algorithm]))
        caller, issuer = await verifier.verify(f"Bearer {signer.token('k')}")
        assert caller.subject == "k" and issuer.name == "scripted"
        assert verifier.readiness()["scripted"]["ignored_keys"] == 0
        await verifier.aclose()


# ------------------------------------------------------------------------------ the claim rules


def _now() -> int:
    return int(time.time())


CLAIM_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "wrong aud": ({"aud": "https://other.test"}, "audience_mismatch", "audience"),
    "aud list without ours": ({"aud": ["a", "b"]}, "audience_mismatch", "audience"),
    "expired": ({"exp": _now() - 3600}, "token_expired", "expired"),
    "nbf ahead": ({"nbf": _now() + 3600}, "token_not_yet_valid", "nbf"),
    "iat ahead": ({"iat": _now() + 3600}, "token_not_yet_valid", "iat"),
    "no sub": ({"sub": None}, "missing_claim", "'sub'"),
    "empty sub": ({"sub": ""}, "missing_claim", "'sub'"),
    "no exp": ({"exp": None}, "missing_claim", "'exp'"),
    "no aud": ({"aud": None}, "missing_claim", "'aud'"),
    "exp not a number": ({"exp": "soon"}, "token_malformed", "NumericDate"),
    "unknown issuer": ({"iss": "https://elsewhere.test"}, "unknown_issuer", "not trusted"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(CLAIM_CASES))
async def test_every_claim_rule(issuer: ScriptedIssuer, case: str) -> None:
    overrides, code, word = CLAIM_CASES[case]
    verifier = verifier_for(issuer.settings())
    payload = issuer.claims(**{k: v for k, v in overrides.items() if v is not None})
    for key in [k for k, v in overrides.items() if v is None]:
        payload.pop(key, None)
    error = await rejected(verifier, issuer.sign(payload))
    assert error.code == code and word in error.detail, error
    await verifier.aclose()


@pytest.mark.asyncio
async def test_a_bad_signature_and_a_tampered_payload(issuer: ScriptedIssuer) -> None:
    verifier = verifier_for(issuer.settings())
    stranger = SigningKey("RS256", kid=issuer.current.kid)
    error = await rejected(verifier, issuer.token(key=stranger))
    assert error.code == "bad_signature" and "signature does not verify" in error.detail
    head, _, sig = issuer.token("alice").split(".")
    tampered = f"{head}.{_b64(json.dumps(issuer.claims('admin')).encode())}.{sig}"
    assert (await rejected(verifier, tampered)).code == "bad_signature"
    await verifier.aclose()


@pytest.mark.asyncio
async def test_audiences_and_skew_are_per_issuer(issuer: ScriptedIssuer, tmp_path: Any) -> None:
    async with ScriptedIssuer(tmp_path) as strict:
        verifier = verifier_for(
            issuer.settings(audiences=["https://a.test", AUDIENCE], clock_skew_seconds=120),
            strict.settings(name="strict", audiences=[], clock_skew_seconds=0),
        )
        late = {"exp": _now() - 60}
        caller, _ = await verifier.verify(f"Bearer {issuer.token(aud=['https://a.test'], **late)}")
        assert caller.audience == "https://a.test"  # the audience that matched
        error = await rejected(verifier, strict.token(**late))
        assert error.code == "token_expired" and "allowed skew 0 s" in error.detail
        # no audiences configured: the broker's own URL (the verifier's audience)
        caller, _ = await verifier.verify(f"Bearer {strict.token()}")
        assert caller.audience == AUDIENCE
        error = await rejected(verifier, issuer.token(aud="https://b.test"))
        assert "any audience issuer 'scripted' is accepted for" in error.detail
        await verifier.aclose()


@pytest.mark.asyncio
async def test_audiences_match_by_the_clients_url_rule(issuer: ScriptedIssuer) -> None:
    """The client sends its broker URL as the audience in the normal form of ``_urls``
    (``normalise_url``): a trailing slash, a default port or the case of the host does not
    make it another audience, for the configured audiences and the broker's own URL alike."""
    verifier = verifier_for(
        issuer.settings(audiences=["https://Broker.example:443/"]),
        issuer.settings(
            name="own",
            url=issuer.url + "/own",
            audiences=[],
            discovery=False,
            jwks_url=issuer.url + JWKS,
        ),
    )
    for aud in ("https://broker.example", "https://broker.example/", "HTTPS://BROKER.example:443"):
        caller, _ = await verifier.verify(f"Bearer {issuer.token(aud=aud)}")
        assert caller.audience == "https://Broker.example:443/"  # the configured spelling
    own = issuer.sign(issuer.claims(iss=issuer.url + "/own", aud=AUDIENCE + ":443/"))
    caller, _ = await verifier.verify(f"Bearer {own}")
    assert caller.audience == AUDIENCE
    for aud in ("https://broker.example:8443", "https://broker.example/x", "http://broker.example"):
        assert (await rejected(verifier, issuer.token(aud=aud))).code == "audience_mismatch"
    await verifier.aclose()


@pytest.mark.asyncio
async def test_a_verified_token_is_remembered_and_its_claims_still_checked(
    issuer: ScriptedIssuer,
) -> None:
    verifier = verifier_for(issuer.settings())
    token = issuer.token("memo", exp=_now() + 2)
    await verifier.verify(f"Bearer {token}")
    issuer.replies[JWKS] = Reply(500, {})  # a hit needs no key at all
    for _ in range(3):
        caller, _ = await verifier.verify(f"Bearer {token}")
    assert caller.subject == "memo" and len(verifier.verified) == 1
    assert issuer.hits(JWKS) == 1
    verifier.skew = 0
    await asyncio.sleep(2.1)  # the memo never outlives exp; the claim rules run on each hit
    assert (await rejected(verifier, token)).code == "token_expired"
    await verifier.aclose()


# ------------------------------------------------------------------------------ attributes


def test_attributes_per_provider() -> None:
    def issuer(provider: str, *names: str) -> ConfiguredIssuer:
        attributes = names or None  # none given: the provider's defaults
        return ConfiguredIssuer(
            IssuerSettings("x", "https://x.test", provider, attributes=attributes)
        )

    kubernetes = {
        "sub": "system:serviceaccount:team-a:agent",
        "kubernetes.io": {
            "namespace": "team-a",
            "serviceaccount": {"name": "agent", "uid": "u1"},
            "pod": {"name": "agent-0", "uid": "p1"},
            "node": {"name": "n1", "uid": "x"},
        },
    }
    assert issuer("kubernetes").attributes_from(kubernetes) == {
        "namespace": "team-a",
        "service_account": "agent",
        "pod": "agent-0",
    }
    chosen = issuer("kubernetes", "namespace", "kubernetes.io.node.name")  # exactly these
    assert chosen.attributes_from(kubernetes) == {
        "namespace": "team-a",
        "kubernetes.io.node.name": "n1",
    }
    none = ConfiguredIssuer(IssuerSettings("x", "https://x.test", "kubernetes", attributes=[]))
    assert none.attributes_from(kubernetes) == {}
    gitlab = {"project_path": "g/p", "ref_protected": "true", "user_email": "a@b", "job_id": 7}
    assert issuer("gitlab").attributes_from(gitlab) == {
        "project_path": "g/p",
        "ref_protected": "true",
        "job_id": 7,
    }
    github = {"repository": "o/r", "ref": "refs/heads/main", "run_id": "42", "sha": "abc"}
    assert issuer("github-actions").attributes_from(github) == {
        "repository": "o/r",
        "ref": "refs/heads/main",
        "run_id": "42",
    }
    google = {"email": "sa@p.iam", "email_verified": True, "azp": "123", "google": {"x": 1}}
    assert issuer("google").attributes_from(google) == {
        "email": "sa@p.iam",
        "email_verified": True,
        "azp": "123",
    }
    assert issuer("google", "email", "google").attributes_from(google) == {
        "email": "sa@p.iam",
        "google": '{"x":1}',  # a non-scalar claim kept as its JSON text
    }
    assert issuer("gitlab", "namespace").attributes_from({"namespace": "ci"}) == {
        "namespace": "ci"  # what {caller.namespace} reads for a non-Kubernetes issuer
    }
    assert issuer("buildkite").attributes_from({"organization_slug": "o"}) == {}
    assert issuer("buildkite", "organization_slug", "absent").attributes_from(
        {"organization_slug": "o"}
    ) == {"organization_slug": "o"}


@pytest.mark.asyncio
async def test_the_caller_carries_its_claims_for_policies_but_never_shows_them(
    issuer: ScriptedIssuer,
) -> None:
    verifier = verifier_for(issuer.settings(provider="gitlab"))
    caller, _ = await verifier.verify(f"Bearer {issuer.token(project_path='g/p', secret='s3')}")
    assert caller.provider == "gitlab" and caller.attributes == {"project_path": "g/p"}
    assert caller.claims["secret"] == "s3" and "s3" not in repr(caller)
    await verifier.aclose()


# ------------------------------------------------------------------------------ readiness


@pytest.mark.asyncio
async def test_load_and_readiness(issuer: ScriptedIssuer, tmp_path: Any) -> None:
    async with ScriptedIssuer(tmp_path) as down:
        down.replies[JWKS] = Reply(500, {})
        verifier = verifier_for(issuer.settings(), down.settings(name="down"))
        assert {n: s["ready"] for n, s in verifier.readiness().items()} == {
            "scripted": False,
            "down": False,
        }
        assert await verifier.load() == {"scripted": True, "down": False}
        status = verifier.readiness()
        assert status["scripted"]["ready"] and status["scripted"]["verification"] == "jwks"
        assert not status["down"]["ready"] and "answered 500" in status["down"]["last_error"]
        await verifier.aclose()


# ------------------------------------------------------------------------------ the settings


def _settings(**overrides: Any) -> IssuerSettings:
    values: dict[str, Any] = {"name": "cluster", "url": "https://k.test", "provider": "kubernetes"}
    values.update(overrides)
    return IssuerSettings(**values)


BAD_SETTINGS: dict[str, tuple[dict[str, Any], str, str]] = {
    "name": ({"name": "Team A"}, "name", "DNS-1123 label"),
    "http url": ({"url": "http://k.test"}, "url", "https:// URL"),
    "no provider": ({"provider": " "}, "provider", "must name the provider"),
    "none": ({"algorithms": ["none"]}, "algorithms", "never allowed"),
    "HS256": ({"algorithms": ["RS256", "HS256"]}, "algorithms", "never allowed"),
    "ES256K": ({"algorithms": ["ES256K"]}, "algorithms", "not supported"),
    "no algorithms": ({"algorithms": []}, "algorithms", "at least one"),
    "a string list": ({"audiences": "https://b.test"}, "audiences", "list of strings"),
    "empty audience": ({"audiences": [""]}, "audiences", "non-empty string"),
    "skew": ({"clock_skew_seconds": 3600}, "clock_skew_seconds", "between 0 and 300"),
    "cache": ({"jwks_cache_seconds": 0}, "jwks_cache_seconds", "more than 0"),
    "stale": ({"jwks_max_stale_seconds": 10}, "jwks_max_stale_seconds", "at least 300"),
    "jwks_url": ({"jwks_url": "http://k.test/keys"}, "jwks_url", "https:// URL"),
    "no source": ({"discovery": False}, "discovery", "set jwks_url"),
    "verification": ({"verification": "oidc"}, "verification", "'jwks' or 'tokenreview'"),
    "review gitlab": (
        {"verification": "tokenreview", "provider": "gitlab"},
        "verification",
        "provider = 'kubernetes'",
    ),
    "negative cache": (
        {"tokenreview_negative_cache_seconds": 30},
        "tokenreview_negative_cache_seconds",
        "between 0 and 5",
    ),
    "bytes": ({"max_document_bytes": 10}, "max_document_bytes", "at least 1024"),
    "bool seconds": ({"timeout_seconds": True}, "timeout_seconds", "number of seconds"),
}


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_settings_rules(case: str) -> None:
    overrides, field, words = BAD_SETTINGS[case]
    with pytest.raises(SettingsError) as info:
        _settings(**overrides)
    assert info.value.field == field and words in str(info.value), str(info.value)
    assert str(info.value).startswith("issuer ")


def test_settings_defaults_and_lists() -> None:
    settings = _settings(audiences=["https://b.test"], algorithms=["RS256", "ES256"])
    assert settings.audiences == ("https://b.test",) and settings.algorithms == ("RS256", "ES256")
    assert settings.keep_stale_seconds == 12 * 300
    assert settings.discovery_url == "https://k.test/.well-known/openid-configuration"
    assert _settings(jwks_max_stale_seconds=900).keep_stale_seconds == 900


def test_configured_verifier_refuses_duplicates_and_a_review_without_a_client() -> None:
    one = _settings()
    with pytest.raises(SettingsError, match="is used twice"):
        configured_verifier([one, _settings(url="https://other.test")], audience=AUDIENCE)
    with pytest.raises(SettingsError, match="is the url of issuer 'cluster' too"):
        configured_verifier([one, _settings(name="again")], audience=AUDIENCE)
    with pytest.raises(SettingsError, match="'tokenreview' needs the kubernetes backend"):
        configured_verifier([_settings(verification="tokenreview")], audience=AUDIENCE)


def test_an_ec_key_serves_only_its_own_curve() -> None:
    """An EC key of another curve is not used for ES256 (its crv must be P-256)."""
    key = SigningKey("ES384")
    jwk = key.jwk(alg=None)
    assert select_keys([jwk], ("ES256",)) == ({}, 1)
    keys, ignored = select_keys([jwk], ("ES256", "ES384"))
    assert list(keys) == [key.kid] and ignored == 0
    assert keys[key.kid].jwk_for("ES384").algorithm_name == "ES384"
