"""A service-account key rotation on the cluster's issuer, through the Kubernetes-backed broker.

The API server restarts with a new signing key and both public keys published
(``KubeAPIServer.rotate_signing_key``). The broker, which verifies the callers' tokens through
the API server's OIDC discovery and JWKS: keeps verifying tokens of the old key (still
published); on the first token of the new key (a ``kid`` it has not seen) fetches the keys
again, once, and verifies it; answers a further unknown ``kid`` within
``jwks_min_refetch_seconds`` with a typed 401 without fetching (rate-limited). A sandbox made
before the rotation is used after it with a new-key token: nothing lost, nothing duplicated.
"""

from __future__ import annotations

import time
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from k8s_agent_sandbox_awx import BrokerAuthenticationError, OIDCTokenAuth, Sandbox
from tests._support._api import CLAIM, collection
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import Replica, SdkReplica

pytestmark = pytest.mark.slow  # restarts the session's API server (~5 s)


def kid_of(token: str) -> str:
    return str(jwt.get_unverified_header(token)["kid"])


def published_kids(kube: KubeAPIServer) -> set[str]:
    return {key["kid"] for key in kube.get("/openid/v1/jwks")["keys"]}


def forged(token: str) -> str:
    """``token``'s claims signed by a key the issuer never had, under a kid it never used."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    claims = jwt.decode(token, options={"verify_signature": False})
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": "never-published"})


def counters(replica: Replica) -> dict[str, Any]:
    return replica.on_loop(lambda: replica.broker.verifier.counters()["cluster"])


def test_a_key_rotation_loses_nothing_and_refetches_once(
    kube: KubeAPIServer,
    namespace: str,
    python_replica: SdkReplica,
) -> None:
    replica, environ = python_replica(jwks_min_refetch_seconds=30)
    old_token = kube.token_request(namespace, "agent", replica.url)
    unused_old_token = kube.token_request(namespace, "agent", replica.url)  # verified after only
    old_kid = kid_of(old_token)
    sandbox = Sandbox.create(environ=environ, auth=OIDCTokenAuth(old_token))
    try:
        sandbox.files.write("before.txt", b"made before the rotation")
        before = counters(replica)

        kube.rotate_signing_key()
        new_token = kube.token_request(namespace, "agent", replica.url)
        assert kid_of(new_token) != old_kid
        assert published_kids(kube) == {old_kid, kid_of(new_token)}
        replica.wait_ready()

        # the first new-key token: an unknown kid, one refetch, verified
        after_rotation = Sandbox.connect(
            sandbox.name, environ=environ, auth=OIDCTokenAuth(new_token)
        )
        assert after_rotation.files.read("before.txt") == b"made before the rotation"
        assert after_rotation.commands.run("echo after").stdout == "after\n"
        refetched = counters(replica)
        assert refetched["kid_refetches"] == before["kid_refetches"] + 1
        assert refetched["refreshes"] == before["refreshes"] + 1

        # an old-key token never seen before verifies against the refetched keys (both there)
        old_again = Sandbox.connect(
            sandbox.name, environ=environ, auth=OIDCTokenAuth(unused_old_token)
        )
        assert old_again.commands.run("echo old key").stdout == "old key\n"

        # another unknown kid within the interval: refused, typed, and no fetch
        with pytest.raises(BrokerAuthenticationError) as refused:
            Sandbox.connect(sandbox.name, environ=environ, auth=OIDCTokenAuth(forged(new_token)))
        assert refused.value.status_code == 401
        assert "never-published" in str(refused.value) and new_token not in str(refused.value)
        limited = counters(replica)
        assert limited["kid_refetches"] == refetched["kid_refetches"]
        assert limited["refreshes"] == refetched["refreshes"]
        # twice: the client retries a 401 once with a fresh credential (the same token here)
        assert limited["rate_limited"] == refetched["rate_limited"] + 2

        # nothing duplicated: the one claim, still the caller's
        claims = kube.get(collection(CLAIM, namespace))["items"]
        assert [c["metadata"]["name"] for c in claims] == [sandbox.name]
        assert [s.name for s in Sandbox.list(environ=environ, auth=OIDCTokenAuth(new_token))] == [
            sandbox.name
        ]
    finally:
        Sandbox.connect(
            sandbox.name, environ=environ, auth=OIDCTokenAuth(kube.token_request(
                namespace, "agent", replica.url))
        ).kill()  # fmt: skip
    deadline = time.monotonic() + 20
    while kube.get(collection(CLAIM, namespace))["items"]:
        assert time.monotonic() < deadline, "the claim was not deleted"
        time.sleep(0.05)
