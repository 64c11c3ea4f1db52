"""Upstream agent-sandbox's rules, as the stand-in controller applies them (no I/O here).

Reproduced from kubernetes-sigs/agent-sandbox at commit 2fd412d (v0.5.6 + 12, the commit the
stand-in CRDs in ``deploy/crds`` were written from); file references are to that tree:

- ``api/v1beta1/sandbox_types.go``, ``extensions/api/v1beta1/*_types.go``: label, annotation,
  reason and policy names;
- ``controllers/sandbox_controller.go``: the Sandbox's conditions (``computeReadyCondition``,
  ``computePodScheduledCondition``, ``computeFinishedCondition``,
  ``computeSuspendedCondition``), ``NameHash`` (FNV-1a, 8 hex digits), the labels a Pod gets
  (``isSystemLabel``, ``computeExtensionPodLabels``), expiry (``checkSandboxExpiry``);
- ``extensions/controllers/sandboxclaim_controller.go``: the claim's Ready condition
  (``computeReadyCondition``: reasons and messages), ``validateAdditionalPodMetadata``,
  ``mergePodMetadata``, ``injectEnvs``, ``mergeVolumeClaimTemplates``,
  ``ensureClaimIdentityLabels``; ``extensions/controllers/utils.go``:
  ``ApplySandboxSecureDefaults``; ``internal/lifecycle/expiry.go``: ``TimeLeft``;
- k8s.io/apimachinery ``meta.SetStatusCondition``: a condition keeps its
  ``lastTransitionTime`` unless its status changes.

Written from reading those files; no code is copied. Where Go's encoding cannot be reproduced
(the template hashes hash Go's JSON encoding of typed structs) the values differ from
upstream's but follow the same rule (same input, same hash).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

SANDBOX_API: Final = "agents.x-k8s.io/v1beta1"
EXTENSIONS_API: Final = "extensions.agents.x-k8s.io/v1beta1"
EXTENSIONS_GROUP: Final = "extensions.agents.x-k8s.io"

# labels and annotations (api/v1beta1/sandbox_types.go, extensions/api/v1beta1/*_types.go)
CLAIM_UID_LABEL: Final = "agents.x-k8s.io/claim-uid"
ASSIGNED_SANDBOX_ANNOTATION: Final = "agents.x-k8s.io/sandbox-name"
POD_NAME_ANNOTATION: Final = "agents.x-k8s.io/pod-name"
TEMPLATE_REF_ANNOTATION: Final = "agents.x-k8s.io/sandbox-template-ref"
LAUNCH_TYPE_LABEL: Final = "agents.x-k8s.io/launch-type"
CREATED_BY_LABEL: Final = "agents.x-k8s.io/created-by"
POD_TEMPLATE_HASH_LABEL: Final = "agents.x-k8s.io/sandbox-pod-template-hash"
TEMPLATE_HASH_LABEL: Final = "agents.x-k8s.io/sandbox-template-hash"
PROPAGATED_LABELS_ANNOTATION: Final = "agents.x-k8s.io/propagated-labels"
PROPAGATED_ANNOTATIONS_ANNOTATION: Final = "agents.x-k8s.io/propagated-annotations"
ADOPTABLE_LABEL: Final = "agents.x-k8s.io/adoptable"
WARM_POOL_LABEL: Final = "agents.x-k8s.io/warm-pool-sandbox"
TEMPLATE_REF_HASH_LABEL: Final = "agents.x-k8s.io/sandbox-template-ref-hash"
SANDBOX_NAME_HASH_LABEL: Final = "agents.x-k8s.io/sandbox-name-hash"
FIRST_OBSERVED_ANNOTATION: Final = "agents.x-k8s.io/controller-first-observed-at"
FIRST_READY_ANNOTATION: Final = "agents.x-k8s.io/claim-first-ready-at"
TRACE_CONTEXT_ANNOTATION: Final = "opentelemetry.io/trace-context"
SAFE_TO_EVICT_ANNOTATION: Final = "cluster-autoscaler.kubernetes.io/safe-to-evict"

# Ready reasons
DEPENDENCIES_READY: Final = "DependenciesReady"
DEPENDENCIES_NOT_READY: Final = "DependenciesNotReady"
SANDBOX_EXPIRED: Final = "SandboxExpired"
CLAIM_EXPIRED: Final = "ClaimExpired"
POD_SUCCEEDED: Final = "PodSucceeded"
POD_FAILED: Final = "PodFailed"
RECONCILER_ERROR: Final = "ReconcilerError"
TEMPLATE_NOT_FOUND: Final = "TemplateNotFound"
WARM_POOL_NOT_FOUND: Final = "WarmPoolNotFound"
INVALID_METADATA: Final = "InvalidMetadata"
ENV_VARS_INJECTION_REJECTED: Final = "EnvVarsInjectionRejected"
VOLUME_CLAIM_TEMPLATES_ERROR: Final = "VolumeClaimTemplatesError"
ADOPTION_CONFLICT: Final = "AdoptionConflict"
SANDBOX_CREATE_PENDING: Final = "SandboxCreatePending"
SANDBOX_MISSING: Final = "SandboxMissing"
SANDBOX_NOT_READY: Final = "SandboxNotReady"
TERMINAL_CLAIM_REASONS: Final = frozenset(
    {
        INVALID_METADATA,
        ENV_VARS_INJECTION_REJECTED,
        VOLUME_CLAIM_TEMPLATES_ERROR,
        CLAIM_EXPIRED,
        SANDBOX_EXPIRED,
        TEMPLATE_NOT_FOUND,
        WARM_POOL_NOT_FOUND,
    }
)
"""The reasons upstream's Python client stops waiting on (``TERMINAL_CLAIM_READY_REASONS`` in
its constants.py, and TemplateNotFound/WarmPoolNotFound, for which it raises errors of its own).
The controller itself retries the last two: a pool or template created later resumes the
claim."""

_RESTRICTED_DOMAINS: Final = ("kubernetes.io", "k8s.io", "agents.x-k8s.io")
DEFAULT_ALLOWED_LABEL_DOMAINS: Final = ("sandbox.users.io",)
_QUALIFIED_NAME: Final = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN: Final = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_LABEL_VALUE: Final = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def q(value: object) -> str:
    """Go's ``%q`` for the plain strings the messages quote."""
    return json.dumps(str(value))


