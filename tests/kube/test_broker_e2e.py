"""The Kubernetes-backed broker end to end on the real API server (1.20, tests/_support/kube.py)
with the stand-in agent-sandbox controller (tests/_support/controller.py): the SDK, sync and
async, in both dialects, creates a sandbox (a SandboxClaim made and stamped under the broker's
own ServiceAccount), waits for Ready, runs commands, moves files, extends the lifetime (the
claim's ``spec.lifecycle.shutdownTime``) and deletes it. The callers' tokens come from the API
server's TokenRequest; the broker verifies them through the API server's OIDC discovery and
JWKS, read with its own ServiceAccount token; its RBAC is deploy/broker/rbac.yaml's ClusterRole.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox
from tests._support._api import CLAIM, collection
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import BROKER_SA, Replica, SdkReplica, claim_of, shutdown_time

pytestmark = pytest.mark.slow

STAMP = "broker.agent-sandbox-awx.io/"


def gone(kube: KubeAPIServer, namespace: str, name: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        claim = claim_of(kube, namespace, name)
        if claim is None or claim["metadata"].get("deletionTimestamp"):
            return True
        time.sleep(0.05)
    return False


def check_claim(kube: KubeAPIServer, namespace: str, name: str, protocol: str) -> dict[str, Any]:
    """The claim the broker made: its warm pool, lifecycle, stamps, labels, its creator."""
    claim = claim_of(kube, namespace, name)
    assert claim is not None
    subject = f"system:serviceaccount:{namespace}:agent"
    meta, spec = claim["metadata"], claim["spec"]
    assert spec["warmPoolRef"] == {"name": "python"}
    assert spec["lifecycle"]["shutdownPolicy"] == "Delete"
    annotations = meta["annotations"]
    assert annotations[STAMP + "issuer"] == kube.issuer
    assert annotations[STAMP + "subject"] == subject
    assert annotations[STAMP + "provider"] == "kubernetes"
    assert annotations[STAMP + "attr.namespace"] == namespace
    owner = hashlib.sha256(f"{kube.issuer}\0{subject}".encode()).hexdigest()[:40]
    assert meta["labels"][STAMP + "owner"] == owner
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "agent-sandbox-awx-broker"
    assert name.startswith("broker-" if protocol == "rpc" else "sbx-")
    creator = meta["managedFields"][0]["manager"]
    assert creator == "agent-sandbox-awx"  # the broker's client, under its own identity
    return claim


@pytest.mark.parametrize("protocol", ["v1", "rpc"])
def test_the_sync_sdk_creates_runs_moves_files_extends_and_deletes(
    kube: KubeAPIServer,
    namespace: str,
    python_replica: SdkReplica,
    protocol: str,
) -> None:
    _, environ = python_replica(protocol)
    sandbox = Sandbox.create(environ=environ, timeout=600)
    try:
        claim = check_claim(kube, namespace, sandbox.name, protocol)
        assert 590 <= shutdown_time(claim) - time.time() <= 601
        result = sandbox.commands.run("echo from-a-claim")
        assert (result.stdout, result.exit_code) == ("from-a-claim\n", 0)
        sandbox.files.write("work/data.bin", bytes(range(256)) * 1000)
        assert sandbox.files.read("work/data.bin") == bytes(range(256)) * 1000
        assert sandbox.files.exists("work/data.bin")
        before = shutdown_time(claim_of(kube, namespace, sandbox.name) or {})
        sandbox.set_timeout(1800)
        after = shutdown_time(claim_of(kube, namespace, sandbox.name) or {})
        assert after > before + 1000 and 1790 <= after - time.time() <= 1801
    finally:
        sandbox.kill()
    assert gone(kube, namespace, sandbox.name)
    assert not sandbox.is_running()


@pytest.mark.asyncio
@pytest.mark.parametrize("protocol", ["v1", "rpc"])
async def test_the_async_sdk_does_the_same(
    kube: KubeAPIServer,
    namespace: str,
    python_replica: SdkReplica,
    protocol: str,
) -> None:
    _, environ = python_replica(protocol)
    sandbox = await AsyncSandbox.create(environ=environ, timeout=600)
    try:
        check_claim(kube, namespace, sandbox.name, protocol)
        result = await sandbox.commands.run("echo async")
        assert (result.stdout, result.exit_code) == ("async\n", 0)
        await sandbox.files.write("a.txt", b"async bytes")
        assert await sandbox.files.read("a.txt") == b"async bytes"
        await sandbox.set_timeout(900)
        claim = claim_of(kube, namespace, sandbox.name) or {}
        assert 890 <= shutdown_time(claim) - time.time() <= 901
    finally:
        await sandbox.kill()
    assert gone(kube, namespace, sandbox.name)


def test_the_broker_is_the_claims_creator_not_the_caller(
    kube: KubeAPIServer, namespace: str, identity: Any
) -> None:
    """The callers need no RBAC at all: their ServiceAccount may not even read claims."""
    kube.create_service_account(namespace, "nobody")
    token = kube.token_request(namespace, "nobody")
    with kube.client(token) as client:
        assert client.get(collection(CLAIM, namespace)).status_code == 403
    assert BROKER_SA == "sandbox-broker"


def test_rpc_a_claim_in_another_namespace_is_not_disclosed(
    kube: KubeAPIServer,
    namespace: str,
    identity: Any,
    python_pool: str,
    replica_factory: Callable[..., Replica],
) -> None:
    """Issue 23, the Kubernetes backend's half (tests/broker/test_rpc.py has the local
    backend's): a caller whose policy pins another namespace gets for someone's claim what it
    gets for a claim that does not exist: status and extend 404 with the same text, delete 204
    (and the claim stays, its deadline unmoved)."""
    import ssl

    import httpx

    elsewhere = kube.create_namespace()
    identity.bind(elsewhere)  # the broker may keep claims there (its callers' own)
    replica = replica_factory(callers=[elsewhere])
    ca = ssl.create_default_context(
        cafile=str(replica.config.server.tls_cert_file.parent / "ca.pem")
    )

    def client(ns: str) -> httpx.Client:
        kube.create_service_account(ns, "agent")
        token = kube.token_request(ns, "agent", [replica.url])
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.Client(base_url=replica.url, verify=ca, headers=headers, trust_env=False)

    with client(namespace) as owner, client(elsewhere) as intruder:
        created = owner.post("/rpc", json={"op": "create", "warmpool": python_pool})
        assert created.status_code == 200, created.text
        claim = created.json()["claim_name"]
        before = claim_of(kube, namespace, claim)
        assert before is not None
        absent = "broker-nosuchclaim"
        later = {"lifecycle": {"shutdownTime": "2099-01-01T00:00:00Z"}}
        for op, fields in (("status", {}), ("extend", later)):
            theirs = intruder.post("/rpc", json={"op": op, "claim_name": claim, **fields})
            nothing = intruder.post("/rpc", json={"op": op, "claim_name": absent, **fields})
            assert theirs.status_code == nothing.status_code == 404, theirs.text
            assert theirs.text == nothing.text.replace(absent, claim)
        deleted = intruder.post("/rpc", json={"op": "delete", "claim_name": claim})
        assert deleted.status_code == 204
        after = claim_of(kube, namespace, claim)
        assert after is not None and not after["metadata"].get("deletionTimestamp")
        assert after["spec"]["lifecycle"] == before["spec"]["lifecycle"]
        assert owner.post("/rpc", json={"op": "delete", "claim_name": claim}).status_code == 204
