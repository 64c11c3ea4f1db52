"""The stand-in Sandbox and SandboxWarmPool controllers (behaviour of upstream's
``controllers/sandbox_controller.go`` and ``extensions/controllers/sandboxwarmpool_controller.go``
at 2fd412d).

Sandbox (``SandboxReconciler``): one Pod per Sandbox, named after it (or as the annotation
``agents.x-k8s.io/pod-name`` says), owned by it, with the pod template's spec and its labels and
annotations minus the ``agents.x-k8s.io/`` ones, plus ``agents.x-k8s.io/sandbox-name-hash`` and,
while a warm pool controls the Sandbox, the pool's label; PersistentVolumeClaims from the
volume claim templates; a headless Service only with ``spec.service: true``. Its status: the
Pod's IPs and node, the label selector, ``service``/``serviceFQDN`` when a Service exists, and
the conditions ``Suspended``, ``PodScheduled`` (the Pod's, while there is a Pod), ``Finished``
(the Pod succeeded or failed) and ``Ready`` (``DependenciesReady`` once the Pod is Running and
Ready with an IP; else ``DependenciesNotReady`` saying why, ``PodFailed``/``PodSucceeded``,
``SandboxExpired``, ``ReconcilerError``). At the Sandbox's own ``spec.shutdownTime`` its Pod and
Service are deleted, then the Sandbox itself (``shutdownPolicy: Delete``) or its status is
emptied but for the conditions, ``Ready`` False reason ``SandboxExpired`` (``Retain``).

Warm pool (``PoolReconciler``): ``spec.replicas`` (default 1) Sandboxes named ``<pool>-<random>``
from the template, owned by the pool and labelled with its name's hash; replaced when adopted
(they leave the pool), when stuck not Ready past the readiness grace (5 min), and under
``updateStrategy: Recreate`` when the template changed; the excess deleted (not Ready ones
first, newest first). Status: ``replicas``, ``readyReplicas``, ``selector``,
``observedGeneration``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tests._support import _agent_sandbox as rules
from tests._support._agent_sandbox import q
from tests._support._api import (
    POD,
    POOL,
    PVC,
    SANDBOX,
    SERVICE,
    SERVICE_ACCOUNT,
    TEMPLATE,
    Api,
    collection,
    path,
)
from tests._support._claims import Retry, same_blueprint
from tests._support.kube import KubeError

EXPIRY_MIN_REQUEUE = 2.0


@dataclass(frozen=True)
class SandboxSettings:
    cluster_domain: str = "cluster.local"
    readiness_grace: float = 300.0
    warm_pool_eviction: bool = True


class SandboxError(Exception):
    """Why the Sandbox's Pod or Service could not be reconciled (its Ready says it)."""


