"""The router data plane end to end with deploy/examples applied as they are (issue 28, item 1).

The router here resolves pods as upstream's Python router does at agent-sandbox commit
2fd412d5 (tests/_support/stand_in_router.py): by ``X-Sandbox-Pod-IP``, else by the DNS name
``{sandbox}.{namespace}.svc.cluster.local``, which exists only when the Sandbox has the headless
Service its template asks for (``service: true``; the stand-in controller makes it only then, as
upstream's does). The example templates have no ``service: true``, so the name never resolves:
the broker must send the pod IP of the caller's own claim, and nothing a caller sends may
choose it. The examples' templates and warm pools are applied unmodified but for their
namespace (each test has its own).
"""

from __future__ import annotations

import copy
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from k8s_agent_sandbox_awx import Sandbox
from tests._support._api import CLAIM, path
from tests._support.controller import StandInController
from tests._support.deploy import EXAMPLES, render
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import SdkReplica, StandInRouter

pytestmark = pytest.mark.slow

POOLS = ("awx-runtime-warmpool", "python-runtime-warmpool")


def apply_examples(kube: KubeAPIServer, controller: StandInController, namespace: str) -> None:
    """deploy/examples' SandboxTemplates and SandboxWarmPools in ``namespace`` (moved there
    from ``team-a``, nothing else changed), once their warm Sandboxes are Ready."""
    objects = [o for o in render(EXAMPLES) if o["kind"] in ("SandboxTemplate", "SandboxWarmPool")]
    assert sorted(o["metadata"]["name"] for o in objects) == sorted(
        ["awx-runtime", "python-runtime", *POOLS]
    )
    for obj in objects:
        moved = copy.deepcopy(obj)
        moved["metadata"]["namespace"] = namespace
        kube.create(moved, namespace)
    for pool in (o for o in objects if o["kind"] == "SandboxWarmPool"):
        controller.wait_for_pool(namespace, pool["metadata"]["name"], pool["spec"]["replicas"])


@pytest.fixture
def router(
    kube: KubeAPIServer, namespace: str, controller: StandInController, tmp_path: Path
) -> Iterator[StandInRouter]:
    """The examples applied and the stand-in router (loopback pod IPs allowed: the stand-in
    pods listen on 127.x.y.z, as the Go router's --allow-loopback-pod-ip allows)."""
    apply_examples(kube, controller, namespace)
    token = tmp_path / "router-token"
    token.write_text("router-secret\n")
    with StandInRouter(controller, token, allow_loopback_pod_ip=True) as stand_in:
        yield stand_in


def adopted(kube: KubeAPIServer, namespace: str, claim: str) -> str:
    return str(kube.get(path(CLAIM, namespace, claim))["status"]["sandbox"]["name"])


def router_get(router: StandInRouter, namespace: str, sandbox: str, **more: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {router.token_file.read_text().strip()}",
               "X-Sandbox-ID": sandbox, "X-Sandbox-Namespace": namespace, **more}  # fmt: skip
    with httpx.Client(trust_env=False, timeout=10) as client:
        return client.get(router.url + "/", headers=headers)


def test_the_sdk_works_through_the_router_with_the_example_templates(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    sdk_replica: SdkReplica,
    router: StandInRouter,
) -> None:
    """Both example pools, warm-adopted: commands, files and the info through the router,
    which dialled the pod IP the broker sent (the Sandbox's name does not resolve: no
    Service); ``started_at`` is not before ``created_at`` although the warm Sandbox was Ready
    before the claim existed (issue 28, item 4)."""
    _, environ = sdk_replica(router=(router.url, router.token_file), pools=POOLS)
    time.sleep(1.1)  # the warm Sandboxes' Ready time and the claims' creation are seconds apart
    for pool in POOLS:
        with Sandbox.create(pool, environ=environ, timeout=600) as sandbox:
            assert sandbox.commands.run("echo through the router").stdout == "through the router\n"
            sandbox.files.write("note.txt", b"kept")
            assert sandbox.files.read("note.txt") == b"kept"
            info = sandbox.get_info()
            assert info.started_at is not None and info.started_at >= info.created_at
            name = adopted(kube, namespace, sandbox.name)
            assert name != sandbox.name and name.startswith(pool.removesuffix("-warmpool"))
            pod_ip = controller.pod_address(namespace, name)[0]
            routed = {h.get("x-sandbox-pod-ip") for h in router.seen if h["x-sandbox-id"] == name}
            assert routed == {pod_ip}
            # without the pod IP the router finds no pod: the template asks for no Service
            refused = router_get(router, namespace, name)
            assert refused.status_code == 502
            assert refused.json() == {"detail": f"Could not connect to the backend sandbox: {name}"}
    assert set(router.resolved) == {"pod-ip", "dns"}
    assert router.resolved.count("dns") == len(POOLS)  # only the requests of this test's own


