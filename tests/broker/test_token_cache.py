"""The broker's verified-token cache: a token already seen costs no RSA work, every rule stays.

RSA signature checks are counted by wrapping PyJWT's ``RSAAlgorithm.verify`` (the broker runs in
a thread of this process, so the wrapper sees its checks).
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from typing import Any

import jwt
import pytest
from jwt.algorithms import RSAAlgorithm

from k8s_agent_sandbox_awx.broker.identity._verify import VerifiedTokens
from k8s_agent_sandbox_awx.testing import LocalBroker


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0


@pytest.fixture
def rsa_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Counter]:
    counter = _Counter()
    real = RSAAlgorithm.verify

    def counting(self: RSAAlgorithm, msg: bytes, key: Any, sig: bytes) -> bool:
        with counter.lock:
            counter.count += 1
        return real(self, msg, key, sig)

    monkeypatch.setattr(RSAAlgorithm, "verify", counting)
    yield counter


def _whoami(api: Any, token: str) -> Any:
    return api(token).http.get("/v1/whoami")


def test_a_seen_token_is_verified_once(broker: LocalBroker, api: Any, rsa_checks: _Counter) -> None:
    token = broker.issue_kubernetes_token("team-a", "alice")
    client = api(token)
    for _ in range(5):
        resp = client.http.get("/v1/whoami")
        assert resp.status_code == 200, resp.text
    assert rsa_checks.count == 1
    other = broker.issue_kubernetes_token("team-a", "alice")  # another jti: another token
    assert _whoami(api, other).status_code == 200
    assert _whoami(api, other).status_code == 200
    assert rsa_checks.count == 2


def test_same_claims_other_token_string_is_verified_anew(
    broker: LocalBroker, api: Any, rsa_checks: _Counter
) -> None:
    token = broker.issue_kubernetes_token("team-a", "alice")
    assert _whoami(api, token).status_code == 200
    claims = jwt.decode(token, options={"verify_signature": False})
    # the same claims under another header: another string, so verified on its own
    resigned = broker.kubernetes.sign(claims, headers={"x-bench": "1"})
    assert resigned != token
    assert _whoami(api, resigned).status_code == 200
    assert rsa_checks.count == 2
    # the cached token's header and claims with a forged signature: refused, not a cache hit
    head, payload, _ = token.split(".")
    forged_sig = base64.urlsafe_b64encode(b"\x00" * 256).rstrip(b"=").decode()
    forged = f"{head}.{payload}.{forged_sig}"
    resp = _whoami(api, forged)
    assert resp.status_code == 401
    assert resp.json()["code"] == "bad_signature"
    assert rsa_checks.count == 3
    assert _whoami(api, token).status_code == 200  # the genuine one is still a hit
    assert rsa_checks.count == 3


def test_a_revoked_cached_token_is_refused(
    broker: LocalBroker, api: Any, rsa_checks: _Counter
) -> None:
    token = broker.issue_kubernetes_token("team-a", "alice")
    client = api(token)
    assert client.http.get("/v1/whoami").status_code == 200
    assert client.http.get("/v1/whoami").status_code == 200
    assert rsa_checks.count == 1  # cached
    broker.revoke_token(token)
    resp = client.http.get("/v1/whoami")
    assert resp.status_code == 401
    assert resp.json()["code"] == "token_revoked"


def test_the_cache_never_outlives_exp(broker: LocalBroker, api: Any, rsa_checks: _Counter) -> None:
    # the broker allows 30 s of clock skew after exp: past exp the token is still accepted, but
    # only after a full verification again
    # 3 s, not 1: exp is in whole seconds, and on a busy machine (xdist workers) the two
    # requests before it could otherwise straddle it
    token = broker.issue_kubernetes_token("team-a", "alice", ttl=3)
    exp = jwt.decode(token, options={"verify_signature": False})["exp"]
    client = api(token)
    assert client.http.get("/v1/whoami").status_code == 200
    assert client.http.get("/v1/whoami").status_code == 200
    assert rsa_checks.count == 1
    time.sleep(max(0.0, exp - time.time()) + 0.2)
    assert client.http.get("/v1/whoami").status_code == 200
    assert rsa_checks.count == 2
    assert client.http.get("/v1/whoami").status_code == 200
    assert rsa_checks.count == 3  # past exp it is never cached again


def test_a_retired_key_drops_the_cached_tokens(
    broker: LocalBroker, api: Any, rsa_checks: _Counter
) -> None:
    token = broker.issue_kubernetes_token("team-a", "alice")
    assert _whoami(api, token).status_code == 200
    broker.rotate_keys("kubernetes", retire_old=True)
    time.sleep(0.05)  # the JWKS and the verified tokens are dropped on the broker's loop
    resp = _whoami(api, token)
    assert resp.status_code == 401
    assert resp.json()["code"] == "bad_signature"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_verified_tokens_unit_bounds() -> None:
    clock = _Clock()
    cache: VerifiedTokens[str] = VerifiedTokens(max_entries=3, max_age=300.0, clock=clock)
    cache.put("token-a", "claims-a", issuer_url="iss-1", exp=1010.0)
    assert cache.get("token-a") == "claims-a"
    assert cache.get("token-a-but-different") is None
    assert all("token-a" not in repr(k) for k in cache._entries)  # only the digest is kept
    clock.now = 1010.0  # at exp: gone
    assert cache.get("token-a") is None
    # bounded by max_age (the JWKS cache time) too
    cache.put("token-b", "claims-b", issuer_url="iss-1", exp=5000.0)
    clock.now = 1010.0 + 300.0
    assert cache.get("token-b") is None
    # an already-expired token is never stored
    cache.put("token-c", "claims-c", issuer_url="iss-1", exp=clock.now)
    assert cache.get("token-c") is None
    # bounded size: the least recently used goes first
    for name in ("t1", "t2", "t3"):
        cache.put(name, name, issuer_url="iss-1", exp=clock.now + 60)
    assert cache.get("t1") == "t1"
    cache.put("t4", "t4", issuer_url="iss-2", exp=clock.now + 60)
    assert len(cache) == 3
    assert cache.get("t2") is None
    assert cache.get("t1") == "t1"
    # forgetting an issuer drops its tokens only
    cache.forget_issuer("iss-1")
    assert cache.get("t1") is None and cache.get("t3") is None
    assert cache.get("t4") == "t4"


def test_verified_tokens_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        VerifiedTokens(max_entries=0)
