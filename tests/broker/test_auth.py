"""Every token rejection is a 401 with its code, a precise reason and never the token."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from k8s_agent_sandbox_awx.testing import LocalBroker


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _claims(broker: LocalBroker, **overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": broker.kubernetes.url,
        "sub": "system:serviceaccount:team-a:mallory",
        "aud": [broker.url],
        "iat": now,
        "nbf": now,
        "exp": now + 600,
        "jti": str(uuid.uuid4()),
        "kubernetes.io": {
            "namespace": "team-a",
            "serviceaccount": {"name": "mallory", "uid": str(uuid.uuid4())},
        },
    }
    claims.update(overrides)
    return {k: v for k, v in claims.items() if v is not None}


def _unsigned(header: dict[str, Any], payload: dict[str, Any], signature: bytes = b"") -> str:
    head = _b64(json.dumps(header).encode()) + "." + _b64(json.dumps(payload).encode())
    return head + "." + _b64(signature)


def _hs256_with_public_key(broker: LocalBroker) -> str:
    jwk = broker.kubernetes.jwks()["keys"][-1]
    public = jwt.PyJWK(jwk).key
    pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = {"alg": "HS256", "typ": "JWT", "kid": jwk["kid"]}
    head = _b64(json.dumps(header).encode()) + "." + _b64(json.dumps(_claims(broker)).encode())
    signature = hmac.new(pem, head.encode(), hashlib.sha256).digest()
    return head + "." + _b64(signature)


def _signed_by_stranger(broker: LocalBroker) -> str:
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return jwt.encode(
        _claims(broker),
        stranger,
        algorithm="RS256",
        headers={"kid": broker.kubernetes.current_kid},
    )


def _tampered(broker: LocalBroker) -> str:
    token = broker.issue_kubernetes_token("team-a", "alice")
    head, payload, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["sub"] = "system:serviceaccount:kube-system:admin"
    return f"{head}.{_b64(json.dumps(claims).encode())}.{sig}"


CASES: dict[str, tuple[Callable[[LocalBroker], str], str, str]] = {
    "bad signature (stranger's key)": (_signed_by_stranger, "bad_signature", "signature"),
    "bad signature (tampered payload)": (_tampered, "bad_signature", "signature"),
    "wrong aud": (
        lambda b: b.issue_kubernetes_token("team-a", "alice", audience="https://other.example"),
        "audience_mismatch",
        "audience",
    ),
    "expired": (
        lambda b: b.issue_kubernetes_token("team-a", "alice", ttl=-3600),
        "token_expired",
        "expired",
    ),
    "not yet valid (nbf)": (
        lambda b: b.kubernetes.sign(_claims(b, nbf=int(time.time()) + 3600)),
        "token_not_yet_valid",
        "nbf",
    ),
    "issued in the future (iat)": (
        lambda b: b.kubernetes.sign(_claims(b, iat=int(time.time()) + 3600)),
        "token_not_yet_valid",
        "iat",
    ),
    "unknown issuer": (
        lambda b: b.kubernetes.sign(_claims(b, iss="https://kubernetes.default.svc")),
        "unknown_issuer",
        "not trusted",
    ),
    "alg none": (
        lambda b: _unsigned({"alg": "none", "typ": "JWT"}, _claims(b)),
        "algorithm_not_allowed",
        "'none'",
    ),
    "HS256 signed with the public key": (
        _hs256_with_public_key,
        "algorithm_not_allowed",
        "'HS256'",
    ),
    "oversized": (
        lambda b: b.issue_kubernetes_token("team-a", "alice", claims={"pad": "x" * 20000}),
        "token_too_large",
        "limit",
    ),
    "missing sub": (
        lambda b: b.kubernetes.sign(_claims(b, sub=None)),
        "missing_claim",
        "'sub'",
    ),
    "missing exp": (
        lambda b: b.kubernetes.sign(_claims(b, exp=None)),
        "missing_claim",
        "'exp'",
    ),
    "missing aud": (
        lambda b: b.kubernetes.sign(_claims(b, aud=None)),
        "missing_claim",
        "'aud'",
    ),
    "deeply nested payload": (
        lambda b: _b64(b'{"alg":"RS256"}') + "." + _b64(b"[" * 10000) + ".c2ln",
        "token_malformed",
        "payload",
    ),
    "deeply nested header": (
        lambda b: _b64(b"[" * 10000) + "." + _b64(b"{}") + ".c2ln",
        "token_malformed",
        "header",
    ),
    "not a JWT": (lambda b: "not-a-jwt", "token_malformed", "3 dot-separated parts"),
    "garbage header": (lambda b: "e30x.e30.sig", "token_malformed", "header"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejection_has_code_reason_and_no_token(broker: LocalBroker, api: Any, case: str) -> None:
    make, code, reason = CASES[case]
    token = make(broker)
    for path in ("/v1/whoami", "/v1/sandboxes"):
        resp = api(token).http.get(path)
        assert resp.status_code == 401, resp.text
        body = resp.json()
        assert body["code"] == code
        assert reason in body["detail"]
        challenge = resp.headers["WWW-Authenticate"]
        assert challenge.startswith('Bearer error="invalid_token", error_description="')
        assert token not in resp.text
        assert token not in challenge
        assert token.split(".")[-1] not in resp.text or len(token.split(".")[-1]) < 8


def test_missing_and_non_bearer_authorization(broker: LocalBroker, api: Any) -> None:
    resp = api(None).http.get("/v1/whoami")
    assert resp.status_code == 401
    assert resp.json()["code"] == "token_missing"
    assert "WWW-Authenticate" in resp.headers
    token = broker.issue_kubernetes_token("team-a", "alice")
    basic = api(None).http.get("/v1/whoami", headers={"Authorization": f"Basic {token}"})
    assert basic.status_code == 401
    assert basic.json()["code"] == "token_malformed"
    assert token not in basic.text


def test_revoked_token(broker: LocalBroker, api: Any) -> None:
    token = broker.issue_kubernetes_token("team-a", "alice")
    assert api(token).http.get("/v1/whoami").status_code == 200
    broker.revoke_token(token)
    resp = api(token).http.get("/v1/whoami")
    assert resp.status_code == 401
    assert resp.json()["code"] == "token_revoked"
    fresh = broker.issue_kubernetes_token("team-a", "alice")
    assert api(fresh).http.get("/v1/whoami").status_code == 200


def test_healthz_needs_no_token_and_has_date(broker: LocalBroker, api: Any) -> None:
    resp = api(None).http.get("/v1/healthz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "api_version": "v1"}
    assert "Date" in resp.headers


def test_never_redirects(broker: LocalBroker, api: Any) -> None:
    token = broker.issue_kubernetes_token("team-a", "alice")
    for path in ("/v1/sandboxes/", "/v1", "/v1/whoami/"):
        resp = api(token).http.get(path)
        assert not 300 <= resp.status_code < 400, (path, resp.status_code)


def test_no_token_in_logs(broker: LocalBroker, api: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    token = broker.issue_kubernetes_token("team-a", "alice", ttl=-3600)
    api(token).http.get("/v1/whoami")
    good = broker.issue_kubernetes_token("team-a", "alice")
    client = api(good)
    sandbox = client.ready()
    client.run(sandbox, "true")
    for record in caplog.records:
        assert token not in record.getMessage()
        assert good not in record.getMessage()


def test_revoking_a_deeply_nested_token_revokes_it_by_digest(broker: LocalBroker, api: Any) -> None:
    token = _b64(b'{"alg":"RS256"}') + "." + _b64(b"[" * 10000) + ".c2ln"
    broker.revoke_token(token)  # no RecursionError: revoked by digest (there is no jti)
    resp = api(token).http.get("/v1/whoami")
    assert resp.status_code == 401
    assert resp.json()["code"] == "token_malformed"
