"""The walls between tenants of the Kubernetes backend: another identity (bob, another
ServiceAccount of the same namespace) against alice's claim, on the real API server with the
stand-in controller, over raw HTTPS to the broker: reads, deletes, lifetime moves and /rpc
operations on it are refused and change nothing; the data plane with her names is refused."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from k8s_agent_sandbox_awx import Sandbox
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import Replica, claim_of, sdk_environ, shutdown_time

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("protocol", ["v1", "rpc"])
def test_another_identity_cannot_touch_a_claim(
    protocol: str,
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
    tmp_path: Path,
) -> None:
    replica = replica_factory()
    environ = sdk_environ(
        kube, namespace, replica, tmp_path / "alice", service_account="alice", protocol=protocol
    )
    sdk_environ(kube, namespace, replica, tmp_path / "bob", service_account="bob")
    bob_token = (tmp_path / "bob").read_text()
    verify = ssl.create_default_context(cafile=environ["AGENT_SANDBOX_CA_BUNDLE"])
    sandbox = Sandbox.create(environ=environ, timeout=600)
    bob = httpx.Client(
        base_url=replica.url, verify=verify, headers={"Authorization": f"Bearer {bob_token}"}
    )
    try:
        name = sandbox.name
        claim = getattr(sandbox, "claim_name", None) or name
        before = claim_of(kube, namespace, claim)
        assert before is not None
        assert bob.get(f"/v1/sandboxes/{name}").status_code == 404
        assert bob.delete(f"/v1/sandboxes/{name}").status_code == 404
        put = bob.put(f"/v1/sandboxes/{name}/lifetime", json={"seconds": 5})
        assert put.status_code == 404, put.text
        lifecycle = {"shutdownTime": "2099-01-01T00:00:00Z", "shutdownPolicy": "Delete"}
        for op in (
            {"op": "status", "claim_name": claim},
            {"op": "delete", "claim_name": claim},
            {"op": "extend", "claim_name": claim, "lifecycle": lifecycle},
        ):
            answer = bob.post("/rpc", json=op)
            # a delete of a claim that is not the caller's /rpc claim is "already gone" (204)
            allowed = (204, 403, 404) if op["op"] == "delete" else (403, 404)
            assert answer.status_code in allowed, (op, answer.status_code, answer.text)
        for headers in (
            {"X-Sandbox-ID": name, "X-Sandbox-Namespace": namespace},
            {"X-Sandbox-ID": name, "X-Sandbox-Namespace": namespace, "X-Sandbox-Port": "3000"},
            {"X-Sandbox-ID": name, "X-Sandbox-Namespace": namespace, "X-Sandbox-Claim-Name": claim},
        ):
            answer = bob.get("/", headers=headers)
            assert answer.status_code in (403, 404), (headers, answer.text)
        time.sleep(0.2)
        after = claim_of(kube, namespace, claim)
        assert after is not None and not after["metadata"].get("deletionTimestamp")
        assert shutdown_time(after) == shutdown_time(before)
        assert sandbox.commands.run("echo still-mine").stdout == "still-mine\n"
    finally:
        bob.close()
        sandbox.kill()


def test_a_delete_acts_on_the_claim_the_broker_checked(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
    tmp_path: Path,
) -> None:
    """The owner check and the delete meet on one claim (its uid): a claim of that name that is
    not the one checked (another uid) is left alone, not deleted under the old check."""
    replica = replica_factory()
    environ = sdk_environ(kube, namespace, replica, tmp_path / "alice", service_account="alice")
    with Sandbox.create(environ=environ, timeout=600) as sandbox:
        claim = claim_of(kube, namespace, sandbox.name)
        assert claim is not None
        uid = claim["metadata"]["uid"]
        other = replica.call(
            replica.backend.delete(sandbox.name, namespace=namespace, uid=f"{uid[:-1]}x")
        )
        assert other is None
        after = claim_of(kube, namespace, sandbox.name)
        assert after is not None and not after["metadata"].get("deletionTimestamp")
        same = replica.call(replica.backend.delete(sandbox.name, namespace=namespace, uid=uid))
        assert same is not None
