"""The Kubernetes-backed broker when the cluster misbehaves, and its edges end to end: a wait
for Ready survives an API server restart and a watch that expires (410); the claim's terminal
reasons reach the SDK as its typed errors; a claim that adopts a warm pool's Sandbox (another
name) is reached through the pod and the router data planes; a broker whose RBAC lacks a verb
is not ready and names the verb, and becomes ready once it is granted.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.errors import (
    BrokerWarmPoolNotFoundError,
    PortNotListeningError,
    SandboxFailedError,
)
from tests._support._api import CLAIM, collection
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import BrokerIdentity, Replica, SdkReplica, StandInRouter, claims_in

pytestmark = pytest.mark.slow


def the_claim(kube: KubeAPIServer, namespace: str, timeout: float = 30) -> dict[str, Any]:
    """The namespace's one claim, once it exists."""
    deadline = time.monotonic() + timeout
    while not (found := claims_in(kube, namespace, deleting=True)):
        assert time.monotonic() < deadline, "no claim was made"
        time.sleep(0.05)
    [claim] = found
    return claim


@contextmanager
def creating(environ: dict[str, str], **options: Any) -> Iterator[concurrent.futures.Future[Any]]:
    """``Sandbox.create`` on another thread; its future."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool.submit(Sandbox.create, environ=environ, **options)


def relists(replica: Replica) -> int:
    return replica.on_loop(lambda: replica.backend.cache.relists)


# ------------------------------------------------------------------------------ waits


def test_a_wait_for_ready_survives_an_api_server_restart(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_replica: SdkReplica,
) -> None:
    """The claim is made, the controller has not acted yet, the API server restarts while
    the SDK's create waits: the broker's claim watch resumes (nothing changed meanwhile, so
    from its last version: no 410, see the next test for that), the wait goes on, and once
    the controller acts the create returns the one sandbox, usable."""
    _, environ = python_replica()
    controller.pause()
    with creating(environ, timeout=600, ready_timeout=40) as made:
        claim = the_claim(kube, namespace)
        kube.restart()
        assert not made.done()
        controller.resume()
        sandbox = made.result(60)
    try:
        assert sandbox.name == claim["metadata"]["name"]
        assert sandbox.commands.run("echo after-restart").stdout == "after-restart\n"
        assert [c["metadata"]["uid"] for c in claims_in(kube, namespace, deleting=True)] == [
            claim["metadata"]["uid"]
        ]
    finally:
        sandbox.kill()


@pytest.mark.parametrize("protocol", ["v1", "rpc"])
def test_a_wait_for_ready_survives_an_expired_watch(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_replica: SdkReplica,
    protocol: str,
) -> None:
    """The claims' watch resumes from a version the API server no longer has (410) during
    the wait: the cache lists again and the wait sees the claim become Ready."""
    replica, environ = python_replica(protocol)
    controller.pause()
    with creating(environ, timeout=600, ready_timeout=40) as made:
        the_claim(kube, namespace)
        before = relists(replica)
        replica.on_loop(replica.backend.cache.expire)
        deadline = time.monotonic() + 30
        while relists(replica) == before:
            assert time.monotonic() < deadline, "the claim cache did not list again"
            time.sleep(0.05)
        controller.resume()
        sandbox = made.result(60)
    try:
        assert sandbox.commands.run("echo resumed").stdout == "resumed\n"
        assert len(claims_in(kube, namespace, deleting=True)) == 1
    finally:
        sandbox.kill()


# ------------------------------------------------------------------------------ terminal reasons


@pytest.mark.parametrize("protocol", ["v1", "rpc"])
def test_a_missing_warm_pool_is_the_sdks_warm_pool_not_found_error(
    kube: KubeAPIServer,
    namespace: str,
    python_replica: SdkReplica,
    protocol: str,
) -> None:
    """The policy allows pool ``nowhere``, which does not exist: the controller's
    WarmPoolNotFound reaches the SDK as BrokerWarmPoolNotFoundError; the claim is deleted."""
    _, environ = python_replica(protocol, pools=("python", "nowhere"))
    with pytest.raises(BrokerWarmPoolNotFoundError) as raised:
        Sandbox.create("nowhere", environ=environ, timeout=600, ready_timeout=60)
    assert raised.value.reason == "WarmPoolNotFound"
    assert "nowhere" in str(raised.value)
    deadline = time.monotonic() + 20
    while claims_in(kube, namespace):  # not being deleted yet
        assert time.monotonic() < deadline, "the failed claim was not deleted"
        time.sleep(0.05)


@pytest.mark.parametrize("protocol", ["v1", "rpc"])
def test_a_terminal_reason_is_the_sdks_failed_error_with_the_reason(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_replica: SdkReplica,
    protocol: str,
) -> None:
    _, environ = python_replica(protocol)
    controller.pause()
    with creating(environ, timeout=600, ready_timeout=60) as made:
        name = the_claim(kube, namespace)["metadata"]["name"]
        controller.inject_claim_error(
            namespace, name, "VolumeClaimTemplatesError", "volume claim template data is bad"
        )
        controller.resume()
        with pytest.raises(SandboxFailedError) as raised:
            made.result(60)
    assert not isinstance(raised.value, BrokerWarmPoolNotFoundError)
    assert raised.value.reason == "VolumeClaimTemplatesError"
    assert "volume claim template data is bad" in f"{raised.value} {raised.value.detail}"


# ------------------------------------------------------------------------------ warm adoption


@pytest.mark.parametrize("protocol", ["v1", "rpc"])
def test_a_claim_that_adopts_a_warm_sandbox_reaches_its_pod(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    sdk_replica: SdkReplica,
    protocol: str,
) -> None:
    """A warm pool of one Ready Sandbox: the claim is bound to it (its own name, not the
    claim's), and the data plane reaches that Sandbox's pod (a file written through the
    broker is in that pod's runtime)."""
    controller.create_template(namespace, "python")
    controller.create_warm_pool(namespace, "python", "python", replicas=1)
    _, environ = sdk_replica(protocol)
    sandbox = Sandbox.create(environ=environ, timeout=600)
    try:
        claim = kube.get(collection(CLAIM, namespace) + "/" + claim_name_of(sandbox))
        adopted = claim["status"]["sandbox"]["name"]
        assert adopted.startswith("python-") and adopted != claim["metadata"]["name"]
        sandbox.files.write("marker.txt", b"in the adopted pod")
        with httpx_client() as client:
            direct = client.get(controller.pod_url(namespace, adopted) + "/download/marker.txt")
        assert direct.content == b"in the adopted pod"
    finally:
        sandbox.kill()


def test_the_router_data_plane_reaches_an_adopted_sandbox_with_the_brokers_token(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    sdk_replica: SdkReplica,
    tmp_path: Path,
) -> None:
    """``data_plane = "router"``: the broker sends upstream's headers (X-Sandbox-ID = the
    adopted Sandbox's name, X-Sandbox-Pod-IP = its pod's IP: the template has no Service, so
    upstream's router could not resolve the name, issue 28) and its own router token, re-read
    when the file changes; the caller's token never reaches the router."""
    controller.create_template(namespace, "python")
    controller.create_warm_pool(namespace, "python", "python", replicas=1)
    router_token = tmp_path / "router-token"
    router_token.write_text("router-secret-1\n")
    with StandInRouter(controller, router_token, allow_loopback_pod_ip=True) as router:
        _, environ = sdk_replica(router=(router.url, router_token))
        caller_token = (tmp_path / "token").read_text().strip()
        sandbox = Sandbox.create(environ=environ, timeout=600)
        try:
            assert sandbox.commands.run("echo via-router").stdout == "via-router\n"
            claim = kube.get(collection(CLAIM, namespace) + "/" + sandbox.name)
            adopted = claim["status"]["sandbox"]["name"]
            assert adopted != sandbox.name
            assert {h["x-sandbox-id"] for h in router.seen} == {adopted}
            assert {h["x-sandbox-namespace"] for h in router.seen} == {namespace}
            assert {h["x-sandbox-port"] for h in router.seen} == {"8888"}
            pod_ip = controller.pod_address(namespace, adopted)[0]
            assert {h["x-sandbox-pod-ip"] for h in router.seen} == {pod_ip}
            assert set(router.resolved) == {"pod-ip"}
            router_token.write_text("router-secret-2\n")  # rotated
            assert sandbox.files.exists("nothing-here") is False
            # upstream's router answers 502 "Could not connect" for a port that refuses
            with sandbox.ports.client(3999) as port, pytest.raises(PortNotListeningError) as e:
                port.get("/")
            assert "nothing listens on port 3999" in str(e.value)
            assert router.refused == 0
            assert all(caller_token not in str(h) for h in router.seen)
        finally:
            sandbox.kill()


def claim_name_of(sandbox: Sandbox) -> str:
    """The claim behind ``sandbox`` (/rpc: its claim; v1: its name)."""
    return str(getattr(sandbox, "claim_name", None) or sandbox.name)


@contextmanager
def httpx_client() -> Iterator[Any]:
    import httpx

    with httpx.Client(trust_env=False, timeout=10) as client:
        yield client


# ------------------------------------------------------------------------------ RBAC


def test_a_broker_without_a_verb_is_not_ready_and_names_it(
    kube: KubeAPIServer,
    identity: BrokerIdentity,
    replica_factory: Callable[..., Replica],
) -> None:
    """The broker's claims go to a namespace where its Role lacks ``watch``: /readyz is 503
    naming the verb, the resource, the namespace and the fix; once the verb is granted the
    broker becomes ready without a restart."""
    elsewhere = kube.create_namespace()
    verbs = ["get", "list", "create", "delete", "patch"]  # no watch
    rules = [{"apiGroups": ["extensions.agents.x-k8s.io"], "resources": ["sandboxclaims"],
              "verbs": verbs},
             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
              "verbs": ["get", "create", "patch"]}]  # fmt: skip
    identity.bind(elsewhere, "sandbox-broker-partial", rules=rules)
    replica = replica_factory(namespace=elsewhere, ready=False)
    deadline = time.monotonic() + 20
    while "may not" not in (answer := replica.readyz())[1].get("not_ready", {}).get(
        "kubernetes", ""
    ):
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)
    status, body = answer
    problem = body["not_ready"]["kubernetes"]
    assert status == 503
    assert (
        "may not `watch` `sandboxclaims` (extensions.agents.x-k8s.io) in namespace "
        + (f"{elsewhere}: add the verbs to its Role")
        in problem
    )
    assert problem.count("may not") == 1
    identity.bind(elsewhere)
    replica.wait_ready(30)
