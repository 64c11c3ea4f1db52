"""Hostile time claims against the real kube-apiserver: in TokenReview mode the claim rules run
on the token as sent, before the API server reviews it, so an anonymous caller's made-up token
with a time claim that is no date reached them and crashed the request (500). Every hostile
value is ``401 token_malformed``, through the verifier with the real API server as reviewer and
through a replica's whoami, creates and data plane; a value that is a date is reviewed, and the
API server, which never issued the token, refuses it."""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.broker.backends.kubernetes._api import KubeClient
from k8s_agent_sandbox_awx.broker.identity._configured import configured_verifier
from k8s_agent_sandbox_awx.broker.identity._rejection import TokenRejected
from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings
from tests._support import hostile_claims
from tests._support.broker_server import Pki
from tests._support.hostile_claims import CASES, TIME_CLAIMS
from tests._support.kube import KubeAPIServer, free_ports
from tests._support.kube_broker import BROKER_SA, BrokerIdentity, Replica, write_config
from tests.kube.test_identity_cluster import reviewer

__all__ = ["reviewer"]  # the fixture: the broker's API client, allowed to create TokenReviews

pytestmark = pytest.mark.slow

AUDIENCE = "https://broker.test"
GRID = [(claim, case) for claim in TIME_CLAIMS for case in CASES]


def payload(kube: KubeAPIServer, namespace: str, audience: str) -> dict[str, Any]:
    now = int(time.time())
    return {
        "iss": kube.issuer, "sub": f"system:serviceaccount:{namespace}:agent", "aud": [audience],
        "iat": now, "nbf": now, "exp": now + 600,
        "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": "agent"}},
    }  # fmt: skip


@pytest.mark.asyncio
async def test_hostile_time_claims_never_reach_the_api_server(
    kube: KubeAPIServer, namespace: str, reviewer: KubeClient
) -> None:
    settings = IssuerSettings(
        name="cluster", url=kube.issuer, provider="kubernetes", audiences=(AUDIENCE,),
        verification="tokenreview",
    )  # fmt: skip
    verifier = configured_verifier([settings], audience=AUDIENCE, reviewer=reviewer)
    deadline = time.monotonic() + 20  # RBAC reaches the authorizer through an informer
    while not (await verifier.load())["cluster"]:
        assert time.monotonic() < deadline, verifier.readiness()
        await asyncio.sleep(0.1)
    kube.create_service_account(namespace, "agent")
    real = kube.token_request(namespace, "agent", AUDIENCE, 600)
    assert (await verifier.verify(f"Bearer {real}"))[0].attributes["namespace"] == namespace
    claims = payload(kube, namespace, AUDIENCE)
    got = {}
    for claim, case in GRID:
        token = hostile_claims.unsigned(claims, claim, hostile_claims.literal(case, claim))
        with pytest.raises(TokenRejected) as info:
            await verifier.verify(f"Bearer {token}")
        got[claim, case] = info.value.code
    want = {(c, k): "bad_signature" if CASES[k][1] else "token_malformed" for c, k in GRID}
    assert got == want  # a date is reviewed: the API server never issued that token
    await verifier.aclose()


@pytest.fixture
def reviewing_replica(
    identity: BrokerIdentity, broker_pki: Pki, tmp_path: Path, namespace: str
) -> Iterator[Replica]:
    """A replica whose issuer is verified by TokenReview (its ServiceAccount may create them)."""
    identity.kube.bind_role((namespace, BROKER_SA), "system:auth-delegator")
    [port] = free_ports(1)
    path = write_config(tmp_path / "broker.toml", identity, broker_pki, port)
    keys = r"(?m)^(ca_file|token_file|jwks_min_refetch_seconds) = .*\n"  # jwks only
    text = re.sub(keys, "", path.read_text(), count=3)
    kind = 'provider = "kubernetes"\n'
    path.write_text(text.replace(kind, kind + 'verification = "tokenreview"\n', 1))
    replica = Replica(path)
    try:
        yield replica.start(timeout=60)
    finally:
        replica.stop()


def test_a_tokenreview_replica_answers_hostile_time_claims_401(
    kube: KubeAPIServer, namespace: str, reviewing_replica: Replica
) -> None:
    replica = reviewing_replica
    assert replica.config.issuers[0].verification == "tokenreview"
    ca_file = replica.config.server.tls_cert_file.parent / "ca.pem"
    ca = ssl.create_default_context(cafile=str(ca_file))
    claims = payload(kube, namespace, replica.url)
    data = {"X-Sandbox-ID": "sbx-any", "X-Sandbox-Namespace": namespace}
    got = {}
    with httpx.Client(base_url=replica.url, verify=ca, timeout=30) as http:
        for claim in TIME_CLAIMS:
            for case in (c for c in CASES if not CASES[c][1]):
                token = hostile_claims.unsigned(claims, claim, hostile_claims.literal(case, claim))
                auth = {"Authorization": f"Bearer {token}"}
                answers = {
                    "whoami": http.get("/v1/whoami", headers=auth),
                    "create": http.post("/v1/sandboxes", json={}, headers=auth),
                    "rpc create": http.post("/rpc", json={"op": "create"}, headers=auth),
                    "data plane": http.get("/commands", headers={**auth, **data}),
                }
                for route, answer in answers.items():
                    code = answer.headers.get("agent-sandbox-broker-error")
                    if route == "rpc create":  # plain text: its reason names the rule
                        words = ("NumericDate", "not JSON")
                        code = "token_malformed" if any(w in answer.text for w in words) else None
                    got[claim, case, route] = (answer.status_code, code)
    assert got == {key: (401, "token_malformed") for key in got}
