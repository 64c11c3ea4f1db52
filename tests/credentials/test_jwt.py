"""Client-side token checks: JWT detection, decoding, audience pinning, expiry, cache lifetime."""

from __future__ import annotations

import base64
import json

import pytest

from k8s_agent_sandbox_awx import (
    AudienceMismatchError,
    Credential,
    EmptyCredentialError,
    MalformedTokenError,
    TokenExpiredError,
)
from k8s_agent_sandbox_awx.credentials._jwt import (
    CLOCK_SKEW_SECONDS,
    DEFAULT_TTL_SECONDS,
    _decode_cached,
    cache_deadline,
    check_credential,
    check_token_text,
    decode_token,
    looks_like_jwt,
    normalise_url,
    redact,
)

BROKER = "https://sandbox-broker.example"
T0 = 1_900_000_000.0


def _seg(obj: object) -> str:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _cred(token: str) -> Credential:
    return Credential(token, "test-provider", source="unit test")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("https://sandbox-broker.example", "https://sandbox-broker.example/"),
        ("https://Sandbox-Broker.EXAMPLE", "https://sandbox-broker.example"),
        ("HTTPS://sandbox-broker.example:443", "https://sandbox-broker.example"),
        ("http://b.example:80/", "http://b.example"),
        ("https://b.example:8443/", "https://b.example:8443"),
        ("https://b.example/prefix/", "https://b.example/prefix"),
        ("https://[::1]:443", "https://[::1]"),
        ("sandbox-broker", "sandbox-broker/"),
    ],
)
def test_normalise_url_equal(a: str, b: str) -> None:
    assert normalise_url(a) == normalise_url(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("https://b.example", "http://b.example"),
        ("https://b.example", "https://b.example:8443"),
        ("https://b.example/Prefix", "https://b.example/prefix"),
        ("https://b.example", "https://b.example.evil"),
        ("https://b.example:80", "https://b.example"),
    ],
)
def test_normalise_url_different(a: str, b: str) -> None:
    assert normalise_url(a) != normalise_url(b)


def test_looks_like_jwt(mint) -> None:
    assert looks_like_jwt(mint())
    assert not looks_like_jwt("opaque-token-value")
    assert not looks_like_jwt("a.b.c")  # three parts but no JSON header
    assert not looks_like_jwt("eyJ.a.b.c.d")  # five parts (a JWE) is opaque


def test_opaque_token_passes_through_unchecked() -> None:
    cred = _cred("ghs_opaqueTokenValue123")
    assert check_credential(cred, BROKER, T0) is None
    assert cache_deadline(None, T0) == T0 + DEFAULT_TTL_SECONDS


def test_decode_header_and_payload(mint) -> None:
    token = mint(aud=[BROKER, "other"], kid="k1")
    decoded = decode_token(token)
    assert decoded is not None
    assert decoded.header["alg"] == "HS256"
    assert decoded.payload["aud"] == [BROKER, "other"]
    assert decoded.audiences == (BROKER, "other")
    assert decoded.exp == T0 + 3600
    claims = decoded.claims()
    assert set(claims) == {"header", "payload"}


@pytest.mark.parametrize(
    ("token", "why"),
    [
        (f"{_seg({'alg': 'none'})}.!!!.sig", "payload is not base64url"),
        (f"{_seg({'alg': 'none'})}.{_seg(b'not json')}.sig", "payload is not UTF-8 JSON"),
        (f"{_seg({'alg': 'none'})}.{_seg([1, 2])}.sig", "payload is JSON but not an object"),
        (f"eyJub3Rqc29u.{_seg({'aud': BROKER})}.sig", "header"),
        (f"{_seg({'alg': 'x'})}.{_seg({'aud': 5})}.sig", "'aud' claim"),
        (f"{_seg({'alg': 'x'})}.{_seg({'aud': [BROKER, 1]})}.sig", "'aud' claim"),
        (f"{_seg({'alg': 'x'})}.{_seg({'aud': BROKER, 'exp': 'soon'})}.sig", "'exp' claim"),
        (f"{_seg({'alg': 'x'})}.{_seg({'aud': BROKER, 'exp': True})}.sig", "'exp' claim"),
        (f"{_seg({'alg': 'x'})}.a.", "payload"),
    ],
)
def test_jwt_lookalike_that_does_not_decode_is_malformed(token: str, why: str) -> None:
    with pytest.raises(MalformedTokenError, match=why) as info:
        check_credential(_cred(token), BROKER, T0)
    assert token not in str(info.value)
    assert info.value.provider == "test-provider"


