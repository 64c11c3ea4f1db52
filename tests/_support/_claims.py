"""The stand-in SandboxClaim controller: upstream's ``SandboxClaimReconciler`` (behaviour of
``extensions/controllers/sandboxclaim_controller.go`` at 2fd412d).

One pass over a claim, as upstream's ``Reconcile`` does it:

1. stamp ``agents.x-k8s.io/controller-first-observed-at`` on the claim (one patch, once);
2. expiry (``spec.lifecycle``: ``shutdownTime``, or ``ttlSecondsAfterFinished`` after the
   ``Finished`` condition): first ``Ready=False`` reason ``ClaimExpired`` is written, then with
   ``shutdownPolicy`` ``Delete``/``DeleteForeground`` the claim is deleted (its Sandbox goes
   with it, by owner reference), with ``Retain`` the claim's Sandbox is deleted and the claim
   stays;
3. otherwise: ``additionalPodMetadata`` is validated (``InvalidMetadata``); the Sandbox is found
   (``status.sandbox.name``, the ``agents.x-k8s.io/sandbox-name`` annotation, the claim's own
   name) or adopted from the warm pool (not with ``env`` or ``volumeClaimTemplates``: those
   force a cold start) or created from the pool's template, named after the claim and owned by
   it (``WarmPoolNotFound``, ``TemplateNotFound``, ``EnvVarsInjectionRejected``,
   ``VolumeClaimTemplatesError``);
4. the status is computed (``Ready`` forwarded from the Sandbox, ``status.sandbox.name`` and
   ``podIPs``, ``Finished`` copied) and written through the status subresource with the
   claim's ``resourceVersion`` as a precondition (a conflict is dropped: the write that won
   brings another event); the first Ready stamps ``agents.x-k8s.io/claim-first-ready-at``.

Warm adoption (``getCandidate``, ``adoptSandboxFromCandidates``, ``completeAdoption``): the
pool's Sandboxes, oldest first, that have pod IPs; a Ready one is taken first, else the first
one not Ready yet. When the only candidates have no pod IP yet the claim waits for them up to
2 s after its creation (retrying every 0.5 s), then starts cold. Adopting records the Sandbox's
name in the claim's annotation ``agents.x-k8s.io/sandbox-name`` (optimistic lock), then moves
the Sandbox to the claim: controller reference to the claim, warm-pool labels removed,
``launch-type: warm``, ``agents.x-k8s.io/claim-uid`` on the Sandbox and its pod template,
the pod template's metadata from the template plus the claim's ``additionalPodMetadata``. The
Sandbox keeps its generated name.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tests._support import _agent_sandbox as rules
from tests._support._agent_sandbox import ClaimFailure, q
from tests._support._api import CLAIM, POOL, SANDBOX, TEMPLATE, Api, collection, path
from tests._support.kube import KubeError

WARM_CANDIDATE_GRACE = 2.0
WARM_CANDIDATE_RETRY = 0.5
DEPENDENCY_RETRY = 60.0
CACHE_LAG_RETRY = 0.2


@dataclass
class ClaimTiming:
    """The stand-in's own share of a claim's create-to-ready time (``time.perf_counter``).

    ``observed_at``: when its watch delivered the claim (or, if it was paused then, when it was
    resumed); ``ready_written_at``: when its write of ``Ready=True`` on the claim returned."""

    observed_at: float
    ready_written_at: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.ready_written_at is None else self.ready_written_at - self.observed_at


@dataclass(frozen=True)
class ClaimSettings:
    allowed_label_domains: tuple[str, ...] = rules.DEFAULT_ALLOWED_LABEL_DOMAINS
    observability_annotations: bool = True


class WarmCandidatesPending(Exception):
    """Warm candidates have no pod IP yet: try again in ``retry_after`` s, write nothing."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"warm candidates pending; again in {retry_after:.2f} s")
        self.retry_after = retry_after


class Retry(Exception):
    """The pass failed in a way upstream retries with back-off (its status is written)."""