def test_the_router_finds_a_pod_by_its_service_only_with_service_true(
    namespace: str, controller: StandInController, router: StandInRouter
) -> None:
    """The stand-in resolves as upstream's does: a template with ``service: true`` gives each
    Sandbox a headless Service, and its name then reaches the pod without a pod IP."""
    controller.create_template(namespace, "with-service", service=True)
    controller.create_warm_pool(namespace, "with-service", "with-service", replicas=1)
    sandboxes = controller.kube.get(
        f"/apis/agents.x-k8s.io/v1beta1/namespaces/{namespace}/sandboxes"
    )["items"]
    [name] = [s["metadata"]["name"] for s in sandboxes if s["metadata"]["name"].startswith("with-")]
    found = router_get(router, namespace, name)
    assert found.status_code == 200, found.text
    assert router.resolved[-1] == "dns"


def _data_plane(replica_url: str, environ: dict[str, str]) -> httpx.Client:
    token = Path(environ["AGENT_SANDBOX_TOKEN_FILE"]).read_text().strip()
    return httpx.Client(
        base_url=replica_url,
        verify=ssl.create_default_context(cafile=environ["AGENT_SANDBOX_CA_BUNDLE"]),
        headers={"Authorization": f"Bearer {token}"},
        trust_env=False,
        timeout=30,
    )


def test_a_callers_pod_ip_header_never_reaches_the_router(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    sdk_replica: SdkReplica,
    router: StandInRouter,
) -> None:
    """X-Sandbox-Pod-IP is a routing input the router trusts: the broker drops every one the
    caller sends (any case, repeated) and sends the pod IP of the caller's own claim, so a
    caller naming another sandbox's pod still reaches only its own sandbox."""
    replica, environ = sdk_replica(router=(router.url, router.token_file), pools=POOLS)
    with (
        Sandbox.create(POOLS[0], environ=environ, timeout=600) as mine,
        Sandbox.create(POOLS[0], environ=environ, timeout=600) as other,
    ):
        mine.files.write("whose.txt", b"mine")
        other.files.write("whose.txt", b"other")
        own_ip = controller.pod_address(namespace, adopted(kube, namespace, mine.name))[0]
        other_ip = controller.pod_address(namespace, adopted(kube, namespace, other.name))[0]
        assert own_ip != other_ip
        sent: list[tuple[str, str]] = [
            ("X-Sandbox-ID", mine.name), ("X-Sandbox-Namespace", namespace),
            ("X-Sandbox-Pod-IP", other_ip), ("x-sandbox-pod-ip", other_ip),
            ("X-SANDBOX-POD-IP", "169.254.169.254"),
        ]  # fmt: skip
        with _data_plane(replica.url, environ) as client:
            answer = client.get("/download/whose.txt", headers=httpx.Headers(sent))
        assert answer.status_code == 200, answer.text
        assert answer.content == b"mine"
        own = adopted(kube, namespace, mine.name)
        assert router.seen[-1]["x-sandbox-id"] == own
        assert [v for k, v in router.raw[-1] if k.lower() == "x-sandbox-pod-ip"] == [own_ip]
        for headers in router.seen:
            assert headers.get("x-sandbox-pod-ip") == (
                own_ip if headers["x-sandbox-id"] == own else other_ip
            )


# ------------------------------------------------------------------------------ long requests


def heartbeat_template(controller: StandInController, namespace: str, name: str) -> None:
    """A template (and an empty pool) whose runtime sends a streamed command's heartbeat every
    0.5 s (SANDBOX_COMMAND_HEARTBEAT_SECONDS; the runtime's default is 2 s), so that a router
    timeout of 2 s proves the keep-alive with room to spare."""
    container = {
        "name": "sandbox",
        "image": "stand-in/python-runtime:local",
        "ports": [{"containerPort": 8888, "protocol": "TCP"}],
        "env": [{"name": "SANDBOX_COMMAND_HEARTBEAT_SECONDS", "value": "0.5"}],
    }
    controller.create_template(namespace, name, pod_spec={"containers": [container]})
    controller.create_warm_pool(namespace, name, name, replicas=0)


