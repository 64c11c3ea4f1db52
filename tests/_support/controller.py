"""A stand-in for kubernetes-sigs/agent-sandbox's controllers on the test API server.

The Kubernetes tests run a real kube-apiserver (``tests/_support/kube.py``) with CRDs shaped
like upstream's, but no controller: nothing would ever answer a ``SandboxClaim``.
``StandInController`` plays, on that server and through its REST API only:

- agent-sandbox's SandboxClaim, Sandbox and SandboxWarmPool controllers, reproducing the
  observable behaviour of upstream at commit 2fd412d (v0.5.6 + 12, from which the CRDs in
  ``deploy/crds`` were written): the objects and fields they write, their names, labels,
  annotations, owner references, conditions with upstream's reasons and messages, warm
  adoption under the pool-generated name, cold start under the claim's name, the terminal
  reasons, expiry by ``shutdownTime`` (see ``_claims``, ``_sandboxes``, ``_agent_sandbox``);
- kube-controller-manager's garbage collector (owner references, foreground and orphan
  deletion; ``_collector``) and ServiceAccount controller (the ``default`` account 1.20's
  admission wants for every Pod; ``_sandboxes``);
- kube-scheduler and a kubelet whose Pods are local sandbox runtimes, each on its own loopback
  address and the same port, like pod IPs (see ``_kubelet``).

``real_node=True`` leaves the last two to real components (``real_node.py``): the controller
then plays agent-sandbox's controllers only.

It watches SandboxClaims, Sandboxes, SandboxWarmPools, SandboxTemplates and Pods in the given
namespaces (or all), lists again after a ``410`` or when the API server went away and came back,
and reconciles with one worker thread. Knobs for tests: ``ready_delay`` (a pod's readiness after
its runtime answers), ``restart_delay`` (a crashed container's restart), ``pause()``/``resume()``
(the agent-sandbox controller down; the garbage collector, scheduler and kubelet go on),
``kill_pod()`` (a container crash), ``expire_watches()`` (the next watch gets 410),
``inject_claim_error()`` (any Ready=False reason on a claim), and ``timings`` (per claim uid,
when it was observed and when its Ready=True was written: the stand-in's own share of a
create-to-ready time).

Upstream facts a client of the controller must not guess otherwise (each pinned in
tests/kube/test_controller.py): an adopted Sandbox keeps its pool-generated name (resolve it
through ``status.sandbox.name``); with no Ready warm Sandbox one not Ready yet but with pod
IPs is adopted, and one without pod IPs is waited for up to 2 s after the claim's creation
before a cold start; ``WarmPoolNotFound`` and ``TemplateNotFound`` are not final for the
controller (the pool's or template's creation resumes the claim); ``agents.x-k8s.io/claim-uid``
is on the Sandbox and its pod template, not on the Pod; ``service``/``serviceFQDN`` are only
set when a Service exists (``spec.service: true``); a crashed pod is ``DependenciesNotReady``
(restarting) or ``PodFailed`` with ``Finished`` (``restartPolicy: Never``), there is no crash
reason; at ``shutdownTime`` the claim first shows ``ClaimExpired``, then (``Delete``) goes;
``ttlSecondsAfterFinished`` expires a claim too; a claim never sets its Sandbox's own
``shutdownTime`` (``SandboxExpired`` comes from a Sandbox expiring on its own).

Not reproduced (nothing here needs them): NetworkPolicies (the SandboxTemplate controller's),
events, metrics and traces, the v1alpha1 API, suspend/resume beyond the Pod's deletion, and
the exact values of the template hashes (Go hashes its own JSON encoding).
"""

from __future__ import annotations

import copy
import functools
import logging
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import httpx

from k8s_agent_sandbox_awx.broker.backends.local._owned_dirs import (
    owned_temp_dir,
    sweep_dead_owners,
)
from tests._support import _agent_sandbox as rules
from tests._support._agent_sandbox import EXTENSIONS_GROUP
from tests._support._api import CLAIM, POD, POOL, SANDBOX, TEMPLATE, Api, collection, path
from tests._support._claims import ClaimReconciler, ClaimSettings, ClaimTiming, Retry
from tests._support._collector import FOREGROUND, ORPHAN, Collector
from tests._support._informer import Informer, Key, WorkQueue
from tests._support._kubelet import RUNTIME_MODULE, Kubelet
from tests._support._sandboxes import PoolReconciler, SandboxReconciler, SandboxSettings
from tests._support.kube import KubeAPIServer, KubeError

