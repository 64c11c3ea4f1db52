"""SandboxClaims as the broker writes and reads them: names, stamps, the object, the state.

Every fact the broker keeps about a sandbox is in its claim (docs/broker/kubernetes.md):

- **the name**: with an Idempotency-Key ``sbx-`` + the first 20 characters of
  base32(sha256(issuer NUL subject NUL key)), lowercased (a DNS label: a retry on another
  replica finds the claim instead of making a second); without one ``sbx-`` + 10 random
  base32 characters; an ``/rpc`` claim has the name its front-end chose (``broker-…``);
- **the owner**: the annotations ``issuer``, ``subject``, ``provider``, ``created-at`` and
  ``attr.<name>`` under :data:`RESERVED_PREFIX` (the broker's stamps, made by its claims
  logic: :mod:`.._stamps`), and the label :data:`OWNER_LABEL` = the first 40 hex characters of
  sha256(issuer NUL subject) (label values are at most 63 characters) to list them by;
- **the request**: ``request-digest`` (an idempotent create's body, to tell a repeat from a
  conflict), ``template``, ``scopes``, ``metadata`` (which labels and annotations are the
  caller's, so that the controller's own are not shown as theirs), ``reservation`` (the
  deadline of the quota ledger's reservation it was made under, :mod:`._quota`), ``env`` (the
  create's ``env`` as a JSON object: its commands' environment, which the broker hands the
  runtime with each command start; never ``spec.env``, which upstream's controller would put
  in the pod, so in the runtime's own environment, and which would make every such claim a
  cold start);
- **the lifetime**: ``spec.lifecycle`` ``{shutdownTime, shutdownPolicy: Delete}``: the
  controller deletes the claim at its expiry; an extension patches ``shutdownTime``.

:func:`claim_object` builds the object a :class:`ClaimRequest` stands for; :func:`state_of`
reads a claim back as a :class:`KubeClaimState` (the phase from its ``Ready`` condition as
upstream's controller writes it, see :data:`TERMINAL_REASONS`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from .._interface import (
    ENV_ANNOTATION,
    FAILED,
    PENDING,
    READY,
    TERMINATING,
    ClaimRequest,
    ClaimState,
    Owner,
    rfc3339,
)
from .._stamps import (
    CREATED_AT,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    RESERVED_PREFIX,
    RPC_CLAIM,
    SCOPES,
    stamped_owner,
)

__all__ = [
    "MANAGED_BY_SELECTOR",
    "OWNER_LABEL",
    "RESERVED_PREFIX",
    "TERMINAL_REASONS",
    "KubeClaimState",
    "claim_object",
    "keyed_name",
    "owner_hash",
    "random_name",
    "reservation_token",
    "state_of",
]

OWNER_LABEL: Final = RESERVED_PREFIX + "owner"
MANAGED_BY_SELECTOR: Final = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
"""The label selector of every claim the broker made (its informer lists and watches these)."""

DIGEST: Final = RESERVED_PREFIX + "request-digest"
TEMPLATE: Final = RESERVED_PREFIX + "template"
METADATA: Final = RESERVED_PREFIX + "metadata"
RESERVATION: Final = RESERVED_PREFIX + "reservation"
"""The deadline of the quota ledger's reservation the claim was made under (``._quota``): a
ledger entry with that deadline is this claim's, made."""
ENV: Final = ENV_ANNOTATION  # RESERVED_PREFIX + "env"
BOOKKEEPING: Final = frozenset({DIGEST, METADATA, RESERVATION, ENV})
"""Annotations the broker reads itself and does not show among a sandbox's stamps."""

CLAIM_EXPIRED: Final = "ClaimExpired"
TERMINAL_REASONS: Final = frozenset(
    {
        "InvalidMetadata",
        "EnvVarsInjectionRejected",
        "VolumeClaimTemplatesError",
        "SandboxExpired",
        "TemplateNotFound",
        "WarmPoolNotFound",
    }
)
"""The claim's ``Ready=False`` reasons that make the sandbox Failed: upstream client's terminal
reasons (``ClaimExpired`` aside: the claim is then Terminating, reason ``Expired``) and the two
not-found ones (which the controller still retries: a pool made later resumes the claim). A
``Finished=True`` condition (the pod ended) is Failed too; any other reason is Pending."""