class SandboxReconciler:
    def __init__(self, api: Api, settings: SandboxSettings) -> None:
        self.api, self.settings = api, settings
        self._service_accounts: set[str] = set()

    def reconcile(self, namespace: str, name: str) -> float | None:
        sandbox = self.api.get(path(SANDBOX, namespace, name))
        if sandbox is None or rules.deleting(sandbox):
            return None
        old_status = copy.deepcopy(sandbox.get("status") or {})
        sandbox["status"] = copy.deepcopy(old_status)
        expired, left = self._expiry(sandbox)
        if expired:
            return self._expired(sandbox, old_status)
        error = None
        try:
            self._volumes(sandbox)
            pod = self._pod(sandbox)
        except (SandboxError, KubeError) as exc:
            pod, error = None, _message(exc)
        self._pod_status(sandbox, pod)
        try:
            service = self._service(sandbox)
        except (SandboxError, KubeError) as exc:
            service, error = None, error or _message(exc)
        self._conditions(sandbox, pod, service, error)
        self._write_status(sandbox, old_status)
        if error is not None:
            raise Retry(error)
        return max(left, EXPIRY_MIN_REQUEUE) if left else None

    # ---------------------------------------------------------------------- expiry

    def _expiry(self, sandbox: dict[str, Any]) -> tuple[bool, float]:
        """``checkSandboxExpiry``: the Sandbox's own ``spec.shutdownTime``."""
        shutdown = (sandbox.get("spec") or {}).get("shutdownTime")
        return rules.time_left(datetime.now(UTC), shutdown, None, None)

    def _expired(self, sandbox: dict[str, Any], old_status: dict[str, Any]) -> float | None:
        conditions = sandbox["status"].setdefault("conditions", [])
        generation = int(sandbox["metadata"].get("generation", 0))
        expired = rules.condition(
            "Ready", "False", rules.SANDBOX_EXPIRED, "Sandbox has expired", generation
        )
        if rules.ready_reason(sandbox) != rules.SANDBOX_EXPIRED:
            rules.set_condition(conditions, expired)
            rules.remove_condition(conditions, "PodScheduled")
            self._write_status(sandbox, old_status)
            return 0.001
        namespace, name = sandbox["metadata"]["namespace"], sandbox["metadata"]["name"]
        pod_name = rules.annotations_of(sandbox).get(rules.POD_NAME_ANNOTATION) or name
        for kind, child in ((POD, pod_name), (SERVICE, name)):
            found = self.api.get(path(kind, namespace, child))
            if found is not None and rules.controlled_by(found, sandbox):
                self.api.delete(path(kind, namespace, child), uid=rules.uid(found))
        if (sandbox.get("spec") or {}).get("shutdownPolicy") == "Delete":
            self.api.delete(path(SANDBOX, namespace, name), uid=rules.uid(sandbox))
            return None
        sandbox["status"] = {"conditions": conditions}
        rules.set_condition(conditions, expired)
        self._write_status(sandbox, old_status)
        return None

    # ---------------------------------------------------------------------- the pod

    def _pod(self, sandbox: dict[str, Any]) -> dict[str, Any] | None:
        """``reconcilePod``: the Sandbox's Pod, created, adopted or kept in line."""
        namespace, name = sandbox["metadata"]["namespace"], sandbox["metadata"]["name"]
        tracked = rules.annotations_of(sandbox).get(rules.POD_NAME_ANNOTATION)
        pod = self.api.get(path(POD, namespace, tracked or name))
        if pod is None and tracked:
            self._annotate_pod_name(sandbox, None)
        if pod is not None and not rules.controlled_by(pod, sandbox):
            self._check_adoptable(sandbox, pod)
        if (sandbox.get("spec") or {}).get("operatingMode") == "Suspended":
            if pod is not None and rules.controlled_by(pod, sandbox) and not rules.deleting(pod):
                self.api.delete(path(POD, namespace, pod["metadata"]["name"]), uid=rules.uid(pod))
            self._annotate_pod_name(sandbox, None)
            return pod
        pod = self._create_pod(sandbox) if pod is None else self._update_pod(sandbox, pod)
        if not rules.annotations_of(sandbox).get(rules.POD_NAME_ANNOTATION):
            self._annotate_pod_name(sandbox, pod["metadata"]["name"])
        return pod

    def _check_adoptable(self, sandbox: dict[str, Any], pod: dict[str, Any]) -> None:
        owner, name = rules.controller_of(pod), pod["metadata"]["name"]
        if owner is not None:
            self._annotate_pod_name(sandbox, None)
            raise SandboxError(
                f"pod {q(name)} is owned by {owner.get('kind')}/{owner.get('name')} "
                f"(UID: {owner.get('uid')}), not by sandbox {q(sandbox['metadata']['name'])}"
            )
        own = rules.labels_of(pod)
        tracked = own.get(rules.SANDBOX_NAME_HASH_LABEL) == rules.name_hash(
            sandbox["metadata"]["name"]
        )
        if own.get(rules.ADOPTABLE_LABEL) != "true" and not tracked:
            raise SandboxError(
                f"cannot adopt unowned pod {q(name)}: missing required pool authorization label "
                f"({q(rules.ADOPTABLE_LABEL)}) or sandbox tracking label "
                f"({q(rules.SANDBOX_NAME_HASH_LABEL)})"
            )

    def _annotate_pod_name(self, sandbox: dict[str, Any], pod_name: str | None) -> None:
        if rules.annotations_of(sandbox).get(rules.POD_NAME_ANNOTATION) == pod_name:
            return
        patch = {"metadata": {"annotations": {rules.POD_NAME_ANNOTATION: pod_name}}}
        stored = self.api.merge(_path(sandbox), patch)
        sandbox["metadata"] = stored["metadata"]

    def _create_pod(self, sandbox: dict[str, Any]) -> dict[str, Any]:
        namespace, name = sandbox["metadata"]["namespace"], sandbox["metadata"]["name"]
        pod_labels, pod_annotations = rules.pod_metadata(sandbox)
        pod_annotations = {k: v for k, v in pod_annotations.items() if v}
        spec = copy.deepcopy(sandbox["spec"]["podTemplate"].get("spec") or {})
        claims = [
            {
                "name": v["metadata"]["name"],
                "persistentVolumeClaim": {"claimName": f"{v['metadata']['name']}-{name}"},
            }
            for v in sandbox["spec"].get("volumeClaimTemplates") or []
        ]
        if claims:
            names = {c["name"] for c in claims}
            spec["volumes"] = [v for v in spec.get("volumes") or [] if v.get("name") not in names]
            spec["volumes"] += claims
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "spec": spec,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": pod_labels,
                "annotations": pod_annotations,
                "ownerReferences": [rules.owner_reference(sandbox, *SANDBOX)],
            },
        }
        self._ensure_service_account(namespace)
        try:
            return self.api.create(collection(POD, namespace), body)
        except KubeError as exc:
            if exc.status_code != 409:
                raise
        existing = self.api.get(path(POD, namespace, name))
        if existing is None:
            raise SandboxError(f"pod {q(name)} already exists but could not be read")
        if not rules.controlled_by(existing, sandbox):
            self._check_adoptable(sandbox, existing)
        return self._update_pod(sandbox, existing)

    def _ensure_service_account(self, namespace: str) -> None:
        """Plays kube-controller-manager's ServiceAccount controller: the namespace's
        ``default`` ServiceAccount, without which 1.20's admission refuses every Pod."""
        if namespace in self._service_accounts:
            return
        body = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}
        try:
            self.api.create(collection(SERVICE_ACCOUNT, namespace), body)
        except KubeError as exc:
            if exc.status_code != 409:
                raise
        self._service_accounts.add(namespace)

    def _update_pod(self, sandbox: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
        """``updatePodMetadata``: the Pod's labels and annotations as the Sandbox says (keys
        it propagated before and no longer does are removed), and its owner."""
        wanted_labels, wanted_annotations = rules.pod_metadata(sandbox)
        metadata = pod["metadata"]
        before = {
            "labels": dict(metadata.get("labels") or {}),
            "annotations": dict(metadata.get("annotations") or {}),
        }
        after = copy.deepcopy(before)
        for kind, wanted, note in (
            ("labels", wanted_labels, rules.PROPAGATED_LABELS_ANNOTATION),
            ("annotations", wanted_annotations, rules.PROPAGATED_ANNOTATIONS_ANNOTATION),
        ):
            for key in (before["annotations"].get(note) or "").split(","):
                if key and key not in wanted and key != rules.SANDBOX_NAME_HASH_LABEL:
                    after[kind].pop(key, None)
            after[kind].update(wanted)
        for key in (rules.WARM_POOL_LABEL, rules.TEMPLATE_REF_HASH_LABEL, rules.CREATED_BY_LABEL):
            if key not in wanted_labels:
                after["labels"].pop(key, None)
        patch = rules.merge_patch(before, after)
        if not rules.controlled_by(pod, sandbox):
            patch["ownerReferences"] = [rules.owner_reference(sandbox, *SANDBOX)]
        if not patch:
            return pod
        return self.api.merge(
            path(POD, metadata["namespace"], metadata["name"]), {"metadata": patch}
        )

    def _volumes(self, sandbox: dict[str, Any]) -> None:
        """``reconcilePVCs``: one PersistentVolumeClaim per volume claim template."""
        namespace, name = sandbox["metadata"]["namespace"], sandbox["metadata"]["name"]
        for template in sandbox["spec"].get("volumeClaimTemplates") or []:
            claim_name = f"{template['metadata']['name']}-{name}"
            found = self.api.get(path(PVC, namespace, claim_name))
            if found is not None:
                if not rules.controlled_by(found, sandbox):
                    raise SandboxError(f"PVC {q(claim_name)} is not owned by sandbox {q(name)}")
                continue
            labels = {
                **(template["metadata"].get("labels") or {}),
                rules.SANDBOX_NAME_HASH_LABEL: rules.name_hash(name),
            }
            body = {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "spec": template["spec"],
                "metadata": {
                    "name": claim_name,
                    "labels": labels,
                    "annotations": template["metadata"].get("annotations") or {},
                    "ownerReferences": [rules.owner_reference(sandbox, *SANDBOX)],
                },
            }
            self.api.create(collection(PVC, namespace), body)

    # ---------------------------------------------------------------------- the service

    def _service(self, sandbox: dict[str, Any]) -> dict[str, Any] | None:
        """``reconcileService``: created only when ``spec.service`` is true, deleted (if the
        Sandbox's) when false; an existing own Service is kept when it is unset."""
        namespace, name = sandbox["metadata"]["namespace"], sandbox["metadata"]["name"]
        wanted = (sandbox.get("spec") or {}).get("service")
        found = self.api.get(path(SERVICE, namespace, name))
        owned = found is not None and rules.controlled_by(found, sandbox)
        if found is not None and not owned and rules.controller_of(found) is not None:
            raise SandboxError(f"service {q(name)} is not owned by sandbox {q(name)}")
        if wanted is False and owned:
            self.api.delete(path(SERVICE, namespace, name), uid=rules.uid(found or {}))
        if wanted is False or (found is None and not wanted) or (found is not None and not owned):
            sandbox["status"].pop("service", None)
            sandbox["status"].pop("serviceFQDN", None)
            return None
        if found is None:
            found = self.api.create(collection(SERVICE, namespace), self._service_body(sandbox))
        sandbox["status"]["service"] = name
        sandbox["status"]["serviceFQDN"] = f"{name}.{namespace}.svc.{self.settings.cluster_domain}"
        return found

    def _service_body(self, sandbox: dict[str, Any]) -> dict[str, Any]:
        name = sandbox["metadata"]["name"]
        selector = {rules.SANDBOX_NAME_HASH_LABEL: rules.name_hash(name)}
        ports, seen = [], set()
        for container in sandbox["spec"]["podTemplate"]["spec"].get("containers") or []:
            for port in container.get("ports") or []:
                key = (int(port["containerPort"]), port.get("protocol") or "TCP")
                if key in seen:
                    continue
                seen.add(key)
                ports.append(
                    {
                        "name": port.get("name") or f"p-{key[0]}-{key[1].lower()}",
                        "protocol": key[1],
                        "port": key[0],
                        "targetPort": key[0],
                    }
                )
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": name,
                "labels": selector,
                "ownerReferences": [rules.owner_reference(sandbox, *SANDBOX)],
            },
            "spec": {"clusterIP": "None", "selector": selector, "ports": ports},
        }

    # ---------------------------------------------------------------------- status

    def _pod_status(self, sandbox: dict[str, Any], pod: dict[str, Any] | None) -> None:
        status, name = sandbox["status"], sandbox["metadata"]["name"]
        if pod is None:
            status.pop("podIPs", None)
            status.pop("nodeName", None)
            return
        status["selector"] = f"{rules.SANDBOX_NAME_HASH_LABEL}={rules.name_hash(name)}"
        ips = [entry["ip"] for entry in (pod.get("status") or {}).get("podIPs") or []]
        node = (pod.get("spec") or {}).get("nodeName")
        for key, value in (("podIPs", ips), ("nodeName", node)):
            if value and rules.controlled_by(pod, sandbox):
                status[key] = value
            else:
                status.pop(key, None)

    def _conditions(
        self,
        sandbox: dict[str, Any],
        pod: dict[str, Any] | None,
        service: dict[str, Any] | None,
        error: str | None,
    ) -> None:
        conditions = sandbox["status"].setdefault("conditions", [])
        owned_pod = pod if pod is not None and rules.controlled_by(pod, sandbox) else None
        computed = [
            rules.suspended_condition(sandbox, pod),
            rules.finished_condition(sandbox, owned_pod),
            rules.pod_scheduled_condition(sandbox, owned_pod),
            rules.sandbox_ready_condition(sandbox, error, pod, service),
        ]
        for condition in computed:
            if condition is not None:
                rules.set_condition(conditions, condition)
        present = {c["type"] for c in computed if c is not None}
        for kind in ("Finished", "PodScheduled"):
            if kind not in present:
                rules.remove_condition(conditions, kind)

    def _write_status(self, sandbox: dict[str, Any], old_status: dict[str, Any]) -> None:
        """A merge patch of the status subresource, no precondition (upstream: the sole writer
        of a Sandbox's status)."""
        if sandbox["status"] == old_status:
            return
        patch = {"status": rules.merge_patch(old_status, sandbox["status"])}
        try:
            self.api.merge(
                path(
                    SANDBOX, sandbox["metadata"]["namespace"], sandbox["metadata"]["name"], "status"
                ),
                patch,
            )
        except KubeError as exc:
            if exc.status_code != 404:
                raise