__all__ = ["RUNTIME_MODULE", "ClaimTiming", "StandInController", "claim_body"]

log = logging.getLogger("tests.standin")

_TMP_PREFIX: Final = "k8s-awx-standin-"
_ALWAYS: Final = frozenset({"gc", "finalize", "sweep"})
"""Work the garbage collector does: it goes on while the controller is paused."""
_WAIT: Final = 30.0


def claim_body(
    pool: str,
    *,
    name: str | None = None,
    lifecycle: Mapping[str, Any] | None = None,
    env: Sequence[Mapping[str, str]] | None = None,
    additional_pod_metadata: Mapping[str, Any] | None = None,
    volume_claim_templates: Sequence[Mapping[str, Any]] | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A SandboxClaim (``generateName: claim-`` without ``name``)."""
    spec: dict[str, Any] = {"warmPoolRef": {"name": pool}}
    for key, value in (
        ("lifecycle", lifecycle),
        ("env", env),
        ("additionalPodMetadata", additional_pod_metadata),
        ("volumeClaimTemplates", volume_claim_templates),
    ):
        if value is not None:
            spec[key] = copy.deepcopy(value)
    metadata: dict[str, Any] = {"name": name} if name else {"generateName": "claim-"}
    if labels:
        metadata["labels"] = dict(labels)
    return {"apiVersion": CLAIM[0], "kind": CLAIM[1], "metadata": metadata, "spec": spec}


class StandInController:
    """See the module docstring. Use as a context manager (or ``start()``/``stop()``)."""

    def __init__(
        self,
        kube: KubeAPIServer,
        namespaces: Sequence[str] | None = None,
        *,
        port: int = 8888,
        ready_delay: float = 0.0,
        restart_delay: float | None = 1.0,
        readiness_grace: float = 300.0,
        allowed_label_domains: Sequence[str] = rules.DEFAULT_ALLOWED_LABEL_DOMAINS,
        observability_annotations: bool = True,
        warm_pool_eviction: bool = True,
        real_node: bool = False,
    ) -> None:
        self.kube, self.port = kube, port
        self.real_node = real_node
        self.namespaces = list(namespaces) if namespaces is not None else None
        self.timings: dict[str, ClaimTiming] = {}
        self.errors: list[str] = []
        self._claim_settings = ClaimSettings(
            tuple(allowed_label_domains), observability_annotations
        )
        self._sandbox_settings = SandboxSettings(
            readiness_grace=readiness_grace, warm_pool_eviction=warm_pool_eviction
        )
        self._injected: dict[tuple[str, str], tuple[str, str]] = {}
        self._queue = WorkQueue()
        self._paused = threading.Event()
        self._idle = threading.Condition()
        self._busy: Key | None = None
        self._failures: dict[Key, int] = {}
        self._stopping = threading.Event()
        sweep_dead_owners(_TMP_PREFIX)
        self.workdir = Path(owned_temp_dir(_TMP_PREFIX))
        self.node_name = f"stand-in-{secrets.token_hex(4)}"  # a DNS subdomain, like node names
        self.kubelet = Kubelet(
            self._client,
            self.workdir / "pods",
            port=port,
            node_name=self.node_name,
            ready_delay=ready_delay,
            restart_delay=restart_delay,
        )
        self._informers: list[Informer] = []
        self._worker = threading.Thread(target=self._work, name="standin-worker", daemon=True)
        self._started = False

    def __repr__(self) -> str:
        return f"StandInController(namespaces={self.namespaces!r}, node={self.node_name!r})"

    def __enter__(self) -> StandInController:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---------------------------------------------------------------------- knobs

    @property
    def ready_delay(self) -> float:
        return self.kubelet.ready_delay

    @ready_delay.setter
    def ready_delay(self, seconds: float) -> None:
        self.kubelet.ready_delay = seconds

    @property
    def restart_delay(self) -> float | None:
        return self.kubelet.restart_delay

    @restart_delay.setter
    def restart_delay(self, seconds: float | None) -> None:
        self.kubelet.restart_delay = seconds

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def pause(self, timeout: float = _WAIT) -> None:
        """The agent-sandbox controller stops acting (as if it were down): events queue up,
        nothing is written until ``resume()``. Returns once no reconcile is under way."""
        self._paused.set()
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy is not None and self._busy[0] not in _ALWAYS:
                if not self._idle.wait(max(deadline - time.monotonic(), 0)):
                    raise TimeoutError(f"a reconcile of {self._busy} did not end in {timeout} s")

    def resume(self) -> None:
        resumed = time.perf_counter()
        for timing in list(self.timings.values()):
            if timing.observed_at == float("inf"):  # observed while paused
                timing.observed_at = resumed
        self._paused.clear()
        self._queue.wake()

    def expire_watches(self) -> list[Informer]:
        """Make the watches of the agent-sandbox kinds resume from ``resourceVersion`` 1: the
        API server answers 410 Gone (their watch caches start when the CRDs were installed)
        and each lists again, as after a watch expiry. Pods are left out: the Pod watch cache
        of a young server still holds version 1 and would replay history instead (after an
        API server restart every watch gets 410). Returns the informers expired."""
        expired = [i for i in self._informers if not i.name.startswith("pods@")]
        for informer in expired:
            informer.expire()
        return expired

    def inject_claim_error(
        self, namespace: str, name: str, reason: str | None, message: str = ""
    ) -> None:
        """Make the claim ``namespace/name`` fail with ``Ready=False`` ``reason``/``message``
        (a reason upstream has that a test cannot provoke otherwise); None takes it back."""
        if reason is None:
            self._injected.pop((namespace, name), None)
        else:
            self._injected[(namespace, name)] = (reason, message)
        self._queue.add(("claim", namespace, name))

    def kill_pod(self, namespace: str, name: str) -> None:
        """Crash the pod of the claim or Sandbox ``name`` (SIGKILL to its container)."""
        self.kubelet.kill(namespace, self._pod_name(namespace, name))

    def pod_address(self, namespace: str, name: str) -> tuple[str, int]:
        """(IP, port) of the runtime of the claim or Sandbox ``name``."""
        return self.kubelet.address(namespace, self._pod_name(namespace, name)), self.port

    def pod_url(self, namespace: str, name: str) -> str:
        host, port = self.pod_address(namespace, name)
        return f"http://{host}:{port}"

    def _pod_name(self, namespace: str, name: str) -> str:
        """The pod of the claim ``name`` (through ``status.sandbox.name``) or Sandbox ``name``."""
        claim = self._get(path(CLAIM, namespace, name))
        sandbox_name = ((claim or {}).get("status") or {}).get("sandbox", {}).get("name") or name
        sandbox = self._get(path(SANDBOX, namespace, sandbox_name))
        if sandbox is None:
            raise LookupError(f"no claim or Sandbox {namespace}/{name} with a Sandbox")
        return rules.annotations_of(sandbox).get(rules.POD_NAME_ANNOTATION) or sandbox_name

    def _get(self, url: str) -> dict[str, Any] | None:
        try:
            return self.kube.get(url)
        except KubeError as exc:
            if exc.status_code == 404:
                return None
            raise

    # ---------------------------------------------------------------------- objects

    def create_template(
        self,
        namespace: str,
        name: str,
        *,
        pod_spec: Mapping[str, Any] | None = None,
        env_policy: str | None = None,
        volume_claim_templates_policy: str | None = None,
        volume_claim_templates: Sequence[Mapping[str, Any]] | None = None,
        service: bool | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        restart_policy: str | None = None,
    ) -> dict[str, Any]:
        """A SandboxTemplate; its pod runs the sandbox runtime on the controller's port."""
        spec: dict[str, Any] = (
            copy.deepcopy(dict(pod_spec))
            if pod_spec is not None
            else {
                "containers": [
                    {
                        "name": "sandbox",
                        "image": "stand-in/python-runtime:local",
                        "ports": [{"containerPort": self.port, "protocol": "TCP"}],
                    }
                ]
            }
        )
        if restart_policy:
            spec["restartPolicy"] = restart_policy
        pod_template: dict[str, Any] = {"spec": spec}
        meta: dict[str, Any] = {
            k: dict(v) for k, v in (("labels", labels), ("annotations", annotations)) if v
        }
        if meta:
            pod_template["metadata"] = meta
        body: dict[str, Any] = {"podTemplate": pod_template}
        for key, value in (
            ("envVarsInjectionPolicy", env_policy),
            ("service", service),
            ("volumeClaimTemplatesPolicy", volume_claim_templates_policy),
            ("volumeClaimTemplates", volume_claim_templates),
        ):
            if value is not None:
                body[key] = copy.deepcopy(value)
        return self.kube.create(
            {
                "apiVersion": TEMPLATE[0],
                "kind": TEMPLATE[1],
                "metadata": {"name": name},
                "spec": body,
            },
            namespace,
        )

    def create_warm_pool(
        self,
        namespace: str,
        name: str,
        template: str,
        replicas: int = 1,
        *,
        update_strategy: str | None = None,
        wait: bool = True,
        timeout: float = _WAIT,
    ) -> dict[str, Any]:
        """A SandboxWarmPool; with ``wait``, once ``replicas`` of its Sandboxes are Ready."""
        spec: dict[str, Any] = {"replicas": replicas, "sandboxTemplateRef": {"name": template}}
        if update_strategy:
            spec["updateStrategy"] = {"type": update_strategy}
        pool = self.kube.create(
            {"apiVersion": POOL[0], "kind": POOL[1], "metadata": {"name": name}, "spec": spec},
            namespace,
        )
        if wait:
            pool = self.wait_for_pool(namespace, name, replicas, timeout=timeout)
        return pool

    def wait_for_pool(
        self, namespace: str, name: str, ready: int, *, timeout: float = _WAIT
    ) -> dict[str, Any]:
        """The pool once ``status.readyReplicas`` is ``ready``."""
        url = path(POOL, namespace, name)

        def check() -> dict[str, Any] | None:
            pool = self.kube.get(url)
            return pool if (pool.get("status") or {}).get("readyReplicas") == ready else None

        return dict(
            self.kube.wait_for(check, what=f"{ready} ready in pool {name}", timeout=timeout)
        )

    def wait_for_claim(
        self,
        namespace: str,
        name: str,
        *,
        status: str = "True",
        reason: str | None = None,
        timeout: float = _WAIT,
    ) -> dict[str, Any]:
        """The claim once its Ready condition has ``status`` (and ``reason``)."""
        url = path(CLAIM, namespace, name)

        def check() -> dict[str, Any] | None:
            claim = self.kube.get(url)
            found = rules.find_condition(
                (claim.get("status") or {}).get("conditions") or [], "Ready"
            )
            if found is None or found["status"] != status:
                return None
            return claim if reason is None or found["reason"] == reason else None

        what = f"claim {namespace}/{name} Ready={status}" + (f" ({reason})" if reason else "")
        return dict(self.kube.wait_for(check, what=what, timeout=timeout))

    # ---------------------------------------------------------------------- start, stop

    def start(self, timeout: float = _WAIT) -> StandInController:
        """Start the kubelet, the worker and the informers; returns once every informer has
        listed (raises, after stopping, if one has not within ``timeout``)."""
        if self._started:
            return self
        self._started = True
        try:
            if not self.real_node:
                self.kubelet.start()
            self._worker.start()
            for name, kind, handler in self._watched():
                scopes: list[str | None] = [None] if self.namespaces is None else [*self.namespaces]
                for namespace in scopes:
                    informer = Informer(
                        f"{name}@{namespace or '*'}",
                        self._client,
                        collection(kind, namespace),
                        handler,
                        on_relist=functools.partial(self._relisted, namespace),
                    )
                    self._informers.append(informer)
                    informer.start()
            deadline = time.monotonic() + timeout
            for informer in self._informers:
                while not informer.synced.wait(0.05):
                    if not informer.alive() or time.monotonic() > deadline:
                        raise RuntimeError(f"informer {informer.name} did not list in {timeout} s")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Stop watching and reconciling, kill every pod's processes, remove the work folder.
        Bounded: each part gets ``timeout`` at most. The API objects stay."""
        self._stopping.set()
        for informer in self._informers:
            informer.stop(timeout)
        self._queue.close()
        if self._worker.is_alive():
            self._worker.join(timeout)
        self.kubelet.stop(timeout)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.kube.admin_token}"}
        return httpx.Client(
            base_url=self.kube.url,
            verify=self.kube.ssl_context(),
            headers=headers,
            timeout=httpx.Timeout(10),
        )

    def _watched(self) -> Iterator[tuple[str, tuple[str, str], Callable[..., None]]]:
        yield "claims", CLAIM, self._on_claim
        yield "sandboxes", SANDBOX, self._on_sandbox
        yield "pools", POOL, self._on_pool
        yield "templates", TEMPLATE, self._on_template
        yield "pods", POD, self._on_pod

    # ---------------------------------------------------------------------- events

    def _on_claim(self, kind: str, claim: dict[str, Any], _old: dict[str, Any] | None) -> None:
        namespace, name = claim["metadata"]["namespace"], claim["metadata"]["name"]
        if kind == "DELETED":
            self._queue.add(("gc", namespace, rules.uid(claim)))
            return
        if rules.uid(claim) not in self.timings:
            observed = time.perf_counter()
            if self.paused:
                observed = float("inf")  # set by resume()
            self.timings[rules.uid(claim)] = ClaimTiming(observed)
        self._finalizers(CLAIM, claim)
        self._queue.add(("claim", namespace, name))

    def _on_sandbox(self, kind: str, sandbox: dict[str, Any], old: dict[str, Any] | None) -> None:
        namespace, name = sandbox["metadata"]["namespace"], sandbox["metadata"]["name"]
        if kind == "DELETED":
            self._queue.add(("gc", namespace, rules.uid(sandbox)))
        else:
            self._finalizers(SANDBOX, sandbox)
            self._queue.add(("sandbox", namespace, name))
        relevant = old is None or kind == "DELETED" or _status_changed(old, sandbox)
        for obj in (sandbox, old):
            owner = rules.controller_of(obj) if obj is not None else None
            if (
                owner is None
                or str(owner.get("apiVersion", "")).rpartition("/")[0] != EXTENSIONS_GROUP
            ):
                continue
            if owner.get("kind") == "SandboxWarmPool":
                self._queue.add(("pool", namespace, owner["name"]))
            elif owner.get("kind") == "SandboxClaim" and (relevant or obj is old):
                self._queue.add(("claim", namespace, owner["name"]))

    def _on_pool(self, kind: str, pool: dict[str, Any], old: dict[str, Any] | None) -> None:
        namespace, name = pool["metadata"]["namespace"], pool["metadata"]["name"]
        if kind == "DELETED":
            self._queue.add(("gc", namespace, rules.uid(pool)))
        else:
            self._queue.add(("pool", namespace, name))
        generation = (old or {}).get("metadata", {}).get("generation")
        if old is None or kind == "DELETED" or generation != pool["metadata"].get("generation"):
            for claim in self._claims_of(namespace, {name}):
                if not (claim.get("status") or {}).get("sandbox", {}).get("name"):
                    self._queue.add(("claim", namespace, claim["metadata"]["name"]))

    def _on_template(
        self, kind: str, template: dict[str, Any], _old: dict[str, Any] | None
    ) -> None:
        namespace, name = template["metadata"]["namespace"], template["metadata"]["name"]
        pools = {
            p["metadata"]["name"]
            for p in self._store_items("pools", namespace)
            if p["spec"]["sandboxTemplateRef"]["name"] == name
        }
        for pool in pools:
            self._queue.add(("pool", namespace, pool))
        if kind == "ADDED":
            for claim in self._claims_of(namespace, pools):
                self._queue.add(("claim", namespace, claim["metadata"]["name"]))

    def _on_pod(self, kind: str, pod: dict[str, Any], old: dict[str, Any] | None) -> None:
        if not self.real_node:
            self.kubelet.on_pod(kind, pod, old)
        if kind != "DELETED" and not self.real_node:
            self._finalizers(POD, pod)
        owner = rules.controller_of(pod)
        if (
            owner is not None
            and owner.get("kind") == "Sandbox"
            and rules.SANDBOX_NAME_HASH_LABEL in rules.labels_of(pod)
        ):
            self._queue.add(("sandbox", pod["metadata"]["namespace"], owner["name"]))

    def _finalizers(self, kind: tuple[str, str], obj: dict[str, Any]) -> None:
        finalizers = obj["metadata"].get("finalizers") or []
        if rules.deleting(obj) and (FOREGROUND in finalizers or ORPHAN in finalizers):
            metadata = obj["metadata"]
            self._queue.add(("finalize", metadata["namespace"], metadata["name"], kind))

    def _relisted(self, namespace: str | None) -> None:
        self._queue.add(("sweep", namespace or ""))

    def _store_items(self, prefix: str, namespace: str) -> list[dict[str, Any]]:
        return [
            item
            for informer in self._informers
            if informer.name.startswith(prefix + "@")
            for item in informer.items()
            if item["metadata"]["namespace"] == namespace
        ]

    def _claims_of(self, namespace: str, pools: set[str]) -> list[dict[str, Any]]:
        return [
            c
            for c in self._store_items("claims", namespace)
            if c["spec"]["warmPoolRef"]["name"] in pools and not rules.deleting(c)
        ]

    # ---------------------------------------------------------------------- the worker

    def _work(self) -> None:
        with self._client() as client:
            api = Api(client)
            claims = ClaimReconciler(api, self._claim_settings, self.timings, self._injection)
            sandboxes = SandboxReconciler(api, self._sandbox_settings)
            pools = PoolReconciler(api, self._sandbox_settings)
            collector = Collector(api, self.namespaces)
            handlers: dict[str, Callable[..., float | None]] = {
                "claim": claims.reconcile,
                "sandbox": sandboxes.reconcile,
                "pool": pools.reconcile,
                "gc": lambda ns, _uid: collector.owner_deleted(ns),
                "finalize": lambda ns, name, kind: collector.finalize(kind, ns, name),
                "sweep": lambda _ns: collector.sweep(),
            }
            if self.real_node:  # a real kube-controller-manager collects garbage
                handlers.update(gc=lambda *_: None, finalize=lambda *_: None, sweep=lambda *_: None)
            while not self._stopping.is_set():
                key = self._queue.get(self._may_run, timeout=0.1)
                if key is not None:
                    self._run(key, handlers)

    def _injection(self, namespace: str, name: str) -> tuple[str, str] | None:
        return self._injected.get((namespace, name))

    def _may_run(self, key: Key) -> bool:
        return not self._paused.is_set() or key[0] in _ALWAYS

    def _run(self, key: Key, handlers: Mapping[str, Callable[..., float | None]]) -> None:
        kind, *args = key
        with self._idle:
            self._busy = key
        try:
            if not self._may_run(key):  # paused between the hand-out and now: later
                self._queue.add(key)
                return
            again = handlers[kind](*args)
            self._failures.pop(key, None)
            if again is not None:
                self._queue.add(key, again)
        except Exception as exc:
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            self._queue.add(key, min(0.05 * 2 ** (failures - 1), 5.0))
            if not isinstance(exc, (Retry, httpx.TransportError)):
                log.warning("stand-in controller: %s failed: %r", key, exc)
                self.errors.append(f"{key}: {exc!r}")
        finally:
            self._queue.done(key)
            with self._idle:
                self._busy = None
                self._idle.notify_all()


def _status_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """``sandboxStatusRelevantChange``: what of a Sandbox its claim reads (deletion, pod IPs,
    the Ready and Finished conditions)."""
    if rules.deleting(old) != rules.deleting(new):
        return True
    before, after = old.get("status") or {}, new.get("status") or {}
    if before.get("podIPs") != after.get("podIPs"):
        return True
    return any(
        rules.find_condition(before.get("conditions") or [], kind)
        != rules.find_condition(after.get("conditions") or [], kind)
        for kind in ("Ready", "Finished")
    )