def test_aud_string_and_list(mint) -> None:
    check_credential(_cred(mint(aud=BROKER)), BROKER, T0)
    check_credential(_cred(mint(aud=["https://other.example", BROKER])), BROKER, T0)
    check_credential(_cred(mint(aud=BROKER + "/")), "https://SANDBOX-broker.example:443", T0)


@pytest.mark.parametrize(
    "aud",
    [
        "https://other.example",
        ["https://kubernetes.default.svc.cluster.local", "k3s"],
        "http://sandbox-broker.example",
        "https://sandbox-broker.example.attacker.example",
        None,
    ],
)
def test_audience_mismatch_is_refused(mint, no_secret, aud) -> None:
    token = mint(aud=aud)
    with pytest.raises(AudienceMismatchError) as info:
        check_credential(_cred(token), BROKER, T0)
    message = str(info.value)
    assert BROKER in message
    assert "audience" in message
    no_secret(token, message, repr(info.value))


def test_expired_token_is_refused_after_the_skew(mint, no_secret) -> None:
    token = mint(now=T0 - 3600, ttl=3600)  # exp == T0
    check_credential(_cred(token), BROKER, T0 + CLOCK_SKEW_SECONDS)  # within the skew
    with pytest.raises(TokenExpiredError, match="expired at 2030-") as info:
        check_credential(_cred(token), BROKER, T0 + CLOCK_SKEW_SECONDS + 1)
    no_secret(token, str(info.value))


def test_token_without_exp_is_accepted_with_default_ttl(mint) -> None:
    decoded = check_credential(_cred(mint(ttl=None)), BROKER, T0)
    assert decoded is not None and decoded.exp is None
    assert cache_deadline(decoded, T0) == T0 + DEFAULT_TTL_SECONDS


@pytest.mark.parametrize(
    ("ttl", "elapsed", "margin"),
    [
        (3600, 0, 60),  # long-lived: 60 s margin
        (300, 0, 30),  # 5 minutes (GitHub Actions): 10 % = 30 s
        (300, 200, 30),  # the margin is 10 % of the lifetime, not of what remains
        (10, 0, 1),
    ],
)
def test_cache_deadline_is_exp_minus_margin(mint, ttl, elapsed, margin) -> None:
    decoded = decode_token(mint(now=T0, ttl=ttl))
    deadline = cache_deadline(decoded, T0 + elapsed)
    assert deadline == pytest.approx(T0 + ttl - margin)
    assert deadline <= T0 + ttl


def test_cache_deadline_without_iat_uses_remaining_lifetime(mint) -> None:
    decoded = decode_token(mint(now=T0, ttl=100, iat=None))
    assert cache_deadline(decoded, T0) == pytest.approx(T0 + 90)


def test_decoded_claims_are_memoised_per_token_string(mint) -> None:
    token = mint()
    _decode_cached.cache_clear()
    for _ in range(5):
        check_credential(_cred("".join(list(token))), BROKER, T0)  # equal but new strings
    info = _decode_cached.cache_info()
    assert (info.misses, info.hits) == (1, 4)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", EmptyCredentialError),
        ("  \n", EmptyCredentialError),
        ("abc def", MalformedTokenError),
        ("abc\r\nX-Injected: 1", MalformedTokenError),
        ("tökén", MalformedTokenError),
        ("x" * (64 * 1024 + 1), MalformedTokenError),
    ],
)
def test_token_text_rules(text: str, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        check_token_text(text, provider="p", source="s")
    if text.strip():
        assert text.strip() not in str(info.value)


def test_token_text_is_stripped(mint) -> None:
    token = mint()
    assert check_token_text(f"  {token}\n", provider="p", source="s") == token


def test_redact_removes_jwts_and_named_secrets(mint) -> None:
    token = mint()
    text = f"bad token {token} and secret-value-123 here"
    out = redact(text, ["secret-value-123"])
    assert token not in out and "secret-value-123" not in out
    assert "bad token" in out