# ------------------------------------------------------------------------------ names, times


def name_hash(name: str) -> str:
    """``NameHash``: FNV-1a (32 bits) of ``name`` as 8 lowercase hex digits."""
    value = 0x811C9DC5
    for byte in name.encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return f"{value:08x}"


def spec_hash(spec: object) -> str:
    """The stand-in's ``computeSandboxBlueprintHash`` / ``computePodTemplateHash``: the same
    rule over canonical JSON (Go hashes its own encoding, which differs)."""
    return name_hash(json.dumps(spec, sort_keys=True, separators=(",", ":")))


def now_time() -> str:
    """``metav1.Time`` as it is written: RFC 3339, seconds, UTC."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """``metav1.MicroTime``-like RFC 3339 with nanosecond digits (``time.RFC3339Nano``)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


# ------------------------------------------------------------------------------ objects


def meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("metadata") or {})


def labels_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict(meta(obj).get("labels") or {})


def annotations_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict(meta(obj).get("annotations") or {})


def uid(obj: Mapping[str, Any]) -> str:
    return str(meta(obj).get("uid", ""))


def deleting(obj: Mapping[str, Any]) -> bool:
    return bool(meta(obj).get("deletionTimestamp"))


def controller_of(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The owner reference with ``controller: true`` (``metav1.GetControllerOf``)."""
    for ref in meta(obj).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def controlled_by(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    ref = controller_of(obj)
    return ref is not None and ref.get("uid") == uid(owner)


def controller_kind(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(group, kind) of the controller reference, whatever its version (``MatchesGroupKind``)."""
    ref = controller_of(obj)
    if ref is None:
        return None
    return str(ref.get("apiVersion", "")).rpartition("/")[0], str(ref.get("kind", ""))


def owner_reference(owner: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    """``SetControllerReference``: controller and blockOwnerDeletion both true."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": meta(owner)["name"],
        "uid": uid(owner),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pool_of(sandbox: Mapping[str, Any]) -> str:
    """``getWarmPoolName``: the warm pool among the Sandbox's owners, if any."""
    refs = meta(sandbox).get("ownerReferences") or []
    ordered = sorted(refs, key=lambda ref: not ref.get("controller"))
    for ref in ordered:
        group = str(ref.get("apiVersion", "")).rpartition("/")[0]
        if group == EXTENSIONS_GROUP and ref.get("kind") == "SandboxWarmPool":
            return str(ref["name"])
    return ""


# ------------------------------------------------------------------------------ conditions


def find_condition(conditions: Sequence[Mapping[str, Any]], kind: str) -> dict[str, Any] | None:
    for condition in conditions:
        if condition.get("type") == kind:
            return dict(condition)
    return None


def condition(kind: str, status: str, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def set_condition(conditions: list[dict[str, Any]], new: Mapping[str, Any]) -> None:
    """``meta.SetStatusCondition``: add, or update in place keeping ``lastTransitionTime``
    unless the status changes (then the new one's, else now)."""
    for existing in conditions:
        if existing.get("type") == new["type"]:
            if existing.get("status") != new["status"]:
                existing["status"] = new["status"]
                existing["lastTransitionTime"] = new.get("lastTransitionTime") or now_time()
            for key in ("reason", "message", "observedGeneration"):
                existing[key] = new[key]
            return
    added = dict(new)
    added.setdefault("lastTransitionTime", now_time())
    if not added["lastTransitionTime"]:
        added["lastTransitionTime"] = now_time()
    conditions.append(added)


def remove_condition(conditions: list[dict[str, Any]], kind: str) -> None:
    conditions[:] = [c for c in conditions if c.get("type") != kind]


def is_ready(obj: Mapping[str, Any]) -> bool:
    found = find_condition((obj.get("status") or {}).get("conditions") or [], "Ready")
    return found is not None and found.get("status") == "True"


def ready_reason(obj: Mapping[str, Any]) -> str:
    found = find_condition((obj.get("status") or {}).get("conditions") or [], "Ready")
    return str(found.get("reason", "")) if found else ""


# ------------------------------------------------------------------------------ lifecycle


def time_left(
    now: datetime,
    shutdown_time: str | None,
    ttl_after_finished: int | None,
    finished: Mapping[str, Any] | None,
) -> tuple[bool, float]:
    """``lifecycle.TimeLeft``: (expired, seconds left; 0 when nothing expires). The earliest
    of ``shutdownTime`` and (with ``ttlSecondsAfterFinished``) the Finished condition's
    transition time plus the TTL; Finished counts only when True."""
    candidates = []
    if shutdown_time:
        candidates.append(parse_time(shutdown_time))
    finished_at = (finished or {}).get("lastTransitionTime")
    if ttl_after_finished is not None and (finished or {}).get("status") == "True" and finished_at:
        ends = parse_time(str(finished_at)).timestamp() + ttl_after_finished
        candidates.append(datetime.fromtimestamp(ends, UTC))
    if not candidates:
        return False, 0.0
    remaining = (min(candidates) - now).total_seconds()
    return (True, 0.0) if remaining <= 0 else (False, remaining)


# ------------------------------------------------------------------------------ claim rules


class ClaimFailure(Exception):
    """What a claim's reconcile stopped at, as upstream's Ready condition names it."""

    def __init__(
        self, reason: str, message: str, *, suppressed: bool = False, clears_sandbox: bool = False
    ) -> None:
        super().__init__(message)
        self.reason, self.message, self.suppressed = reason, message, suppressed
        self.clears_sandbox = clears_sandbox  # the claim's status.sandbox is emptied

    @classmethod
    def reconciler(cls, error: str) -> ClaimFailure:
        return cls(RECONCILER_ERROR, "Error seen: " + error)

    @classmethod
    def template_not_found(cls, template: str, prefix: str = "") -> ClaimFailure:
        return cls(TEMPLATE_NOT_FOUND, f"{prefix}SandboxTemplate {q(template)} not found")

    @classmethod
    def warm_pool_not_found(cls, pool: str) -> ClaimFailure:
        return cls(WARM_POOL_NOT_FOUND, f"SandboxWarmPool {q(pool)} not found")


def validate_additional_pod_metadata(
    metadata: Mapping[str, Any], allowed_domains: Sequence[str] = DEFAULT_ALLOWED_LABEL_DOMAINS
) -> str | None:
    """``validateAdditionalPodMetadata``: the error message, or None. Labels need a domain
    prefix in the allow-list and a valid value; annotations may not use a system domain
    (``kubernetes.io``, ``k8s.io``, ``agents.x-k8s.io`` and subdomains) except the
    autoscaler's safe-to-evict; every key must be a qualified name; the label
    ``app=sandbox-router`` is refused."""
    for kind, items in (
        ("label", metadata.get("labels")),
        ("annotation", metadata.get("annotations")),
    ):
        for key, value in (items or {}).items():
            error = _metadata_key_error(kind, str(key), str(value), allowed_domains)
            if error:
                return f"failed to validate {kind} {q(key)}: {error}"
    return None


def _metadata_key_error(kind: str, key: str, value: str, allowed: Sequence[str]) -> str | None:
    name_error = _qualified_name_error(key)
    if name_error:
        return f"invalid {kind} key: {q(key)}: {name_error}"
    is_label = kind == "label"
    if is_label and key.lower() == "app" and value.lower() == "sandbox-router":
        return (
            f"restricted system label value: {q(key)}={q(value)} is not allowed in "
            "AdditionalPodMetadata"
        )
    domain = key.split("/", 1)[0].lower() if "/" in key else ""
    if is_label and not domain:
        return (
            f"label {q(key)} must have a domain prefix (e.g. 'sandbox.users.io/my-label') to "
            "prevent opting into unintended policy domains"
        )
    if is_label and not _in_domains(domain, allowed):
        return f"label domain {q(domain)} is not in the allowlist"
    if (
        not is_label
        and _in_domains(domain, _RESTRICTED_DOMAINS)
        and key != SAFE_TO_EVICT_ANNOTATION
    ):
        return f"restricted system domain: {q(key)} is not allowed in AdditionalPodMetadata"
    if is_label and (len(value) > 63 or not _LABEL_VALUE.match(value)):
        return (
            f"invalid label value: {q(value)} does not match allowed pattern: a valid label "
            "must be an empty string or consist of alphanumeric characters, '-', '_' or "
            "'.', and must start and end with an alphanumeric character"
        )
    return None


def _in_domains(domain: str, domains: Sequence[str]) -> bool:
    return any(domain == d or domain.endswith("." + d) for d in domains)


def _qualified_name_error(key: str) -> str | None:
    """``validation.IsQualifiedName`` (shortened messages)."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return (
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
            "start and end with an alphanumeric character, at most 63 characters"
        )
    return None


def merge_pod_metadata(template: Mapping[str, Any], claim: Mapping[str, Any]) -> dict[str, Any]:
    """``mergePodMetadata``: the template's labels and annotations plus the claim's; a claim
    value that differs from the template's is refused (``ClaimFailure`` ReconcilerError)."""
    merged = copy.deepcopy(dict(template))
    for kind in ("labels", "annotations"):
        theirs = merged.get(kind) or {}
        for key, value in (claim.get(kind) or {}).items():
            if key in theirs and theirs[key] != value:
                singular = kind[:-1]
                raise ClaimFailure.reconciler(
                    f"metadata override conflict: {singular} {q(key)} is defined in template "
                    f"with value {q(theirs[key])}, but claim requests {q(value)}"
                )
        if claim.get(kind):
            merged[kind] = {**theirs, **claim[kind]}
    return merged


def claim_identity_labels(
    existing: Mapping[str, str] | None, claim: Mapping[str, Any]
) -> dict[str, str]:
    """``ensureClaimIdentityLabels``: the claim's uid, and its created-by label (or none)."""
    result = dict(existing or {})
    result[CLAIM_UID_LABEL] = uid(claim)
    created_by = labels_of(claim).get(CREATED_BY_LABEL)
    if created_by:
        result[CREATED_BY_LABEL] = created_by
    else:
        result.pop(CREATED_BY_LABEL, None)
    return result


def inject_envs(pod_spec: dict[str, Any], env: Sequence[Mapping[str, Any]], policy: str) -> None:
    """The env part of ``createSandbox`` and ``injectEnvs``: only with the template's policy
    ``Allowed`` (add, no override, no ``envFrom``) or ``Overrides``; entries without a
    container go to the first container."""
    if policy not in ("Allowed", "Overrides"):
        raise ClaimFailure(
            ENV_VARS_INJECTION_REJECTED,
            "environment variable injection rejected: environment variable injection is not "
            "allowed by the template policy",
            suppressed=True,
        )
    containers = list(pod_spec.get("initContainers") or []) + list(pod_spec.get("containers") or [])
    names = {c.get("name") for c in containers}
    for entry in env:
        target = entry.get("containerName")
        if target and target not in names:
            raise ClaimFailure.reconciler(
                f"target container {q(target)} not found in template for environment variable "
                f"{q(entry.get('name'))}"
            )
    for index, container in enumerate(pod_spec.get("containers") or []):
        wanted = [e for e in env if e.get("containerName") == container.get("name")]
        if index == 0:
            wanted += [e for e in env if not e.get("containerName")]
        if wanted:
            _inject_into(container, wanted, policy)
    for container in pod_spec.get("initContainers") or []:
        wanted = [e for e in env if e.get("containerName") == container.get("name")]
        if wanted:
            _inject_into(container, wanted, policy)


def _inject_into(container: dict[str, Any], env: Sequence[Mapping[str, Any]], policy: str) -> None:
    if policy == "Allowed" and container.get("envFrom"):
        raise ClaimFailure(
            ENV_VARS_INJECTION_REJECTED,
            f"environment variable injection rejected: container {q(container.get('name'))} "
            "uses EnvFrom sources; Allowed policy cannot safely prevent overriding "
            "EnvFrom-provided variables",
            suppressed=True,
        )
    current = container.setdefault("env", [])
    for entry in env:
        found = next((i for i, e in enumerate(current) if e.get("name") == entry["name"]), None)
        if found is None:
            current.append({"name": entry["name"], "value": entry["value"]})
        elif policy != "Overrides":
            raise ClaimFailure.reconciler(
                "environment variable override is not allowed by the template policy for "
                f"variable {q(entry['name'])}"
            )
        else:
            current[found] = {"name": entry["name"], "value": entry["value"]}


def _vct_error(message: str) -> ClaimFailure:
    return ClaimFailure(VOLUME_CLAIM_TEMPLATES_ERROR, message, suppressed=True)


def _validate_vcts(vcts: Sequence[Mapping[str, Any]]) -> str | None:
    seen: set[str] = set()
    for index, vct in enumerate(vcts):
        name = str((vct.get("metadata") or {}).get("name") or "")
        if not name:
            return f"invalid volume claim templates: name at index {index} is empty"
        if name in seen:
            return f"invalid volume claim templates: duplicate name {q(name)}"
        seen.add(name)
    return None


def merge_volume_claim_templates(
    template_vcts: Sequence[Mapping[str, Any]],
    claim_vcts: Sequence[Mapping[str, Any]],
    policy: str,
) -> list[dict[str, Any]]:
    """``createSandbox``'s volume claim templates: the template's alone (validated) when the
    claim has none; else merged per the template's policy (Disallowed: refused; Allowed:
    appended, a name the template has is refused; Overrides: replaced by name)."""
    error = _validate_vcts(template_vcts)
    if not claim_vcts:
        if error:
            raise _vct_error(f"invalid volume claim templates in template: {error}")
        return [dict(v) for v in template_vcts]
    prefix = "failed to merge volume claim templates: "
    if error:
        raise _vct_error(f"{prefix}template: {error}")
    error = _validate_vcts(claim_vcts)
    if error:
        raise _vct_error(f"{prefix}claim: {error}")
    if policy in ("Disallowed", ""):
        raise _vct_error(f"{prefix}volume claim templates are disallowed by the template")
    names = {str((v.get("metadata") or {}).get("name")) for v in template_vcts}
    if policy == "Allowed":
        for vct in claim_vcts:
            name = str((vct.get("metadata") or {}).get("name"))
            if name in names:
                raise _vct_error(
                    f"{prefix}overriding volume claim templates is forbidden by the template: "
                    f"cannot override template volume {q(name)}"
                )
        return [dict(v) for v in (*template_vcts, *claim_vcts)]
    by_name = {str((v.get("metadata") or {}).get("name")): dict(v) for v in claim_vcts}
    merged = [
        by_name.pop(str((v.get("metadata") or {}).get("name")), dict(v)) for v in template_vcts
    ]
    return merged + [v for v in by_name.values()]


def apply_secure_defaults(template_spec: Mapping[str, Any], pod_spec: dict[str, Any]) -> None:
    """``ApplySandboxSecureDefaults``: no service-account token unless asked for; with the
    managed default network policy, public DNS resolvers instead of the cluster's."""
    pod_spec.setdefault("automountServiceAccountToken", False)
    managed = template_spec.get("networkPolicyManagement", "Managed") in ("", "Managed")
    if managed and template_spec.get("networkPolicy") is None and not pod_spec.get("dnsPolicy"):
        pod_spec["dnsPolicy"] = "None"
        pod_spec["dnsConfig"] = {"nameservers": ["8.8.8.8", "1.1.1.1"]}


def blueprint(template: Mapping[str, Any]) -> dict[str, Any]:
    """The ``SandboxBlueprint`` part of a template's spec (what a Sandbox copies)."""
    spec = template.get("spec") or {}
    return {
        k: copy.deepcopy(spec[k])
        for k in ("podTemplate", "volumeClaimTemplates", "service")
        if k in spec
    }


def claim_ready_condition(
    claim: Mapping[str, Any],
    sandbox: Mapping[str, Any] | None,
    failure: ClaimFailure | None,
    expired: bool,
) -> dict[str, Any]:
    """``SandboxClaimReconciler.computeReadyCondition``."""
    generation = int(meta(claim).get("generation", 0))
    if failure is not None:
        return condition("Ready", "False", failure.reason, failure.message, generation)
    if expired:
        message = "Claim expired. Sandbox cleanup initiated."
        return condition("Ready", "False", CLAIM_EXPIRED, message, generation)
    if sandbox is None:
        return condition("Ready", "False", SANDBOX_MISSING, "Sandbox does not exist", generation)
    if ready_reason(sandbox) == SANDBOX_EXPIRED:
        message = "Underlying Sandbox resource has expired independently of the Claim."
        return condition("Ready", "False", SANDBOX_EXPIRED, message, generation)
    found = find_condition((sandbox.get("status") or {}).get("conditions") or [], "Ready")
    if found is not None:
        found["observedGeneration"] = generation
        return found
    return condition("Ready", "False", SANDBOX_NOT_READY, "Sandbox is not ready", generation)


# ------------------------------------------------------------------------------ sandbox rules


def is_system_key(key: str) -> bool:
    """``hasSystemReservedPrefix``: keys a user's pod template may not set on the Pod."""
    return key.startswith(("agents.x-k8s.io/", "extensions.agents.x-k8s.io/"))


def normalize_created_by(value: str) -> str:
    """``NormalizeCreatedBy``: one of the known creators, else ``unknown``."""
    return value if value in ("go-client", "python-client", "controller") else "unknown"


def extension_pod_labels(sandbox: Mapping[str, Any]) -> dict[str, str]:
    """``computeExtensionPodLabels``: the warm-pool label while a pool controls the Sandbox,
    and the template-ref hash while any extensions controller does."""
    kind = controller_kind(sandbox)
    if kind is None or kind[0] != EXTENSIONS_GROUP:
        return {}
    own, result = labels_of(sandbox), {}
    if kind[1] == "SandboxWarmPool" and own.get(WARM_POOL_LABEL):
        result[WARM_POOL_LABEL] = own[WARM_POOL_LABEL]
    if own.get(TEMPLATE_REF_HASH_LABEL):
        result[TEMPLATE_REF_HASH_LABEL] = own[TEMPLATE_REF_HASH_LABEL]
    return result


def pod_metadata(sandbox: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations the Sandbox controller gives its Pod (create path of
    ``reconcilePod``, and ``updatePodMetadata``): the template's minus system keys, the name
    hash, the extension labels, the normalized created-by, and the propagated-keys notes."""
    template_meta = ((sandbox.get("spec") or {}).get("podTemplate") or {}).get("metadata") or {}
    pod_labels = {
        k: v for k, v in (template_meta.get("labels") or {}).items() if not is_system_key(k)
    }
    pod_annotations = {
        k: v
        for k, v in (template_meta.get("annotations") or {}).items()
        if not is_system_key(k) and k != TRACE_CONTEXT_ANNOTATION
    }
    propagated = (",".join(sorted(pod_labels)), ",".join(sorted(pod_annotations)))
    pod_labels[SANDBOX_NAME_HASH_LABEL] = name_hash(meta(sandbox)["name"])
    pod_labels.update(extension_pod_labels(sandbox))
    created_by = labels_of(sandbox).get(CREATED_BY_LABEL)
    if created_by:
        pod_labels[CREATED_BY_LABEL] = normalize_created_by(created_by)
    pod_annotations[PROPAGATED_LABELS_ANNOTATION] = propagated[0]
    pod_annotations[PROPAGATED_ANNOTATIONS_ANNOTATION] = propagated[1]
    return pod_labels, pod_annotations


def sandbox_ready_condition(
    sandbox: Mapping[str, Any],
    error: str | None,
    pod: Mapping[str, Any] | None,
    service: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """``SandboxReconciler.computeReadyCondition``."""
    generation = int(meta(sandbox).get("generation", 0))
    if error is not None:
        return condition("Ready", "False", RECONCILER_ERROR, "Error seen: " + error, generation)
    spec = sandbox.get("spec") or {}
    if spec.get("operatingMode") == "Suspended":
        message = "Sandbox is suspending" if pod is not None else "Sandbox is suspended"
        return condition("Ready", "False", "SandboxSuspended", message, generation)
    phase = ((pod or {}).get("status") or {}).get("phase", "")
    if pod is not None and phase in ("Succeeded", "Failed"):
        reason = POD_SUCCEEDED if phase == "Succeeded" else POD_FAILED
        message = "Pod completed successfully" if phase == "Succeeded" else "Pod failed"
        return condition("Ready", "False", reason, message, generation)
    message, pod_ready = _pod_readiness(pod)
    wants_service = spec["service"] if spec.get("service") is not None else service is not None
    if wants_service:
        message += "; Service Exists" if service is not None else "; Service does not exist"
    if pod_ready and (service is not None or not wants_service):
        return condition("Ready", "True", DEPENDENCIES_READY, message, generation)
    return condition("Ready", "False", DEPENDENCIES_NOT_READY, message, generation)


def _pod_readiness(pod: Mapping[str, Any] | None) -> tuple[str, bool]:
    if pod is None:
        return "Pod does not exist", False
    status = pod.get("status") or {}
    phase = status.get("phase", "")
    if phase != "Running":
        return f"Pod exists with phase: {phase}", False
    ready = find_condition(status.get("conditions") or [], "Ready")
    if ready is None or ready.get("status") != "True":
        return "Pod is Running but not Ready", False
    if not status.get("podIPs"):
        return "Pod is Ready but has no podIPs yet", False
    return "Pod is Ready", True


def pod_scheduled_condition(
    sandbox: Mapping[str, Any], pod: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """``computePodScheduledCondition``: the Pod's PodScheduled, copied (absent without a
    Pod)."""
    if pod is None:
        return None
    generation = int(meta(sandbox).get("generation", 0))
    found = find_condition((pod.get("status") or {}).get("conditions") or [], "PodScheduled")
    if found is None:
        return condition(
            "PodScheduled",
            "Unknown",
            "PodSchedulingUnknown",
            "Pod has not reported a PodScheduled condition yet",
            generation,
        )
    status = str(found.get("status", "Unknown"))
    reason = found.get("reason") or ("PodScheduled" if status == "True" else "PodSchedulingUnknown")
    return condition("PodScheduled", status, reason, found.get("message") or "", generation)


def finished_condition(
    sandbox: Mapping[str, Any], pod: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """``computeFinishedCondition``: True once the Pod succeeded or failed."""
    phase = ((pod or {}).get("status") or {}).get("phase")
    if phase not in ("Succeeded", "Failed"):
        return None
    generation = int(meta(sandbox).get("generation", 0))
    if phase == "Succeeded":
        return condition(
            "Finished", "True", POD_SUCCEEDED, "Pod completed successfully", generation
        )
    return condition("Finished", "True", POD_FAILED, "Pod failed", generation)


def suspended_condition(
    sandbox: Mapping[str, Any], pod: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``computeSuspendedCondition``."""
    generation = int(meta(sandbox).get("generation", 0))
    if (sandbox.get("spec") or {}).get("operatingMode") != "Suspended":
        return condition(
            "Suspended", "False", "NotSuspended", "Sandbox is not suspended", generation
        )
    if pod is None:
        return condition(
            "Suspended",
            "True",
            "PodTerminated",
            "Pod has been terminated. Sandbox is suspended",
            generation,
        )
    return condition(
        "Suspended",
        "False",
        "PodTerminating",
        "Pod is terminating. Sandbox is suspending",
        generation,
    )


# ------------------------------------------------------------------------------ patches


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new`` (lists whole)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = value
    return patch