NEVER: Final = 253402300799.0
"""9999-12-31T23:59:59Z: the expiry of a claim without ``spec.lifecycle.shutdownTime``."""
_BASE32_LOWER: Final = "abcdefghijklmnopqrstuvwxyz234567"


@dataclass(frozen=True)
class KubeClaimState(ClaimState):
    """A claim read from the API server: the interface's state and what routes need."""

    pod_ips: tuple[str, ...] = ()
    """``status.sandbox.podIPs`` (the pod data plane's address)."""
    resource_version: str = ""
    server_created_at: float = 0.0
    """``metadata.creationTimestamp`` (the API server's clock: the quota's order)."""
    request_digest: str | None = None
    """The digest of the idempotent create that made it (``None``: made without a key)."""


# ------------------------------------------------------------------------------ names


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(parts).encode()).digest()


def owner_hash(owner: Owner) -> str:
    """The owner label's value: the first 40 hex characters of sha256(issuer NUL subject)."""
    return _digest(owner.issuer, owner.subject).hex()[:40]


def keyed_name(owner: Owner, key: str) -> str:
    """The claim name of ``owner``'s create with Idempotency-Key ``key`` (the same on every
    replica)."""
    encoded = base64.b32encode(_digest(owner.issuer, owner.subject, key)).decode()
    return "sbx-" + encoded[:20].lower()


def reservation_token(until: float) -> str:
    """The ``reservation`` annotation of a claim made under a reservation until ``until``."""
    return str(round(until))


def random_name() -> str:
    """A claim name for a create without a key (another is drawn when it is taken)."""
    return "sbx-" + "".join(secrets.choice(_BASE32_LOWER) for _ in range(10))


# ------------------------------------------------------------------------------ writing


def claim_object(
    request: ClaimRequest, name: str, reservation: float | None = None
) -> dict[str, Any]:
    """The SandboxClaim ``request`` stands for, named ``name`` (``request.claim_name`` for an
    ``/rpc`` claim), made under the quota ledger's reservation of deadline ``reservation``."""
    if request.failure is not None:  # only a backend that resolves pools itself makes these
        raise ValueError(
            f"a Kubernetes claim cannot be made Failed ({request.failure[0]}): the controller "
            "decides whether its warm pool exists"
        )
    annotations = {**request.annotations, **request.stamps}
    annotations[TEMPLATE] = request.template
    annotations[SCOPES] = ",".join(sorted(request.scopes))
    keys = {"labels": sorted(request.labels), "annotations": sorted(request.annotations)}
    annotations[METADATA] = json.dumps(keys, separators=(",", ":"))
    if request.idempotency is not None:
        annotations[DIGEST] = request.idempotency.digest
    if reservation is not None:
        annotations[RESERVATION] = reservation_token(reservation)
    labels = {**request.labels, OWNER_LABEL: owner_hash(request.owner)}
    labels[MANAGED_BY_LABEL] = MANAGED_BY
    spec: dict[str, Any] = {
        "warmPoolRef": {"name": request.warm_pool or request.template},
        "lifecycle": {
            "shutdownTime": rfc3339(request.created_at + request.lifetime_seconds),
            "shutdownPolicy": "Delete",
        },
    }
    if request.env:  # the commands' environment: never spec.env, which is the pod's
        annotations[ENV] = json.dumps(dict(request.env), separators=(",", ":"))
    if request.pod_metadata:
        spec["additionalPodMetadata"] = {k: dict(v) for k, v in request.pod_metadata.items()}
    metadata = {"name": name, "namespace": request.namespace, "labels": labels}
    return {"metadata": {**metadata, "annotations": annotations}, "spec": spec}


# ------------------------------------------------------------------------------ reading