def _adoption_conflict(message: str) -> ClaimFailure:
    return ClaimFailure(
        rules.ADOPTION_CONFLICT, f"{message}; the next pass retries from a converged view"
    )


class ClaimReconciler:
    def __init__(
        self,
        api: Api,
        settings: ClaimSettings,
        timings: dict[str, ClaimTiming],
        injected: Callable[[str, str], tuple[str, str] | None],
    ) -> None:
        self.api, self.settings, self.timings, self.injected = api, settings, timings, injected

    # ---------------------------------------------------------------------- one pass

    def reconcile(self, namespace: str, name: str) -> float | None:
        """One pass; the seconds after which to look again (None: on the next event)."""
        claim = self.api.get(path(CLAIM, namespace, name))
        if claim is None or rules.deleting(claim):
            return None
        claim = self._stamp_first_observed(claim)
        old_status = copy.deepcopy(claim.get("status") or {})
        claim["status"] = copy.deepcopy(old_status)
        expired, _ = self._time_left(claim)
        if expired and not _claim_expired(claim):
            return self._mark_expired(claim, old_status)
        policy = (claim["spec"].get("lifecycle") or {}).get("shutdownPolicy") or "Retain"
        if expired and policy in ("Delete", "DeleteForeground"):
            foreground = "Foreground" if policy == "DeleteForeground" else None
            self.api.delete(
                path(CLAIM, namespace, name), propagation=foreground, uid=rules.uid(claim)
            )
            return None
        sandbox, failure = None, None
        try:
            sandbox = self._expired(claim) if expired else self._active(claim)
        except WarmCandidatesPending as pending:
            return pending.retry_after
        except ClaimFailure as exc:
            failure = exc
        return self._finish(claim, old_status, sandbox, failure, expired)

    def _finish(
        self,
        claim: dict[str, Any],
        old_status: dict[str, Any],
        sandbox: dict[str, Any] | None,
        failure: ClaimFailure | None,
        expired: bool,
    ) -> float | None:
        self._set_status(claim, sandbox, failure, expired)
        post_expired, post_left = self._time_left(claim)
        if post_expired and not _claim_expired(claim):
            return self._mark_expired(claim, old_status)
        if self._write_status(claim, old_status):
            self._after_status(claim, old_status)
        again = None if expired else (0.001 if post_expired else (post_left or None))
        if failure is None:
            return again
        if failure.reason in (rules.WARM_POOL_NOT_FOUND, rules.TEMPLATE_NOT_FOUND):
            return min(DEPENDENCY_RETRY, again or DEPENDENCY_RETRY)
        if failure.reason == rules.SANDBOX_CREATE_PENDING:
            return min(CACHE_LAG_RETRY, again or CACHE_LAG_RETRY)
        if failure.suppressed:
            return again
        raise Retry(failure.message)

    def _mark_expired(self, claim: dict[str, Any], old_status: dict[str, Any]) -> float:
        ready = rules.claim_ready_condition(claim, None, None, True)
        rules.set_condition(claim["status"].setdefault("conditions", []), ready)
        self._write_status(claim, old_status)
        return 0.001

    def _time_left(self, claim: dict[str, Any]) -> tuple[bool, float]:
        lifecycle = claim["spec"].get("lifecycle")
        if not lifecycle:
            return False, 0.0
        finished = rules.find_condition(claim["status"].get("conditions") or [], "Finished")
        return rules.time_left(
            datetime.now(UTC),
            lifecycle.get("shutdownTime"),
            lifecycle.get("ttlSecondsAfterFinished"),
            finished,
        )

    def _stamp_first_observed(self, claim: dict[str, Any]) -> dict[str, Any]:
        if not self.settings.observability_annotations:
            return claim
        if rules.annotations_of(claim).get(rules.FIRST_OBSERVED_ANNOTATION):
            return claim
        patch = {"metadata": {"annotations": {rules.FIRST_OBSERVED_ANNOTATION: rules.now_micro()}}}
        return self.api.merge(_claim_path(claim), patch)

    # ---------------------------------------------------------------------- expired

    def _expired(self, claim: dict[str, Any]) -> dict[str, Any] | None:
        """``reconcileExpired`` (Retain): delete the claim's Sandbox, keep the claim."""
        metadata = claim["metadata"]
        name = (claim["status"].get("sandbox") or {}).get("name") or metadata["name"]
        sandbox = self.api.get(path(SANDBOX, metadata["namespace"], name))
        if sandbox is None:
            return None
        if not rules.controlled_by(sandbox, claim):
            raise ClaimFailure(
                rules.CLAIM_EXPIRED,
                f"Claim expired. sandbox not owned by this claim: sandbox {q(name)} is not owned "
                f"by claim {q(metadata['name'])}; deletion skipped.",
                suppressed=True,
                clears_sandbox=True,
            )
        if not rules.deleting(sandbox):
            self.api.delete(path(SANDBOX, metadata["namespace"], name), uid=rules.uid(sandbox))
        return sandbox

    # ---------------------------------------------------------------------- active

    def _active(self, claim: dict[str, Any]) -> dict[str, Any]:
        """``reconcileActive``: find, adopt or create the claim's Sandbox."""
        injected = self.injected(claim["metadata"]["namespace"], claim["metadata"]["name"])
        if injected is not None:
            raise ClaimFailure(*injected, suppressed=True)
        extra = claim["spec"].get("additionalPodMetadata") or {}
        error = rules.validate_additional_pod_metadata(extra, self.settings.allowed_label_domains)
        if error:
            raise ClaimFailure(
                rules.INVALID_METADATA, f"invalid additionalPodMetadata: {error}", suppressed=True
            )
        sandbox = self._find_or_adopt(claim)
        if sandbox is not None:
            return self._sync_metadata(claim, sandbox)
        return self._create(claim, self._template(claim))

    def _pool(self, claim: dict[str, Any]) -> dict[str, Any]:
        pool = claim["spec"]["warmPoolRef"]["name"]
        found = self.api.get(path(POOL, claim["metadata"]["namespace"], pool))
        if found is None:
            raise ClaimFailure.warm_pool_not_found(pool)
        return found

    def _template(self, claim: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """``getTemplate``: the claim's warm pool's template (``prefix``: the context upstream
        wraps the error in, which stays in the TemplateNotFound message)."""
        name = self._pool(claim)["spec"]["sandboxTemplateRef"]["name"]
        found = self.api.get(path(TEMPLATE, claim["metadata"]["namespace"], name))
        if found is None:
            raise ClaimFailure.template_not_found(name, prefix)
        return found

    def _find_or_adopt(self, claim: dict[str, Any]) -> dict[str, Any] | None:
        """``getOrCreateSandbox`` up to the cold start (which the caller does)."""
        namespace, own_name = claim["metadata"]["namespace"], claim["metadata"]["name"]
        recorded = (claim["status"].get("sandbox") or {}).get("name")
        if recorded:
            sandbox = self.api.get(path(SANDBOX, namespace, recorded))
            if sandbox is not None and rules.controlled_by(sandbox, claim):
                warm = recorded != own_name or self._assigned(claim) == recorded
                return self._launch_type(sandbox, "warm" if warm else "cold")
        assigned = self._assigned(claim)
        if assigned:
            sandbox = self._resume_assignment(claim, assigned)
            if sandbox is not None:
                return sandbox
        sandbox = self.api.get(path(SANDBOX, namespace, own_name))
        if sandbox is not None:
            if not rules.controlled_by(sandbox, claim):
                raise ClaimFailure.reconciler(
                    f"sandbox {q(own_name)} is not controlled by claim {q(own_name)}. Please use "
                    "a different claim name or delete the sandbox manually"
                )
            return self._launch_type(sandbox, "cold")
        if claim["spec"].get("env") or claim["spec"].get("volumeClaimTemplates"):
            return None  # custom configuration: no warm adoption
        return self._adopt(claim)

    def _assigned(self, claim: dict[str, Any]) -> str:
        return rules.annotations_of(claim).get(rules.ASSIGNED_SANDBOX_ANNOTATION, "")

    def _resume_assignment(self, claim: dict[str, Any], name: str) -> dict[str, Any] | None:
        """The Sandbox the claim's annotation names: its own, or still the pool's (finish the
        adoption), or another's or gone (the annotation is removed)."""
        sandbox = self.api.get(path(SANDBOX, claim["metadata"]["namespace"], name))
        if sandbox is not None and rules.controlled_by(sandbox, claim):
            return self._launch_type(sandbox, "warm")
        kind = rules.controller_kind(sandbox) if sandbox is not None else None
        pooled = sandbox is not None and kind == (rules.EXTENSIONS_GROUP, "SandboxWarmPool")
        if sandbox is not None and pooled and _candidate_error(sandbox, claim) is None:
            return self._complete_adoption(claim, sandbox)
        if sandbox is None or (kind is not None and kind[0] == rules.EXTENSIONS_GROUP):
            self._unassign(claim, name)  # gone, not adoptable, or another claim's
        return None

    def _launch_type(self, sandbox: dict[str, Any], launch_type: str) -> dict[str, Any]:
        """``initializeSandboxLaunchTypeLabel``: set the label once."""
        if rules.LAUNCH_TYPE_LABEL in rules.labels_of(sandbox):
            return sandbox
        patch = {"metadata": {"labels": {rules.LAUNCH_TYPE_LABEL: launch_type}}}
        return self.api.merge(_sandbox_path(sandbox), patch)

    def _unassign(self, claim: dict[str, Any], name: str) -> None:
        if self._assigned(claim) != name:
            return
        patch = {
            "metadata": {
                "resourceVersion": claim["metadata"]["resourceVersion"],
                "annotations": {rules.ASSIGNED_SANDBOX_ANNOTATION: None},
            }
        }
        self._update_claim(claim, self.api.merge(_claim_path(claim), patch))

    def _update_claim(self, claim: dict[str, Any], stored: dict[str, Any]) -> None:
        """Take the stored metadata and spec, keep the status this pass computes."""
        claim["metadata"], claim["spec"] = stored["metadata"], stored["spec"]

    # ---------------------------------------------------------------------- warm adoption

    def _adopt(self, claim: dict[str, Any]) -> dict[str, Any] | None:
        chosen, pending = self._candidate(claim)
        if chosen is not None:
            self._assign(claim, chosen["metadata"]["name"])
            return self._complete_adoption(claim, chosen)
        if pending:
            created = rules.parse_time(claim["metadata"]["creationTimestamp"]).timestamp()
            remaining = created + WARM_CANDIDATE_GRACE - time.time()
            if remaining > 0:
                raise WarmCandidatesPending(min(WARM_CANDIDATE_RETRY, remaining))
        return None

    def _candidate(self, claim: dict[str, Any]) -> tuple[dict[str, Any] | None, int]:
        """``getCandidate``: a Ready pool Sandbox with pod IPs, else the first not Ready one
        with pod IPs; and how many had no pod IP yet."""
        pool_name = claim["spec"]["warmPoolRef"]["name"]
        selector = {rules.WARM_POOL_LABEL: rules.name_hash(pool_name)}
        found = self.api.list(collection(SANDBOX, claim["metadata"]["namespace"]), selector)
        found.sort(key=lambda s: (s["metadata"]["creationTimestamp"], s["metadata"]["name"]))
        stale = self._stale_check(claim)
        fallback, pending = None, 0
        for sandbox in found:
            if _candidate_error(sandbox, claim) is not None or stale(sandbox):
                continue
            if not (sandbox.get("status") or {}).get("podIPs"):
                pending += 1
            elif rules.is_ready(sandbox):
                return sandbox, pending
            elif fallback is None:
                fallback = sandbox
        return fallback, pending

    def _stale_check(self, claim: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
        """Under the pool's ``Recreate`` strategy a Sandbox of an older template is not
        handed out (issue #764 upstream); ``OnReplenish`` hands out any."""
        pool = self.api.get(
            path(POOL, claim["metadata"]["namespace"], claim["spec"]["warmPoolRef"]["name"])
        )
        strategy = ((pool or {}).get("spec") or {}).get("updateStrategy") or {}
        if pool is None or strategy.get("type") != "Recreate":
            return lambda _sandbox: False
        template = self._template(claim)
        current = rules.spec_hash(rules.blueprint(template))
        return lambda sandbox: (
            rules.labels_of(sandbox).get(rules.TEMPLATE_HASH_LABEL) != current
            and not same_blueprint(template, sandbox)
        )

    def _assign(self, claim: dict[str, Any], name: str) -> None:
        """Record the adoption on the claim (annotation, optimistic lock, retried on 409)."""
        for _ in range(5):
            assigned = self._assigned(claim)
            if assigned and assigned != name:
                raise _adoption_conflict(
                    f"adoption write conflict: claim {claim['metadata']['name']} already assigned "
                    f"sandbox {assigned}"
                )
            patch = {
                "metadata": {
                    "resourceVersion": claim["metadata"]["resourceVersion"],
                    "annotations": {rules.ASSIGNED_SANDBOX_ANNOTATION: name},
                }
            }
            try:
                self._update_claim(claim, self.api.merge(_claim_path(claim), patch))
                return
            except KubeError as exc:
                if exc.status_code != 409:
                    raise
            fresh = self.api.get(_claim_path(claim))
            if fresh is None or rules.uid(fresh) != rules.uid(claim):
                raise _adoption_conflict(
                    f"adoption write conflict: claim {claim['metadata']['name']} was deleted and "
                    "recreated during adoption"
                )
            self._update_claim(claim, fresh)
        raise _adoption_conflict(f"adoption write conflict: claim {claim['metadata']['name']}")

    def _complete_adoption(self, claim: dict[str, Any], sandbox: dict[str, Any]) -> dict[str, Any]:
        """``completeAdoption`` (optimistic lock), and ``resolveAdoptionCompletion`` on a
        conflict: finished already, or still the pool's (again), or lost (unassigned)."""
        for _ in range(5):
            try:
                return self.api.replace(_sandbox_path(sandbox), self._adopted(claim, sandbox))
            except KubeError as exc:
                if exc.status_code not in (404, 409):
                    raise
            name = sandbox["metadata"]["name"]
            fresh = self.api.get(_sandbox_path(sandbox))
            if fresh is not None and rules.controlled_by(fresh, claim):
                return fresh
            if fresh is None or _candidate_error(fresh, claim) is not None:
                self._unassign(claim, name)
                lost = (
                    "deleted before adoption completed"
                    if fresh is None
                    else (f"is no longer adoptable by claim {claim['metadata']['name']}")
                )
                raise _adoption_conflict(f"adoption write conflict: sandbox {name} {lost}")
            sandbox = fresh
        raise _adoption_conflict(
            f"adoption write conflict: completing adoption of {sandbox['metadata']['name']}"
        )

    def _adopted(self, claim: dict[str, Any], sandbox: dict[str, Any]) -> dict[str, Any]:
        """The Sandbox moved from its pool to ``claim`` (``completeAdoption``)."""
        adopted = copy.deepcopy(sandbox)
        metadata = adopted["metadata"]
        own = metadata.setdefault("labels", {})
        template_hash = own.get(rules.TEMPLATE_REF_HASH_LABEL, "")
        for key in (
            rules.WARM_POOL_LABEL,
            rules.POD_TEMPLATE_HASH_LABEL,
            rules.TEMPLATE_HASH_LABEL,
        ):
            own.pop(key, None)
        own[rules.LAUNCH_TYPE_LABEL] = "warm"
        pod_template = adopted["spec"]["podTemplate"]
        pod_meta = pod_template.setdefault("metadata", {})
        if (pod_meta.get("annotations") or {}).get(rules.SAFE_TO_EVICT_ANNOTATION) == "true":
            del pod_meta["annotations"][rules.SAFE_TO_EVICT_ANNOTATION]
        metadata["ownerReferences"] = [rules.owner_reference(claim, *CLAIM)]
        metadata.setdefault("annotations", {})[rules.POD_NAME_ANNOTATION] = metadata["name"]
        metadata["labels"] = rules.claim_identity_labels(own, claim)
        pod_meta["labels"] = rules.claim_identity_labels(pod_meta.get("labels"), claim)
        try:
            template: dict[str, Any] | None = self._template(claim)
        except ClaimFailure:
            template = None
        if not template_hash and template is not None:
            template_hash = rules.name_hash(template["metadata"]["name"])
        if template_hash:
            metadata["labels"][rules.TEMPLATE_REF_HASH_LABEL] = template_hash
        extra = claim["spec"].get("additionalPodMetadata") or {}
        if template is not None:
            pod_template["metadata"] = self._pod_meta(claim, template, template_hash)
        else:
            if template_hash:
                pod_meta["labels"][rules.TEMPLATE_REF_HASH_LABEL] = template_hash
            pod_template["metadata"] = _compact(rules.merge_pod_metadata(pod_meta, extra))
        return adopted

    def _pod_meta(
        self, claim: dict[str, Any], template: dict[str, Any], ref_hash: str
    ) -> dict[str, Any]:
        """The pod template metadata a claim's Sandbox carries: the template's, the claim's
        uid, the template-ref hash, the claim's created-by, its ``additionalPodMetadata``."""
        merged = copy.deepcopy((template["spec"].get("podTemplate") or {}).get("metadata") or {})
        merged["labels"] = rules.claim_identity_labels(merged.get("labels"), claim)
        if ref_hash:
            merged["labels"][rules.TEMPLATE_REF_HASH_LABEL] = ref_hash
        extra = claim["spec"].get("additionalPodMetadata") or {}
        return _compact(rules.merge_pod_metadata(merged, extra))

    def _sync_metadata(self, claim: dict[str, Any], sandbox: dict[str, Any]) -> dict[str, Any]:
        """``reconcileActive``'s fast path: keep the Sandbox's pod metadata and identity labels
        as the claim and template say. Without the template that is only an error when the
        claim has metadata to propagate."""
        extra = claim["spec"].get("additionalPodMetadata") or {}
        try:
            template = self._template(claim, "failed to get template for metadata propagation: ")
        except ClaimFailure:
            if extra.get("labels") or extra.get("annotations"):
                raise
            return sandbox
        ref_hash = rules.name_hash(template["metadata"]["name"])
        wanted = copy.deepcopy(sandbox)
        wanted["spec"]["podTemplate"]["metadata"] = self._pod_meta(claim, template, ref_hash)
        own = wanted["metadata"].setdefault("labels", {})
        own[rules.TEMPLATE_REF_HASH_LABEL] = ref_hash
        created_by = rules.labels_of(claim).get(rules.CREATED_BY_LABEL)
        if created_by:
            own[rules.CREATED_BY_LABEL] = created_by
        else:
            own.pop(rules.CREATED_BY_LABEL, None)
        current = _compact(sandbox["spec"]["podTemplate"].get("metadata") or {})
        if wanted["spec"]["podTemplate"]["metadata"] == current and own == rules.labels_of(sandbox):
            return sandbox
        try:
            return self.api.replace(_sandbox_path(sandbox), wanted)
        except KubeError as exc:
            raise ClaimFailure.reconciler(
                f"failed to patch sandbox metadata for claim {q(claim['metadata']['name'])}: "
                f"{exc.status.get('message', exc)}"
            ) from None

    # ---------------------------------------------------------------------- cold start

    def _create(self, claim: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
        """``createSandbox``: a Sandbox named after the claim, owned by it, from the
        template's blueprint with the claim's volume claim templates, metadata and env."""
        metadata, spec, tspec = claim["metadata"], claim["spec"], template["spec"]
        body_spec = rules.blueprint(template)
        volumes = rules.merge_volume_claim_templates(
            tspec.get("volumeClaimTemplates") or [],
            spec.get("volumeClaimTemplates") or [],
            tspec.get("volumeClaimTemplatesPolicy") or "Disallowed",
        )
        body_spec.pop("volumeClaimTemplates", None)
        if volumes:
            body_spec["volumeClaimTemplates"] = volumes
        ref_hash = rules.name_hash(template["metadata"]["name"])
        own = rules.claim_identity_labels({}, claim)
        own.update({rules.LAUNCH_TYPE_LABEL: "cold", rules.TEMPLATE_REF_HASH_LABEL: ref_hash})
        pod_template = body_spec["podTemplate"]
        pod_meta = pod_template.get("metadata") or {}
        pod_meta["labels"] = rules.claim_identity_labels(pod_meta.get("labels"), claim)
        pod_meta["labels"][rules.TEMPLATE_REF_HASH_LABEL] = ref_hash
        pod_template["metadata"] = _compact(
            rules.merge_pod_metadata(pod_meta, spec.get("additionalPodMetadata") or {})
        )
        if spec.get("env"):
            rules.inject_envs(
                pod_template["spec"],
                spec["env"],
                tspec.get("envVarsInjectionPolicy") or "Disallowed",
            )
        rules.apply_secure_defaults(tspec, pod_template["spec"])
        body = {
            "apiVersion": SANDBOX[0],
            "kind": SANDBOX[1],
            "spec": body_spec,
            "metadata": {
                "name": metadata["name"],
                "namespace": metadata["namespace"],
                "labels": own,
                "annotations": {rules.TEMPLATE_REF_ANNOTATION: template["metadata"]["name"]},
                "ownerReferences": [rules.owner_reference(claim, *CLAIM)],
            },
        }
        try:
            return self.api.create(collection(SANDBOX, metadata["namespace"]), body)
        except KubeError as exc:
            if exc.status_code == 409:
                raise ClaimFailure(
                    rules.SANDBOX_CREATE_PENDING,
                    "Sandbox already created; waiting for cache to converge",
                ) from None
            raise ClaimFailure.reconciler(
                f"sandbox create error: {exc.status.get('message', exc)}"
            ) from None

    # ---------------------------------------------------------------------- status

    def _set_status(
        self,
        claim: dict[str, Any],
        sandbox: dict[str, Any] | None,
        failure: ClaimFailure | None,
        expired: bool,
    ) -> None:
        """``computeAndSetStatus``."""
        status = claim["status"]
        pending = failure is not None and failure.reason == rules.SANDBOX_CREATE_PENDING
        if sandbox is None and pending and (status.get("sandbox") or {}).get("name"):
            return
        conditions = status.setdefault("conditions", [])
        rules.set_condition(
            conditions, rules.claim_ready_condition(claim, sandbox, failure, expired)
        )
        if sandbox is not None:
            finished = rules.find_condition(
                (sandbox.get("status") or {}).get("conditions") or [], "Finished"
            )
            if finished is not None:
                rules.set_condition(conditions, finished)
            else:
                rules.remove_condition(conditions, "Finished")
        elif not expired:
            rules.remove_condition(conditions, "Finished")
        if sandbox is not None:
            ips = (sandbox.get("status") or {}).get("podIPs")
            status["sandbox"] = {
                "name": sandbox["metadata"]["name"],
                **({"podIPs": ips} if ips else {}),
            }
        elif (failure is None or failure.clears_sandbox) and "sandbox" in status:
            status["sandbox"] = {}

    def _write_status(self, claim: dict[str, Any], old_status: dict[str, Any]) -> bool:
        """``updateStatus``: a merge patch of the status subresource with the claim's
        ``resourceVersion`` as precondition; False when it lost to another write."""
        new_status = claim["status"]
        for status in (old_status, new_status):
            if "conditions" in status:
                status["conditions"].sort(key=lambda c: c["type"])
        if new_status == old_status:
            return True
        patch = {
            "metadata": {"resourceVersion": claim["metadata"]["resourceVersion"]},
            "status": rules.merge_patch(old_status, new_status),
        }
        try:
            stored = self.api.merge(_claim_path(claim, "status"), patch)
        except KubeError as exc:
            if exc.status_code in (404, 409):
                return exc.status_code == 404
            raise
        claim["metadata"] = stored["metadata"]
        return True

    def _after_status(self, claim: dict[str, Any], old_status: dict[str, Any]) -> None:
        """A claim that just became Ready: its timing, and the first-ready annotation."""
        was_ready = rules.is_ready({"status": old_status})
        if was_ready or not rules.is_ready(claim):
            return
        timing = self.timings.get(rules.uid(claim))
        if timing is not None and timing.ready_written_at is None:
            timing.ready_written_at = time.perf_counter()
        if not rules.annotations_of(claim).get(rules.FIRST_READY_ANNOTATION):
            patch = {"metadata": {"annotations": {rules.FIRST_READY_ANNOTATION: rules.now_micro()}}}
            self.api.merge(_claim_path(claim), patch)


def _claim_path(claim: dict[str, Any], sub: str | None = None) -> str:
    return path(CLAIM, claim["metadata"]["namespace"], claim["metadata"]["name"], sub)


def _sandbox_path(sandbox: dict[str, Any]) -> str:
    return path(SANDBOX, sandbox["metadata"]["namespace"], sandbox["metadata"]["name"])


def _claim_expired(claim: dict[str, Any]) -> bool:
    return rules.ready_reason(claim) == rules.CLAIM_EXPIRED


def _compact(metadata: dict[str, Any]) -> dict[str, Any]:
    """Pod metadata without empty maps (Go's ``omitempty``), so that stored and computed
    compare equal."""
    return {k: v for k, v in metadata.items() if v}


def _candidate_error(sandbox: dict[str, Any], claim: dict[str, Any]) -> str | None:
    """``verifySandboxCandidate`` and ``isAdoptable``: why ``sandbox`` cannot be adopted."""
    own = rules.labels_of(sandbox)
    if sandbox["metadata"].get("namespace") != claim["metadata"].get("namespace"):
        return "cross-namespace adoption forbidden"
    if rules.deleting(sandbox):
        return "sandbox is deleted"
    if rules.WARM_POOL_LABEL not in own:
        return "sandbox is missing the warm pool sandbox label"
    if rules.TEMPLATE_REF_HASH_LABEL not in own:
        return "sandbox is missing the sandbox template ref hash label"
    if rules.controller_kind(sandbox) != (rules.EXTENSIONS_GROUP, "SandboxWarmPool"):
        return "sandbox is not managed by warm pool"
    if rules.pool_of(sandbox) != claim["spec"]["warmPoolRef"]["name"]:
        return f"incorrect warm pool, expected {claim['spec']['warmPoolRef']['name']}"
    return None


def same_blueprint(template: dict[str, Any], sandbox: dict[str, Any]) -> bool:
    """``compareSandboxBlueprint``: the pod spec (with the secure defaults applied), the volume
    claim templates' names and specs, and ``service``."""
    tspec, sspec = template.get("spec") or {}, sandbox.get("spec") or {}
    expected_pod = copy.deepcopy((tspec.get("podTemplate") or {}).get("spec") or {})
    rules.apply_secure_defaults(tspec, expected_pod)
    if expected_pod != (sspec.get("podTemplate") or {}).get("spec"):
        return False

    def volumes(spec: dict[str, Any]) -> list[tuple[Any, Any]]:
        return [
            ((v.get("metadata") or {}).get("name"), v.get("spec"))
            for v in spec.get("volumeClaimTemplates") or []
        ]

    return volumes(tspec) == volumes(sspec) and tspec.get("service") == sspec.get("service")