class PoolReconciler:
    def __init__(self, api: Api, settings: SandboxSettings) -> None:
        self.api, self.settings = api, settings

    def reconcile(self, namespace: str, name: str) -> float | None:
        pool = self.api.get(path(POOL, namespace, name))
        if pool is None or rules.deleting(pool):
            return None
        template_name = pool["spec"]["sandboxTemplateRef"]["name"]
        template = self.api.get(path(TEMPLATE, namespace, template_name))
        pool_hash = rules.name_hash(name)
        members = self.api.list(collection(SANDBOX, namespace), {rules.WARM_POOL_LABEL: pool_hash})
        members.sort(key=lambda s: (s["metadata"]["creationTimestamp"], s["metadata"]["name"]))
        active, terminating = self._active(pool, template, members)
        active, stuck, next_check = self._unstick(active)
        terminating += stuck
        desired = int(pool["spec"].get("replicas", 1))
        if template is not None and len(active) + terminating < desired:
            body = self._member(pool, template)
            for _ in range(desired - len(active) - terminating):
                self.api.create(collection(SANDBOX, namespace), body)
        if len(active) > desired:
            excess = sorted(
                active,
                key=lambda s: (
                    rules.is_ready(s),
                    -rules.parse_time(s["metadata"]["creationTimestamp"]).timestamp(),
                ),
            )
            for sandbox in excess[: len(active) - desired]:
                self.api.delete(_path(sandbox), uid=rules.uid(sandbox))
        status = {
            "replicas": len(active),
            "readyReplicas": sum(map(rules.is_ready, active)),
            "selector": f"{rules.WARM_POOL_LABEL}={pool_hash}",
            "observedGeneration": int(pool["metadata"].get("generation", 0)),
        }
        old = pool.get("status") or {}
        if {**old, **status} != old:
            self.api.merge(path(POOL, namespace, name, "status"), {"status": status})
        return next_check

    def _active(
        self, pool: dict[str, Any], template: dict[str, Any] | None, members: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], int]:
        """``filterActiveSandboxes``: the pool's live members; stale ones (``Recreate``, or an
        orphan of another template) deleted, orphans adopted, terminating ones counted."""
        active, terminating = [], 0
        recreate = ((pool["spec"].get("updateStrategy") or {}).get("type")) == "Recreate"
        for sandbox in members:
            owner = rules.controller_of(sandbox)
            ours = owner is not None and owner.get("uid") == rules.uid(pool)
            if rules.deleting(sandbox):
                terminating += ours
                continue
            if owner is not None and not ours:
                continue
            if template is not None and (recreate or owner is None) and _stale(template, sandbox):
                self.api.delete(_path(sandbox), uid=rules.uid(sandbox))
                terminating += ours
                continue
            if owner is None or rules.labels_of(sandbox).get(rules.LAUNCH_TYPE_LABEL) != "warm":
                sandbox = self._own(pool, sandbox)
            active.append(sandbox)
        return active, terminating

    def _own(self, pool: dict[str, Any], sandbox: dict[str, Any]) -> dict[str, Any]:
        updated = copy.deepcopy(sandbox)
        updated["metadata"].setdefault("labels", {})[rules.LAUNCH_TYPE_LABEL] = "warm"
        if rules.controller_of(sandbox) is None:
            updated["metadata"]["ownerReferences"] = [rules.owner_reference(pool, *POOL)]
        return self.api.replace(_path(sandbox), updated)

    def _unstick(
        self, active: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], int, float | None]:
        """Members not Ready past the readiness grace are deleted (to be replaced); the
        seconds until the next member's grace ends."""
        grace, now = self.settings.readiness_grace, time.time()
        kept, stuck, next_check = [], 0, None
        for sandbox in active:
            age = now - rules.parse_time(sandbox["metadata"]["creationTimestamp"]).timestamp()
            if rules.is_ready(sandbox) or age <= grace:
                kept.append(sandbox)
                if not rules.is_ready(sandbox):
                    wait = grace - age + 1.0
                    next_check = wait if next_check is None else min(next_check, wait)
                continue
            self.api.delete(_path(sandbox), uid=rules.uid(sandbox))
            stuck += 1
        return kept, stuck, next_check

    def _member(self, pool: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
        """``buildSandboxCR``: a pool member from the template's blueprint."""
        name, template_name = pool["metadata"]["name"], template["metadata"]["name"]
        spec = rules.blueprint(template)
        member_labels = {
            rules.WARM_POOL_LABEL: rules.name_hash(name),
            rules.TEMPLATE_REF_HASH_LABEL: rules.name_hash(template_name),
            rules.POD_TEMPLATE_HASH_LABEL: rules.spec_hash(spec.get("podTemplate")),
            rules.TEMPLATE_HASH_LABEL: rules.spec_hash(spec),
        }
        pod_meta = spec["podTemplate"].setdefault("metadata", {})
        pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **member_labels}
        annotations = pod_meta.get("annotations") or {}
        if rules.SAFE_TO_EVICT_ANNOTATION not in annotations and self.settings.warm_pool_eviction:
            pod_meta["annotations"] = {**annotations, rules.SAFE_TO_EVICT_ANNOTATION: "true"}
        rules.apply_secure_defaults(template["spec"], spec["podTemplate"]["spec"])
        member_labels.update(
            {rules.LAUNCH_TYPE_LABEL: "warm", rules.CREATED_BY_LABEL: "controller"}
        )
        return {
            "apiVersion": SANDBOX[0],
            "kind": SANDBOX[1],
            "spec": spec,
            "metadata": {
                "generateName": f"{name}-",
                "labels": member_labels,
                "annotations": {rules.TEMPLATE_REF_ANNOTATION: template_name},
                "ownerReferences": [rules.owner_reference(pool, *POOL)],
            },
        }


def _stale(template: dict[str, Any], sandbox: dict[str, Any]) -> bool:
    """``isSandboxStale``: another template, or (no matching hash) another blueprint."""
    own = rules.labels_of(sandbox)
    if own.get(rules.TEMPLATE_REF_HASH_LABEL) != rules.name_hash(template["metadata"]["name"]):
        return True
    current = rules.spec_hash(rules.blueprint(template))
    if rules.controller_of(sandbox) is not None and own.get(rules.TEMPLATE_HASH_LABEL) == current:
        return False
    return not same_blueprint(template, sandbox)


def _path(obj: dict[str, Any]) -> str:
    api_version, kind = obj.get("apiVersion", SANDBOX[0]), obj.get("kind", SANDBOX[1])
    return path((api_version, kind), obj["metadata"]["namespace"], obj["metadata"]["name"])


def _message(exc: Exception) -> str:
    if isinstance(exc, KubeError):
        return str(exc.status.get("message") or exc)
    return str(exc)
