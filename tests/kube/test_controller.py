"""The stand-in agent-sandbox controller (tests/_support/controller.py) on the real API server.

It plays upstream's controllers so that the broker's Kubernetes backend can be tested against
objects written as upstream writes them. The facts pinned here are upstream's, read in
kubernetes-sigs/agent-sandbox at commit 2fd412d (v0.5.6 + 12, the commit deploy/crds was
written from); each test names the file. "claim controller" is
extensions/controllers/sandboxclaim_controller.go, "sandbox controller"
controllers/sandbox_controller.go, "warm pool controller"
extensions/controllers/sandboxwarmpool_controller.go.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests._support import _agent_sandbox as rules
from tests._support._api import CLAIM, POD, SANDBOX, collection, path
from tests._support.controller import StandInController, claim_body
from tests._support.kube import KubeAPIServer, KubeError
from tests._support.programs import process_alive as alive

pytestmark = pytest.mark.slow  # one API server per session: ~4 s to start


# ------------------------------------------------------------------------------ helpers


def ready(obj: dict[str, Any]) -> dict[str, Any] | None:
    return rules.find_condition((obj.get("status") or {}).get("conditions") or [], "Ready")


def get(kube: KubeAPIServer, url: str) -> dict[str, Any] | None:
    try:
        return kube.get(url)
    except KubeError as exc:
        if exc.status_code == 404:
            return None
        raise


def answers(url: str) -> bool:
    """Whether the runtime at ``url`` answers the legacy health check ``GET /``."""
    try:
        return httpx.get(f"{url}/", timeout=1, trust_env=False).json()["status"] == "ok"
    except httpx.HTTPError:
        return False


def run(url: str, *argv: str) -> tuple[str, int]:
    """A managed command (``POST /commands``, then its NDJSON events): stdout, exit code."""
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as client:
        started = client.post("/commands", json={"command": list(argv)})
        assert started.status_code == 200, started.text
        command = started.json()["command_id"]
        out, code = [], None
        with client.stream("GET", f"/commands/{command}/events", params={"after": 0}) as events:
            for line in events.iter_lines():
                event = json.loads(line) if line.strip() else {}
                if event.get("type") == "stdout":
                    out.append(event["data"])
                elif event.get("type") == "exit":
                    code = event["exit_code"]
                    break
    assert code is not None
    return "".join(out), code


def escape(url: str) -> int:
    """Start, through a managed command, a process that leaves the command's process group
    and session (``setsid``) and outlives the command; its pid."""
    script = ("setsid sh -c 'echo $$ > escaped.pid; exec sleep 300' >/dev/null 2>&1 & "
              "while [ ! -s escaped.pid ]; do sleep 0.05; done; cat escaped.pid")  # fmt: skip
    out, code = run(url, "sh", "-c", script)
    assert code == 0, out
    return int(out)


def in_seconds(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def python(controller: StandInController, namespace: str) -> str:
    """Template ``python`` and an empty warm pool ``python`` (claims start cold)."""
    controller.create_template(namespace, "python")
    controller.create_warm_pool(namespace, "python", "python", replicas=0)
    return "python"


def new_claim(kube: KubeAPIServer, namespace: str, pool: str = "python", **spec: Any) -> str:
    return str(kube.create(claim_body(pool, **spec), namespace)["metadata"]["name"])


def reasons_until(
    kube: KubeAPIServer, namespace: str, name: str, since: str, last: str
) -> Iterator[tuple[str, str]]:
    """The claim's (Ready status, reason) as they change, from ``since`` until ``last``."""
    seen: tuple[str, str] | None = None
    params = {"fieldSelector": f"metadata.name={name}"}
    with kube.watch(
        collection(CLAIM, namespace), resource_version=since, timeout_seconds=20, params=params
    ) as events:
        for event in events:
            condition = ready(event["object"])
            now = (condition["status"], condition["reason"]) if condition else ("", "")
            if now != seen and condition:
                seen = now
                yield now
                if now[1] == last:
                    return


# ------------------------------------------------------------------------------ cold and warm