def test_a_command_longer_than_the_routers_timeout_runs_when_streamed(
    namespace: str, controller: StandInController, sdk_replica: SdkReplica, tmp_path: Path
) -> None:
    """Upstream's router gives up on a request that sends nothing for its proxy timeout
    (PROXY_TIMEOUT_SECONDS, 180 s; 2 s here), while the runtime accepts 300 s commands. The
    SDK starts commands streamed: each request is a follow of at most 20 s with a heartbeat
    while the command is silent, so a silent command longer than the timeout completes. A
    legacy ``POST /execute`` (one request for the whole command) gets the router's 504, which
    the broker answers as ``504 sandbox_timeout`` naming the router's setting (was: the
    router's own body relayed, with no code)."""
    heartbeat_template(controller, namespace, "beats")
    token = tmp_path / "router-token"
    token.write_text("router-secret\n")
    with StandInRouter(controller, token, proxy_timeout=2.0, allow_loopback_pod_ip=True) as router:
        replica, environ = sdk_replica(router=(router.url, token), pools=("beats",))
        with Sandbox.create("beats", environ=environ, timeout=600) as sandbox:
            done = sandbox.commands.run("sleep 5; echo done", timeout=60)
            assert (done.exit_code, done.stdout) == (0, "done\n")
            headers = {"X-Sandbox-ID": sandbox.name, "X-Sandbox-Namespace": namespace}
            with _data_plane(replica.url, environ) as client:
                legacy = client.post("/execute", json={"command": "sleep 5"}, headers=headers)
            assert legacy.status_code == 504, legacy.text
            assert legacy.json()["code"] == "sandbox_timeout"
            assert "PROXY_TIMEOUT_SECONDS" in legacy.json()["detail"]
            assert "may have reached the sandbox" in legacy.json()["detail"]


def test_head_and_options_through_the_router_are_refused_with_a_typed_error(
    namespace: str,
    controller: StandInController,
    sdk_replica: SdkReplica,
    router: StandInRouter,
) -> None:
    """Upstream's Python router proxies only GET, POST, PUT, DELETE and PATCH (its 405 would
    read as the sandbox server's own): the broker refuses HEAD and OPTIONS to a port before
    sending, ``405 method_not_routed`` with ``Allow``; GET still goes through."""
    replica, environ = sdk_replica(router=(router.url, router.token_file), pools=POOLS)
    with Sandbox.create(POOLS[0], environ=environ, timeout=600) as sandbox:
        server = sandbox.commands.run(
            "python3 -m http.server 3000 --bind 0.0.0.0", background=True, timeout=0
        )
        headers = {"X-Sandbox-ID": sandbox.name, "X-Sandbox-Namespace": namespace,
                   "X-Sandbox-Port": "3000"}  # fmt: skip
        seen = len(router.seen)
        with _data_plane(replica.url, environ) as client:
            refused = [client.request(m, "/", headers=headers) for m in ("HEAD", "OPTIONS")]
            for answer in refused:
                assert answer.status_code == 405
                assert answer.headers["allow"] == "GET, POST, PUT, DELETE, PATCH"
            assert refused[1].json()["code"] == "method_not_routed"
            assert "data_plane" in refused[1].json()["detail"]
            assert len(router.seen) == seen  # nothing was sent
            deadline = time.monotonic() + 30
            while (got := client.get("/", headers=headers)).status_code != 200:
                assert time.monotonic() < deadline, got.text
                time.sleep(0.2)
        server.kill()


# ------------------------------------------------------------------------------ pod labels


def test_a_pod_label_the_controller_would_refuse_is_a_400_before_any_claim(
    kube: KubeAPIServer, namespace: str, python_replica: SdkReplica
) -> None:
    """agent-sandbox's controller accepts pod labels only in its allowed label domains
    (``validateAdditionalPodMetadata``: default ``sandbox.users.io``, a domain prefix
    required) and fails the claim with ``InvalidMetadata`` after it exists; the broker refuses
    the create first, naming the label, the rule and its setting (was: a claim made, then
    Failed)."""
    from k8s_agent_sandbox_awx.errors import SandboxError

    _, environ = python_replica(protocol="rpc")
    claims = f"/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/{namespace}/sandboxclaims"
    with pytest.raises(SandboxError) as refused:
        Sandbox.create("python", environ=environ, timeout=600, pod_labels={"team": "a"})
    text = str(refused.value)
    assert "pod label 'team' has no domain prefix" in text
    assert "sandbox.users.io" in text and "backend.kubernetes.pod_label_domains" in text
    assert kube.get(claims)["items"] == []
    with Sandbox.create(
        "python", environ=environ, timeout=600, pod_labels={"sandbox.users.io/team": "a"}
    ) as sandbox:
        assert sandbox.commands.run("true").exit_code == 0