def parse_time(value: Any) -> float | None:
    """An RFC 3339 time as the API server writes it, in epoch seconds (``None``: absent or
    not a time)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for condition in status.get("conditions") or ():
        if isinstance(condition, Mapping) and condition.get("type") == kind:
            return condition
    return {}


def _phase(
    meta: Mapping[str, Any], status: Mapping[str, Any], expires_at: float, now: float
) -> tuple[str, str | None, str | None]:
    """(phase, reason, message) of a claim."""
    ready, finished = _condition(status, "Ready"), _condition(status, "Finished")
    reason, message = ready.get("reason") or None, ready.get("message") or None
    expired = reason == CLAIM_EXPIRED or now >= expires_at
    if meta.get("deletionTimestamp"):
        why = "Expired" if expired else "Deleted"
        return TERMINATING, why, f"the sandbox is being deleted ({why})"
    if expired:
        return TERMINATING, "Expired", "the sandbox's lifetime ended; it is being deleted"
    if finished.get("status") == "True":
        return FAILED, str(finished.get("reason") or "Finished"), finished.get("message") or None
    if ready.get("status") == "True":
        return READY, str(reason or "SandboxReady"), message
    if reason in TERMINAL_REASONS:
        return FAILED, str(reason), message
    return PENDING, reason, message


def _env(annotations: Mapping[str, str], spec: Mapping[str, Any]) -> dict[str, str]:
    """The sandbox's environment: the :data:`ENV` annotation (a claim of an older broker: its
    ``spec.env``, which its pod also holds)."""
    try:
        env = json.loads(annotations[ENV]) if ENV in annotations else None
    except ValueError:
        env = None
    if isinstance(env, dict):
        return {str(k): str(v) for k, v in env.items()}
    return {str(e.get("name")): str(e.get("value", "")) for e in spec.get("env") or ()}


def _started_at(ready: Mapping[str, Any], created: float) -> float:
    """When the claim's sandbox became Ready for it: its ``Ready`` condition's
    ``lastTransitionTime``, but never before the claim was made. The controller forwards the
    Sandbox's own condition (sandboxclaim_controller.go ``computeReadyCondition``), so a Sandbox
    adopted from a warm pool brings the time it warmed up, before the claim existed: the
    sandbox became the caller's when the claim was made (adoption is at once)."""
    return max(parse_time(ready.get("lastTransitionTime")) or created, created)


def _user_keys(annotations: Mapping[str, str]) -> tuple[set[str], set[str]]:
    try:
        keys = json.loads(annotations.get(METADATA, "{}"))
    except ValueError:
        keys = {}
    if not isinstance(keys, dict):
        keys = {}
    return set(keys.get("labels") or ()), set(keys.get("annotations") or ())


def state_of(obj: Mapping[str, Any], now: float | None = None) -> KubeClaimState:
    """The state of the claim ``obj`` (as of ``now``: an expired one is Terminating)."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    status = obj.get("status") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    user_labels, user_annotations = _user_keys(annotations)
    server_created = parse_time(meta.get("creationTimestamp")) or 0.0
    created = parse_time(annotations.get(CREATED_AT)) or server_created
    expires = parse_time((spec.get("lifecycle") or {}).get("shutdownTime")) or NEVER
    phase, reason, message = _phase(meta, status, expires, time.time() if now is None else now)
    sandbox = status.get("sandbox") or {}
    ready = _condition(status, "Ready")
    name = str(meta.get("name", ""))
    return KubeClaimState(
        name=name,
        namespace=str(meta.get("namespace", "")),
        template=annotations.get(TEMPLATE) or str((spec.get("warmPoolRef") or {}).get("name")),
        owner=stamped_owner(annotations),
        labels={k: v for k, v in labels.items() if k in user_labels},
        annotations={k: v for k, v in annotations.items() if k in user_annotations},
        stamps={
            k: v
            for k, v in annotations.items()
            if k.startswith(RESERVED_PREFIX) and k not in BOOKKEEPING
        },
        env=_env(annotations, spec),
        created_at=created,
        expires_at=expires,
        phase=phase,
        reason=reason,
        message=message,
        transition_at=max(parse_time(ready.get("lastTransitionTime")) or 0.0, server_created),
        started_at=_started_at(ready, created) if phase == READY else None,
        bound=bool(sandbox.get("name")),
        scopes=frozenset(s for s in annotations.get(SCOPES, "").split(",") if s),
        uid=str(meta.get("uid", "")),
        claim_name=name if RPC_CLAIM in annotations else None,
        warm_pool=(spec.get("warmPoolRef") or {}).get("name"),
        pod_metadata=spec.get("additionalPodMetadata") or {},
        sandbox_name=sandbox.get("name") or None,
        pod_ips=tuple(str(ip) for ip in sandbox.get("podIPs") or ()),
        resource_version=str(meta.get("resourceVersion", "")),
        server_created_at=server_created,
        request_digest=annotations.get(DIGEST),
    )