def test_cold_start_names_the_sandbox_after_the_claim_and_owns_it(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """Claim controller ``createSandbox``: no warm candidate, so a Sandbox named after the
    claim, controlled by it, labelled ``launch-type: cold`` and with the claim's uid; no
    ``agents.x-k8s.io/sandbox-name`` annotation (only adoption writes it). Its Ready goes
    SandboxNotReady (a Sandbox without status), then the Sandbox's DependenciesNotReady, then
    DependenciesReady (sandbox controller ``computeReadyCondition``). Sandbox controller
    ``reconcilePod``: the Pod is named after the Sandbox, owned by it, labelled with the name
    hash; ``agents.x-k8s.io/`` keys of the pod template (the claim uid) are not put on it."""
    controller.ready_delay = 0.3
    since = kube.get(collection(CLAIM, namespace))["metadata"]["resourceVersion"]
    name = new_claim(kube, namespace)
    seen = list(reasons_until(kube, namespace, name, since, "DependenciesReady"))
    assert seen[0] == ("False", "SandboxNotReady")
    assert ("False", "DependenciesNotReady") in seen
    assert seen[-1] == ("True", "DependenciesReady")
    claim = kube.get(path(CLAIM, namespace, name))
    sandbox = kube.get(path(SANDBOX, namespace, name))
    assert claim["status"]["sandbox"] == {"name": name, "podIPs": sandbox["status"]["podIPs"]}
    assert ready(claim)["message"] == "Pod is Ready"
    assert rules.ASSIGNED_SANDBOX_ANNOTATION not in rules.annotations_of(claim)
    assert rules.FIRST_OBSERVED_ANNOTATION in rules.annotations_of(claim)
    kube.wait_for(lambda: rules.FIRST_READY_ANNOTATION in rules.annotations_of(
        kube.get(path(CLAIM, namespace, name))), what="the first-ready annotation")  # fmt: skip
    assert sandbox["metadata"]["ownerReferences"] == [{
        "apiVersion": CLAIM[0], "kind": "SandboxClaim", "name": name,
        "uid": claim["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True,
    }]  # fmt: skip
    assert rules.labels_of(sandbox)[rules.LAUNCH_TYPE_LABEL] == "cold"
    assert rules.labels_of(sandbox)[rules.CLAIM_UID_LABEL] == claim["metadata"]["uid"]
    pod_template = sandbox["spec"]["podTemplate"]
    assert pod_template["metadata"]["labels"][rules.CLAIM_UID_LABEL] == claim["metadata"]["uid"]
    assert pod_template["spec"]["automountServiceAccountToken"] is False  # secure defaults
    assert "lifecycle" not in sandbox["spec"] and "shutdownTime" not in sandbox["spec"]
    assert {c["type"] for c in sandbox["status"]["conditions"]} == {
        "Ready", "Suspended", "PodScheduled"
    }  # fmt: skip
    assert sandbox["status"]["nodeName"] == controller.node_name
    assert "service" not in sandbox["status"]  # no Service unless spec.service is true
    pod = kube.get(path(POD, namespace, name))
    assert rules.controlled_by(pod, sandbox)
    assert rules.labels_of(pod)[rules.SANDBOX_NAME_HASH_LABEL] == rules.name_hash(name)
    assert rules.CLAIM_UID_LABEL not in rules.labels_of(pod)
    assert pod["status"]["podIP"] == sandbox["status"]["podIPs"][0]
    assert controller.pod_address(namespace, name) == (pod["status"]["podIP"], 8888)
    timing = controller.timings[claim["metadata"]["uid"]]
    assert timing.seconds is not None and timing.seconds >= 0.3  # the pod's readiness delay


def test_warm_adoption_keeps_the_pool_name_and_the_pool_replenishes(
    kube: KubeAPIServer, namespace: str, controller: StandInController
) -> None:
    """Claim controller ``adoptSandboxFromCandidates``/``completeAdoption``: a Ready pool
    Sandbox is adopted under its pool-generated name, recorded in the claim's annotation
    ``agents.x-k8s.io/sandbox-name`` and ``status.sandbox.name``; its controller becomes the
    claim, its warm-pool labels go, ``launch-type: warm`` and the claim uid come. Warm pool
    controller ``reconcilePool``: the adopted Sandbox left the pool, which makes a new one.
    The adopted pod keeps running (same address, no restart)."""
    controller.create_template(namespace, "python")
    pool = controller.create_warm_pool(namespace, "python", "python", replicas=2)
    assert pool["status"]["selector"] == f"{rules.WARM_POOL_LABEL}={rules.name_hash('python')}"
    members = kube.get(collection(SANDBOX, namespace))["items"]
    assert sorted(rules.labels_of(m)[rules.WARM_POOL_LABEL] for m in members) == [
        rules.name_hash("python")] * 2  # fmt: skip
    assert all(m["metadata"]["name"].startswith("python-") for m in members)
    assert all(rules.pool_of(m) == "python" for m in members)
    name = new_claim(kube, namespace)
    claim = controller.wait_for_claim(namespace, name)
    adopted_name = claim["status"]["sandbox"]["name"]
    assert adopted_name != name and adopted_name in {m["metadata"]["name"] for m in members}
    assert rules.annotations_of(claim)[rules.ASSIGNED_SANDBOX_ANNOTATION] == adopted_name
    adopted = kube.get(path(SANDBOX, namespace, adopted_name))
    assert rules.controlled_by(adopted, claim) and len(adopted["metadata"]["ownerReferences"]) == 1
    own = rules.labels_of(adopted)
    assert own[rules.LAUNCH_TYPE_LABEL] == "warm"
    assert own[rules.CLAIM_UID_LABEL] == claim["metadata"]["uid"]
    assert rules.WARM_POOL_LABEL not in own and rules.CREATED_BY_LABEL not in own
    assert rules.annotations_of(adopted)[rules.POD_NAME_ANNOTATION] == adopted_name
    pod_labels = adopted["spec"]["podTemplate"]["metadata"]["labels"]
    assert pod_labels[rules.CLAIM_UID_LABEL] == claim["metadata"]["uid"]
    assert rules.SAFE_TO_EVICT_ANNOTATION not in (
        adopted["spec"]["podTemplate"]["metadata"].get("annotations") or {})  # fmt: skip
    assert claim["status"]["sandbox"]["podIPs"] == adopted["status"]["podIPs"]

    def replenished() -> set[str] | None:
        members = [m for m in kube.get(collection(SANDBOX, namespace))["items"]
                   if rules.pool_of(m) == "python" and rules.is_ready(m)]  # fmt: skip
        return {m["metadata"]["name"] for m in members} if len(members) == 2 else None

    members_now = kube.wait_for(replenished, what="the pool replenished")
    assert adopted_name not in members_now
    assert controller.wait_for_pool(namespace, "python", 2)["status"]["replicas"] == 2
    kube.wait_for(lambda: rules.WARM_POOL_LABEL not in rules.labels_of(
        kube.get(path(POD, namespace, adopted_name))), what="the pod left the pool")  # fmt: skip
    pod = kube.get(path(POD, namespace, adopted_name))
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert pod["status"]["podIP"] == adopted["status"]["podIPs"][0]
    timing = controller.timings[claim["metadata"]["uid"]]
    assert timing.seconds is not None and 0 < timing.seconds < 5


def test_a_warm_sandbox_not_ready_yet_is_adopted_and_the_claim_follows_it(
    kube: KubeAPIServer, namespace: str, controller: StandInController
) -> None:
    """Claim controller ``getCandidate``: with no Ready candidate, the first one that has pod
    IPs is adopted anyway; the claim forwards its Ready=False, then its Ready=True."""
    controller.create_template(namespace, "python")
    controller.ready_delay = 2.0
    controller.create_warm_pool(namespace, "python", "python", replicas=1, wait=False)

    def member_with_ip() -> dict[str, Any] | None:
        members = kube.get(collection(SANDBOX, namespace))["items"]
        return next((m for m in members if (m.get("status") or {}).get("podIPs")), None)

    member = kube.wait_for(member_with_ip, what="a pool member with an IP")
    assert not rules.is_ready(member)
    name = new_claim(kube, namespace)
    claim = controller.wait_for_claim(
        namespace, name, status="False", reason="DependenciesNotReady"
    )
    assert claim["status"]["sandbox"]["name"] == member["metadata"]["name"]
    assert (
        controller.wait_for_claim(namespace, name)["status"]["sandbox"]["name"]
        == (member["metadata"]["name"])
    )


def test_env_or_volume_claim_templates_force_a_cold_start(
    kube: KubeAPIServer, namespace: str, controller: StandInController
) -> None:
    """Claim controller ``getOrCreateSandbox``: a claim with ``env`` bypasses the warm pool;
    with ``envVarsInjectionPolicy: Allowed`` the variable lands in the first container, and
    so in the sandbox runtime's environment."""
    controller.create_template(namespace, "python", env_policy="Allowed")
    controller.create_warm_pool(namespace, "python", "python", replicas=1)
    name = new_claim(kube, namespace, env=[{"name": "GREETING", "value": "hello from the claim"}])
    claim = controller.wait_for_claim(namespace, name)
    assert claim["status"]["sandbox"]["name"] == name  # cold: named after the claim
    out, code = run(controller.pod_url(namespace, name), "printenv", "GREETING")
    assert (out, code) == ("hello from the claim\n", 0)
    assert controller.wait_for_pool(namespace, "python", 1)["status"]["replicas"] == 1


def test_a_service_only_when_the_template_asks_for_one(
    kube: KubeAPIServer, namespace: str, controller: StandInController
) -> None:
    """Sandbox controller ``reconcileService``/``setServiceStatus``: with ``service: true`` a
    headless Service named after the Sandbox, selecting its name hash, and the status'
    ``service`` and ``serviceFQDN`` (cluster domain ``cluster.local``); Ready says
    "Pod is Ready; Service Exists". Without it (the cold-start test) neither field is set."""
    controller.create_template(namespace, "served", service=True)
    controller.create_warm_pool(namespace, "served", "served", replicas=0)
    name = new_claim(kube, namespace, pool="served")
    claim = controller.wait_for_claim(namespace, name)
    assert ready(claim)["message"] == "Pod is Ready; Service Exists"
    sandbox = kube.get(path(SANDBOX, namespace, name))
    assert sandbox["status"]["service"] == name
    assert sandbox["status"]["serviceFQDN"] == f"{name}.{namespace}.svc.cluster.local"
    service = kube.get(f"/api/v1/namespaces/{namespace}/services/{name}")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {rules.SANDBOX_NAME_HASH_LABEL: rules.name_hash(name)}
    assert service["spec"]["ports"][0]["port"] == 8888
    assert rules.controlled_by(service, sandbox)


# ------------------------------------------------------------------------------ failures


def test_a_missing_warm_pool_then_a_missing_template_then_ready(
    kube: KubeAPIServer, namespace: str, controller: StandInController
) -> None:
    """Claim controller ``computeReadyCondition``: ``WarmPoolNotFound`` with the message
    ``SandboxWarmPool "x" not found``, ``TemplateNotFound`` with ``SandboxTemplate "x" not
    found``. Upstream's client gives up on them, but the controller does not: the pool's and
    the template's creation wake the claim (``mapWarmPoolToClaims``,
    ``mapSandboxTemplateToClaims``), which then becomes Ready."""
    name = new_claim(kube, namespace, pool="later")
    claim = controller.wait_for_claim(namespace, name, status="False", reason="WarmPoolNotFound")
    assert ready(claim)["message"] == 'SandboxWarmPool "later" not found'
    controller.create_warm_pool(namespace, "later", "later-template", replicas=0, wait=False)
    claim = controller.wait_for_claim(namespace, name, status="False", reason="TemplateNotFound")
    assert ready(claim)["message"] == 'SandboxTemplate "later-template" not found'
    assert "sandbox" not in claim["status"]
    controller.create_template(namespace, "later-template")
    assert (
        controller.wait_for_claim(namespace, name, timeout=10)["status"]["sandbox"]["name"] == name
    )


@pytest.mark.parametrize(
    ("spec", "reason", "message"),
    [
        ({"additional_pod_metadata": {"labels": {"team": "a"}}}, "InvalidMetadata",
         'invalid additionalPodMetadata: failed to validate label "team": label "team" must '
         "have a domain prefix (e.g. 'sandbox.users.io/my-label') to prevent opting into "
         "unintended policy domains"),
        ({"additional_pod_metadata": {"annotations": {"agents.x-k8s.io/owner": "me"}}},
         "InvalidMetadata", 'invalid additionalPodMetadata: failed to validate annotation '
         '"agents.x-k8s.io/owner": restricted system domain: "agents.x-k8s.io/owner" is not '
         "allowed in AdditionalPodMetadata"),
        ({"env": [{"name": "A", "value": "1"}]}, "EnvVarsInjectionRejected",
         "environment variable injection rejected: environment variable injection is not "
         "allowed by the template policy"),
        ({"volume_claim_templates": [{"metadata": {"name": "data"}, "spec": {}}]},
         "VolumeClaimTemplatesError", "failed to merge volume claim templates: volume claim "
         "templates are disallowed by the template"),
    ],
    ids=["label-without-domain", "system-annotation", "env-disallowed", "volumes-disallowed"],
)  # fmt: skip
def test_terminal_reasons_under_upstreams_conditions(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str,
    spec: dict[str, Any], reason: str, message: str,
) -> None:  # fmt: skip
    """Claim controller ``validateAdditionalPodMetadata`` (labels need a domain in the
    allow-list, default ``sandbox.users.io``; annotations may not use ``agents.x-k8s.io``),
    ``createSandbox`` (``env`` only with the template's ``envVarsInjectionPolicy`` Allowed or
    Overrides; claim volume claim templates only with ``volumeClaimTemplatesPolicy`` Allowed
    or Overrides; both default to Disallowed in the CRD): Ready=False, no Sandbox."""
    name = new_claim(kube, namespace, **spec)
    claim = controller.wait_for_claim(namespace, name, status="False", reason=reason)
    assert ready(claim)["message"] == message
    assert reason in rules.TERMINAL_CLAIM_REASONS
    assert get(kube, path(SANDBOX, namespace, name)) is None
    assert controller.errors == []


def test_an_allowed_label_domain_reaches_the_sandbox_and_the_pod(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """Claim controller ``mergePodMetadata`` puts ``additionalPodMetadata`` on the pod
    template; sandbox controller ``reconcilePod`` copies non-system labels to the Pod."""
    label = "sandbox.users.io/team"
    name = new_claim(kube, namespace, additional_pod_metadata={"labels": {label: "blue"}})
    controller.wait_for_claim(namespace, name)
    sandbox = kube.get(path(SANDBOX, namespace, name))
    assert sandbox["spec"]["podTemplate"]["metadata"]["labels"][label] == "blue"
    pod = kube.get(path(POD, namespace, name))
    assert rules.labels_of(pod)[label] == "blue"
    assert rules.annotations_of(pod)[rules.PROPAGATED_LABELS_ANNOTATION] == label


def test_a_sandbox_expired_on_its_own_makes_the_claim_say_so(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """Sandbox controller ``handleSandboxExpiry``: at the Sandbox's own ``shutdownTime`` its
    Pod goes; with ``Retain`` the Sandbox stays with its status emptied but for the
    conditions, Ready=False ``SandboxExpired`` "Sandbox has expired". Claim controller: the
    claim says ``SandboxExpired`` "Underlying Sandbox resource has expired independently of
    the Claim."."""
    name = new_claim(kube, namespace)
    controller.wait_for_claim(namespace, name)
    url = controller.pod_url(namespace, name)
    assert answers(url)
    kube.merge_patch(path(SANDBOX, namespace, name), {"spec": {"shutdownTime": in_seconds(1)}})
    claim = controller.wait_for_claim(namespace, name, status="False", reason="SandboxExpired")
    assert ready(claim)["message"] == (
        "Underlying Sandbox resource has expired independently of the Claim.")  # fmt: skip
    sandbox = kube.get(path(SANDBOX, namespace, name))
    assert ready(sandbox)["reason"] == "SandboxExpired"
    assert ready(sandbox)["message"] == "Sandbox has expired"
    # the condition is written first, then the pod goes and the status is emptied (the claim
    # can say so in between): the status ends with the conditions only
    kube.wait_for(
        lambda: set(kube.get(path(SANDBOX, namespace, name))["status"]) == {"conditions"},
        what="the Sandbox's status emptied but for its conditions",
    )
    kube.wait_for(lambda: get(kube, path(POD, namespace, name)) is None, what="the pod deleted")
    assert not answers(url)


def test_an_injected_reason_and_its_withdrawal(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """The knob for reasons a test cannot provoke (e.g. upstream's ``ReconcilerError`` or
    ``AdoptionConflict``): the claim shows it; withdrawn, the claim goes on."""
    name = new_claim(kube, namespace)
    controller.wait_for_claim(namespace, name)
    controller.inject_claim_error(namespace, name, "ReconcilerError", "Error seen: injected")
    claim = controller.wait_for_claim(namespace, name, status="False", reason="ReconcilerError")
    assert ready(claim)["message"] == "Error seen: injected"
    controller.inject_claim_error(namespace, name, None)
    controller.wait_for_claim(namespace, name)


# ------------------------------------------------------------------------------ lifecycle


def test_expiry_with_shutdown_policy_delete_deletes_the_claim(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """Claim controller ``Reconcile``: at ``spec.lifecycle.shutdownTime`` the claim first
    gets Ready=False ``ClaimExpired``, then with ``shutdownPolicy: Delete`` it is deleted; its
    Sandbox and Pod follow by owner reference (the stand-in garbage collector)."""
    since = kube.get(collection(CLAIM, namespace))["metadata"]["resourceVersion"]
    name = new_claim(kube, namespace, lifecycle={"shutdownTime": in_seconds(2),
                                                 "shutdownPolicy": "Delete"})  # fmt: skip
    controller.wait_for_claim(namespace, name)
    url = controller.pod_url(namespace, name)
    assert answers(url)
    events: list[tuple[str, str]] = []
    with kube.watch(collection(CLAIM, namespace), resource_version=since,
                    timeout_seconds=15) as stream:  # fmt: skip
        for event in stream:
            condition = ready(event["object"]) or {}
            events.append((event["type"], condition.get("reason", "")))
            if event["type"] == "DELETED":
                break
    assert ("MODIFIED", "ClaimExpired") in events and events[-1][0] == "DELETED"
    kube.wait_for(lambda: get(kube, path(SANDBOX, namespace, name)) is None, what="sandbox gone")
    kube.wait_for(lambda: not answers(url), what="the pod's runtime gone")


def test_expiry_with_retain_keeps_the_claim_and_deletes_the_sandbox(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """Claim controller ``reconcileExpired`` (Retain, the CRD's default): the Sandbox is
    deleted, the claim stays with Ready=False ``ClaimExpired`` "Claim expired. Sandbox cleanup
    initiated." and an emptied ``status.sandbox``."""
    name = new_claim(kube, namespace, lifecycle={"shutdownTime": in_seconds(2)})
    controller.wait_for_claim(namespace, name)
    url = controller.pod_url(namespace, name)
    claim = controller.wait_for_claim(namespace, name, status="False", reason="ClaimExpired")
    assert ready(claim)["message"] == "Claim expired. Sandbox cleanup initiated."
    kube.wait_for(lambda: get(kube, path(SANDBOX, namespace, name)) is None, what="sandbox gone")
    kube.wait_for(lambda: kube.get(path(CLAIM, namespace, name))["status"]["sandbox"] == {},
                  what="status.sandbox emptied")  # fmt: skip
    kube.wait_for(lambda: not answers(url), what="the pod's runtime gone")
    time.sleep(0.3)
    assert ready(kube.get(path(CLAIM, namespace, name)))["reason"] == "ClaimExpired"


def test_an_extended_shutdown_time_is_honoured(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """Nothing makes the claim's spec immutable (claim types): the broker extends a sandbox by
    patching ``spec.lifecycle.shutdownTime``; the claim is reconciled again on that event and
    its expiry re-scheduled for the new time."""
    name = new_claim(kube, namespace, lifecycle={"shutdownTime": in_seconds(2),
                                                 "shutdownPolicy": "Delete"})  # fmt: skip
    controller.wait_for_claim(namespace, name)
    started = time.monotonic()
    kube.merge_patch(path(CLAIM, namespace, name),
                     {"spec": {"lifecycle": {"shutdownTime": in_seconds(5)}}})  # fmt: skip
    time.sleep(max(0.0, 3.2 - (time.monotonic() - started)))
    assert rules.is_ready(kube.get(path(CLAIM, namespace, name)))
    kube.wait_for(lambda: get(kube, path(CLAIM, namespace, name)) is None, what="claim deleted",
                  timeout=10)  # fmt: skip
    assert time.monotonic() - started > 3.5


def test_deleting_the_claim_removes_the_sandbox_and_kills_the_pod(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """Owner references (claim controller ``createSandbox``, sandbox controller
    ``reconcilePod``): the stand-in garbage collector deletes the Sandbox, then the Pod; the
    kubelet kills the runtime, even a process a command left in a session of its own, and
    removes the pod's folder."""
    name = new_claim(kube, namespace)
    controller.wait_for_claim(namespace, name)
    url = controller.pod_url(namespace, name)
    pids = controller.kubelet.processes()
    sleeper = escape(url)
    assert alive(sleeper) and all(alive(p) for p in pids)
    folders = list((controller.workdir / "pods" / namespace).iterdir())
    kube.delete(path(CLAIM, namespace, name))
    kube.wait_for(lambda: get(kube, path(SANDBOX, namespace, name)) is None, what="sandbox gone")
    kube.wait_for(lambda: get(kube, path(POD, namespace, name)) is None, what="pod gone")
    kube.wait_for(lambda: not answers(url), what="runtime gone")
    kube.wait_for(lambda: not any(alive(p) for p in [*pids, sleeper]), what="processes gone")
    assert not any(folder.exists() for folder in folders)
    assert controller.kubelet.processes() == []


def test_foreground_deletion_waits_for_the_sandbox(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """``propagationPolicy: Foreground`` (what upstream's ``DeleteForeground`` shutdown policy
    uses): the claim stays, with ``foregroundDeletion``, until its Sandbox is gone."""
    name = new_claim(kube, namespace)
    controller.wait_for_claim(namespace, name)
    kube.request("DELETE", path(CLAIM, namespace, name), json={"propagationPolicy": "Foreground"})
    kube.wait_for(lambda: get(kube, path(CLAIM, namespace, name)) is None, what="claim gone")
    assert get(kube, path(SANDBOX, namespace, name)) is None


def test_a_killed_pod_makes_the_claim_not_ready_until_its_restart(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """A crashed container with ``restartPolicy: Always``: the Pod is Running but not Ready,
    so the Sandbox's Ready is False ``DependenciesNotReady`` "Pod is Running but not Ready"
    (sandbox controller ``computeReadyCondition``), forwarded to the claim; the container is
    restarted on the same address and all is Ready again."""
    controller.restart_delay = 0.5
    name = new_claim(kube, namespace)
    controller.wait_for_claim(namespace, name)
    address = controller.pod_address(namespace, name)
    controller.kill_pod(namespace, name)
    claim = controller.wait_for_claim(
        namespace, name, status="False", reason="DependenciesNotReady"
    )
    assert ready(claim)["message"] == "Pod is Running but not Ready"
    controller.wait_for_claim(namespace, name)
    assert controller.pod_address(namespace, name) == address
    pod = kube.get(path(POD, namespace, name))
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 1


def test_a_killed_pod_that_never_restarts_has_failed(
    kube: KubeAPIServer, namespace: str, controller: StandInController
) -> None:
    """``restartPolicy: Never``: the Pod fails; sandbox controller: Ready=False ``PodFailed``
    "Pod failed" and ``Finished`` True ``PodFailed``, both copied to the claim
    (``syncFinishedCondition``)."""
    controller.create_template(namespace, "once", restart_policy="Never")
    controller.create_warm_pool(namespace, "once", "once", replicas=0)
    name = new_claim(kube, namespace, pool="once")
    controller.wait_for_claim(namespace, name)
    controller.kill_pod(namespace, name)
    claim = controller.wait_for_claim(namespace, name, status="False", reason="PodFailed")
    assert ready(claim)["message"] == "Pod failed"
    finished = rules.find_condition(claim["status"]["conditions"], "Finished")
    assert finished is not None and finished["status"] == "True"
    assert finished["reason"] == "PodFailed"
    assert kube.get(path(POD, namespace, name))["status"]["phase"] == "Failed"


def test_a_finished_claim_expires_after_its_ttl(
    kube: KubeAPIServer, namespace: str, controller: StandInController
) -> None:
    """internal/lifecycle/expiry.go ``TimeLeft``: with ``ttlSecondsAfterFinished`` a claim
    expires that long after its ``Finished`` condition (copied from the Sandbox) turned True;
    then as at ``shutdownTime`` (Retain: ClaimExpired, Sandbox deleted, Finished kept)."""
    controller.create_template(namespace, "once", restart_policy="Never")
    controller.create_warm_pool(namespace, "once", "once", replicas=0)
    name = new_claim(kube, namespace, pool="once", lifecycle={"ttlSecondsAfterFinished": 0})
    controller.wait_for_claim(namespace, name)
    controller.kill_pod(namespace, name)
    claim = controller.wait_for_claim(namespace, name, status="False", reason="ClaimExpired")
    assert rules.find_condition(claim["status"]["conditions"], "Finished")["reason"] == "PodFailed"
    kube.wait_for(lambda: get(kube, path(SANDBOX, namespace, name)) is None, what="sandbox gone")


# ------------------------------------------------------------------------------ the runtime


def test_each_pod_has_its_own_address_on_the_same_port_and_serves_the_runtime(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """Like pods: distinct IPs (``127.x.y.z``), one port; the runtime answers the legacy
    ``GET /`` and runs a managed command in its own base directory."""
    names = [new_claim(kube, namespace) for _ in range(2)]
    claims = [controller.wait_for_claim(namespace, n) for n in names]
    ips = [c["status"]["sandbox"]["podIPs"][0] for c in claims]
    assert len(set(ips)) == 2 and all(ip.startswith("127.") and ip != "127.0.0.1" for ip in ips)
    urls = [controller.pod_url(namespace, n) for n in names]
    assert urls == [f"http://{ip}:8888" for ip in ips]
    assert httpx.get(f"{urls[0]}/", trust_env=False).json()["status"] == "ok"
    homes = [run(url, "pwd")[0].strip() for url in urls]
    assert len(set(homes)) == 2
    assert all(home.startswith(str(controller.workdir)) for home in homes)
    assert run(urls[1], "sh", "-c", "echo hi; exit 3") == ("hi\n", 3)


# ------------------------------------------------------------------------------ resilience


def test_paused_the_controller_writes_nothing_until_resumed(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """A claim with no status yet (the controller down), then Ready once it is back; its
    timing starts at the resume."""
    controller.pause()
    name = new_claim(kube, namespace)
    time.sleep(0.5)
    claim = kube.get(path(CLAIM, namespace, name))
    assert "status" not in claim and not rules.annotations_of(claim)
    resumed = time.perf_counter()
    controller.resume()
    claim = controller.wait_for_claim(namespace, name)
    assert controller.timings[claim["metadata"]["uid"]].observed_at >= resumed


def test_a_watch_expiry_relists_and_nothing_is_missed(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """A watch resumed from a version the server no longer has is answered 410 Gone (see
    test_apiserver); each informer lists again and goes on: a claim created meanwhile is
    served."""
    before = {i.name: i.relists for i in controller._informers}
    expired = controller.expire_watches()
    assert len(expired) == 4  # claims, sandboxes, pools, templates
    name = new_claim(kube, namespace)
    kube.wait_for(lambda: all(i.relists > before[i.name] for i in expired),
                  what="every informer listed again")  # fmt: skip
    controller.wait_for_claim(namespace, name)
    assert controller.errors == []


def test_the_controller_survives_an_api_server_restart(
    kube: KubeAPIServer, namespace: str, controller: StandInController, python: str
) -> None:
    """The API server restarted (connections dropped, the watch cache new: 410 on resume):
    the informers list again; running pods keep running; new claims are served."""
    first = new_claim(kube, namespace)
    controller.wait_for_claim(namespace, first)
    url = controller.pod_url(namespace, first)
    before = {i.name: i.relists for i in controller._informers}
    kube.restart()
    second = new_claim(kube, namespace)
    controller.wait_for_claim(namespace, second, timeout=20)
    kube.wait_for(lambda: all(i.relists > before[i.name] for i in controller._informers),
                  what="every informer listed again")  # fmt: skip
    assert answers(url) and rules.is_ready(kube.get(path(CLAIM, namespace, first)))
    kube.delete(path(CLAIM, namespace, first))
    kube.wait_for(lambda: not answers(url), what="the first pod gone")


def _all_bound(kube: KubeAPIServer, namespace: str, at_least: int) -> bool:
    """Whether ``namespace`` has ``at_least`` pods, each bound to a node."""
    pods = kube.get(collection(POD, namespace))["items"]
    return len(pods) >= at_least and all(p["spec"].get("nodeName") for p in pods)


def test_stop_leaves_no_process_and_no_folder(kube: KubeAPIServer, namespace: str) -> None:
    """``stop()`` is bounded, kills every pod's processes (even one a command left in a
    session of its own) and removes the work folder; the API objects stay (another stand-in,
    another node, leaves them alone)."""
    stand_in = StandInController(kube, [namespace]).start()
    try:
        stand_in.create_template(namespace, "python")
        stand_in.create_warm_pool(namespace, "python", "python", replicas=1)
        name = new_claim(kube, namespace)
        sandbox = stand_in.wait_for_claim(namespace, name)["status"]["sandbox"]["name"]
        # the pool's refill pod bound to this node before it stops (else the next node binds
        # it, as a scheduler does, and runs it: a pod of its own, not one of the old node's)
        kube.wait_for(lambda: _all_bound(kube, namespace, 2), what="the pool's refill bound")
        pids = [*stand_in.kubelet.processes(), escape(stand_in.pod_url(namespace, name))]
        assert len(pids) >= 3 and all(alive(p) for p in pids)
    finally:
        started = time.monotonic()
        stand_in.stop()
        took = time.monotonic() - started
    assert took < 5
    assert not any(alive(p) for p in pids)
    assert not stand_in.workdir.exists()
    assert get(kube, path(SANDBOX, namespace, sandbox)) is not None
    with StandInController(kube, [namespace]) as again:
        time.sleep(0.3)
        assert again.kubelet.processes() == []  # the old node's pods are not run here
        assert os.path.isdir(again.workdir)


# ------------------------------------------------------------------------------ rules


def test_name_hash_is_fnv_1a_32_as_upstreams_name_hash() -> None:
    """``controllers/sandbox_controller.go`` ``NameHash``: Go's ``hash/fnv`` New32a, 8 lowercase
    hex digits (the FNV reference vectors)."""
    assert rules.name_hash("") == "811c9dc5"
    assert rules.name_hash("a") == "e40c292c"
    assert rules.name_hash("foobar") == "bf9cf968"


def test_set_condition_keeps_the_transition_time_unless_the_status_changes() -> None:
    """k8s.io/apimachinery ``meta.SetStatusCondition``."""
    conditions: list[dict[str, Any]] = []
    rules.set_condition(conditions, {**rules.condition("Ready", "False", "A", "", 1),
                                     "lastTransitionTime": "2026-01-01T00:00:00Z"})  # fmt: skip
    rules.set_condition(conditions, rules.condition("Ready", "False", "B", "m", 2))
    assert conditions == [{"type": "Ready", "status": "False", "reason": "B", "message": "m",
                           "observedGeneration": 2,
                           "lastTransitionTime": "2026-01-01T00:00:00Z"}]  # fmt: skip
    rules.set_condition(conditions, rules.condition("Ready", "True", "C", "", 2))
    assert conditions[0]["lastTransitionTime"] != "2026-01-01T00:00:00Z"


def test_the_reasons_upstreams_client_stops_waiting_on() -> None:
    """clients/python/agentic-sandbox-client/k8s_agent_sandbox: ``TERMINAL_CLAIM_READY_REASONS``
    (constants.py), plus TemplateNotFound and WarmPoolNotFound, on which
    async_k8s_helper.py raises its own errors."""
    assert {
        "InvalidMetadata", "EnvVarsInjectionRejected", "VolumeClaimTemplatesError",
        "ClaimExpired", "SandboxExpired", "TemplateNotFound", "WarmPoolNotFound",
    } == rules.TERMINAL_CLAIM_REASONS  # fmt: skip
