"""The ``/rpc`` control-plane dialect, as the identity brokers deployed today speak it.

``POST {broker}/rpc`` with a JSON body ``{"op": ..., ...}``: ``create``, ``status``, ``delete``
and ``extend`` (see docs/local-broker.md). Behind it are the same records, owner checks,
attribution stamps and policy as behind ``/v1`` (``BrokerApp._admit``); only the wire shapes
differ: broker-generated claim names (``broker-…``), a pinned namespace returned by create,
claim conditions instead of phases, ``204`` for any delete, and errors as a short plain-text
body instead of ``{"detail", "code"}``.

Data-plane requests to a sandbox created here carry ``X-Sandbox-Claim-Name``; the broker checks
that the claim is bound to the ``X-Sandbox-ID`` sandbox on every request
(:meth:`RpcEndpoint.check_data_request`).
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ._app import ApiError, BrokerApp, SandboxRecord, _rfc3339, check_metadata
from .identity._issuer import TrustedIssuer
from .identity._policy import RESERVED_PREFIX, Caller

log = logging.getLogger("k8s_agent_sandbox_awx.testing")

OPS = ("create", "status", "delete", "extend")
"""The ops the local broker serves under ``/rpc``."""

DEFAULT_WARM_POOL = "python-sandbox-warmpool"
"""The original package's default warm pool: the local broker maps it to template ``python``."""

MAX_ERROR_CHARS = 300
"""Plain-text error bodies are cut to this many characters (clients show the first 200)."""

LIFETIME_TOLERANCE_SECONDS = 2.0
"""A create's shutdown time this little past the policy cap is clamped, not refused (the
client computed it from its own clock, with whole seconds)."""

_UNSUPPORTED_OPS = frozenset(
    {
        "snapshot_create",
        "snapshot_status",
        "snapshot_list",
        "snapshot_delete",
        "lifecycle_status",
        "suspend",
        "resume",
        "restore",
    }
)
_CREATE_FIELDS = frozenset(
    {
        "op",
        "warmpool",
        "labels",
        "annotations",
        "pod_labels",
        "pod_annotations",
        "lifecycle",
        "scopes",
        "backend",
    }
)
_CLAIM_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ALPHABET = string.ascii_lowercase + string.digits
_PLAIN_TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class RpcClaim:
    """What ``/rpc`` adds to a sandbox record: the claim's name, warm pool, pod metadata and
    the scopes granted at create."""

    claim_name: str
    warm_pool: str
    scopes: frozenset[str]
    pod_metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    backend: str = "kubernetes"

    def stamps(self) -> dict[str, str]:
        """Attribution stamps added to the claim (visible under ``/v1`` too)."""
        return {
            RESERVED_PREFIX + "rpc-claim": self.claim_name,
            RESERVED_PREFIX + "scopes": ",".join(sorted(self.scopes)),
        }


def plain_error(status: int, text: str, headers: Mapping[str, str] | None = None) -> Response:
    """An ``/rpc`` error: a short plain-text body (never a token: details name no secret)."""
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 3] + "..."
    return Response(text + "\n", status, headers=dict(headers or {}), media_type=_PLAIN_TEXT)


def _bad(detail: str) -> ApiError:
    return ApiError(400, "invalid_request", detail)


class RpcEndpoint:
    """The ``/rpc`` handler of one :class:`BrokerApp` (runs on the broker's event loop)."""

    def __init__(self, app: BrokerApp, warm_pools: Mapping[str, str]) -> None:
        self.app = app
        self.warm_pools = dict(warm_pools)

    async def handle(self, request: Request) -> Response:
        if request.method != "POST":
            return plain_error(
                405,
                'use POST /rpc with a JSON body {"op": ...}; ops: ' + ", ".join(OPS),
                {"Allow": "POST"},
            )
        app = self.app
        try:
            app._check_unavailable("control", "/rpc")
            caller, issuer = await app._authenticate(request)
            body = await app._json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("op"), str):
                raise _bad(
                    'the body must be a JSON object with an "op" string: one of ' + ", ".join(OPS)
                )
            op = body["op"]
            if op == "create":
                return self._create(body, caller, issuer)
            if op == "status":
                return self._status(body, caller)
            if op == "delete":
                return self._delete(body, caller)
            if op == "extend":
                return self._extend(body, caller, issuer)
            if op in _UNSUPPORTED_OPS:
                raise _bad(f"op {op!r} is not served by the local broker (GKE snapshots only)")
            raise _bad(f"unknown op {op[:40]!r}; this broker serves " + ", ".join(OPS))
        except ApiError as exc:
            return plain_error(exc.status, exc.detail, exc.headers)

    # -- ops -----------------------------------------------------------------------------------
    def _create(self, body: dict[str, Any], caller: Caller, issuer: TrustedIssuer) -> Response:
        unknown = sorted(set(body) - _CREATE_FIELDS)
        if unknown:
            raise _bad(f"unknown create field(s) {unknown}; allowed: {sorted(_CREATE_FIELDS)}")
        policy = issuer.policy
        labels, annotations = check_metadata(body)
        pod_labels, pod_annotations = check_metadata(body, "pod_labels", "pod_annotations")
        backend = body.get("backend", "kubernetes")
        if backend != "kubernetes":
            raise _bad(f"backend {backend!r} is not available here; the only one is 'kubernetes'")
        lifetime = float(policy.max_lifetime_seconds)
        if body.get("lifecycle") is not None:
            deadline = _shutdown_time(body["lifecycle"])
            lifetime = deadline - time.time()
            if lifetime <= 0:
                raise _bad("lifecycle.shutdownTime is in the past; give a time in the future")
            if lifetime > policy.max_lifetime_seconds + LIFETIME_TOLERANCE_SECONDS:
                raise _bad(
                    f"lifecycle.shutdownTime is {math.ceil(lifetime)} s away, over the policy "
                    f"maximum lifetime of {policy.max_lifetime_seconds} s"
                )
            lifetime = min(lifetime, float(policy.max_lifetime_seconds))
        scopes = _granted_scopes(body.get("scopes"), policy.scopes)
        pool = body.get("warmpool")
        failure: tuple[str, str] | None = None
        if pool is None:
            template = policy.effective_default_template
            pool = template
        elif not isinstance(pool, str) or not _CLAIM_NAME.match(pool) or len(pool) > 253:
            raise _bad("'warmpool' must be a warm pool name (a DNS-1123 name)")
        elif pool not in self.warm_pools:
            template = pool
            failure = (
                "WarmPoolNotFound",
                f"warm pool {pool!r} does not exist; known: {sorted(self.warm_pools)}",
            )
        else:
            template = self.warm_pools[pool]
            if template not in self.app.templates:  # checked first, as under /v1
                failure = (
                    "TemplateNotFound",
                    f"warm pool {pool!r} refers to template {template!r}, which does not exist",
                )
            elif template not in policy.templates:
                raise ApiError(
                    403,
                    "template_not_allowed",
                    f"provider {caller.provider!r} may not use warm pool {pool!r} (template "
                    f"{template!r}); allowed templates: {list(policy.templates)}",
                )
        pod_metadata = {
            key: value
            for key, value in (("labels", pod_labels), ("annotations", pod_annotations))
            if value
        }
        claim = RpcClaim(self._new_claim_name(), pool, scopes, pod_metadata, backend)
        record = self.app._admit(
            caller,
            policy,
            template=template,
            labels=labels,
            annotations=annotations,
            env={},
            lifetime=lifetime,
            rpc=claim,
            failure=failure,
        )
        log.info(
            "rpc: created claim %s (sandbox %s) for %s (%s)",
            claim.claim_name,
            record.name,
            caller.subject,
            caller.provider,
        )
        return JSONResponse({"claim_name": claim.claim_name, "namespace": record.namespace})

    def _status(self, body: dict[str, Any], caller: Caller) -> Response:
        record = self._claim(body, caller)
        self.app._check_alive(record)
        return JSONResponse(
            {
                "sandbox_name": record.name if record.handle is not None else None,
                "namespace": record.namespace,
                "ready": record.phase == "Ready",
                "conditions": [_condition(record)],
            }
        )

    def _delete(self, body: dict[str, Any], caller: Caller) -> Response:
        purpose = body.get("request_purpose")
        if purpose is not None and (not isinstance(purpose, str) or len(purpose) > 64):
            raise _bad("'request_purpose' must be a string of at most 64 characters")
        record = self._lookup(self._name(body), caller)
        if record is not None:
            self.app.begin_delete(record)
            log.info(
                "rpc: deleting claim %s (sandbox %s)%s",
                self._name(body),
                record.name,
                f" for {purpose}" if purpose else "",
            )
        return Response(status_code=204)

    def _extend(self, body: dict[str, Any], caller: Caller, issuer: TrustedIssuer) -> Response:
        record = self._claim(body, caller)
        if body.get("lifecycle") is None:
            raise _bad("op 'extend' needs 'lifecycle': {\"shutdownTime\": RFC 3339 time}")
        requested = _shutdown_time(body["lifecycle"])
        if requested <= time.time():
            raise _bad(
                "lifecycle.shutdownTime is not in the future; to end the sandbox now use op "
                "'delete'"
            )
        cap = record.created_at + issuer.policy.max_lifetime_seconds
        record.expires_at = min(requested, cap)
        self.app.schedule_expiry(record)
        return JSONResponse(
            {
                "claim_name": self._name(body),
                "namespace": record.namespace,
                "shutdown_time": _rfc3339(record.expires_at),
                "capped": requested > cap,
            }
        )

    # -- claims --------------------------------------------------------------------------------
    def _name(self, body: Mapping[str, Any]) -> str:
        name = body.get("claim_name")
        if not isinstance(name, str) or len(name) > 63 or not _CLAIM_NAME.match(name):
            raise _bad("'claim_name' must be the claim name that create returned")
        return name

    def _claim(self, body: Mapping[str, Any], caller: Caller) -> SandboxRecord:
        name = self._name(body)
        record = self._lookup(name, caller)
        if record is None:
            raise ApiError(404, "not_found", f"claim {name!r} does not exist")
        return record

    def _lookup(self, name: str, caller: Caller) -> SandboxRecord | None:
        """The live claim ``name`` (``None``: absent or being deleted); 403 if not the owner's."""
        with self.app.lock:
            record = next(
                (
                    r
                    for r in self.app.sandboxes.values()
                    if r.rpc is not None and r.rpc.claim_name == name
                ),
                None,
            )
        if record is None or record.phase == "Terminating":
            return None
        if record.owner.key != caller.key:
            raise ApiError(
                403, "not_owner", f"claim {name!r} belongs to another identity; only its owner"
            )
        return record

    def _new_claim_name(self) -> str:
        with self.app.lock:
            taken = {r.rpc.claim_name for r in self.app.history if r.rpc is not None}
        while True:
            name = "broker-" + "".join(secrets.choice(_ALPHABET) for _ in range(10))
            if name not in taken:
                return name

    # -- data plane ----------------------------------------------------------------------------
    def check_data_request(self, request: Request, record: SandboxRecord) -> None:
        """The claim <-> sandbox binding check, on every data-plane request (after the owner
        check): a sandbox created through ``/rpc`` needs ``X-Sandbox-Claim-Name`` naming its
        claim; a ``/v1`` sandbox's claim has the sandbox's own name."""
        header = request.headers.get("x-sandbox-claim-name")
        bound = record.rpc.claim_name if record.rpc is not None else record.name
        if header is None:
            if record.rpc is None:
                return
            raise ApiError(
                403,
                "claim_required",
                f"sandbox {record.name!r} was created through /rpc: send X-Sandbox-Claim-Name "
                "with the claim name that create returned",
            )
        if header != bound:
            raise ApiError(
                403,
                "claim_mismatch",
                f"claim {header[:63]!r} is not bound to sandbox {record.name!r}; send the claim "
                "name that create returned, and the sandbox name its status reported",
            )


def _shutdown_time(lifecycle: Any) -> float:
    """``lifecycle`` (upstream's claim lifecycle spec) -> the shutdown time (epoch seconds)."""
    if not isinstance(lifecycle, dict):
        raise _bad(
            "'lifecycle' must be an object {\"shutdownTime\": RFC 3339 time, "
            '"shutdownPolicy": "Delete"}'
        )
    unknown = sorted(set(lifecycle) - {"shutdownTime", "shutdownPolicy"})
    if unknown:
        raise _bad(f"unknown lifecycle field(s) {unknown}; allowed: shutdownTime, shutdownPolicy")
    policy = lifecycle.get("shutdownPolicy", "Delete")
    if policy != "Delete":
        raise _bad(f"lifecycle.shutdownPolicy {policy!r} is not served here; use 'Delete'")
    raw = lifecycle.get("shutdownTime")
    try:
        if not isinstance(raw, str):
            raise ValueError
        moment = datetime.fromisoformat(raw)
        if moment.tzinfo is None:
            raise ValueError
    except ValueError:
        raise _bad(
            "lifecycle.shutdownTime must be an RFC 3339 time with a zone, e.g. 2026-01-01T12:00:00Z"
        ) from None
    return moment.timestamp()


def _granted_scopes(requested: Any, allowed: tuple[str, ...]) -> frozenset[str]:
    """``allowed ∩ requested``; all of ``allowed`` when nothing is requested; 403 if empty."""
    if requested is None or requested == []:
        return frozenset(allowed)
    if not isinstance(requested, list) or not all(isinstance(s, str) for s in requested):
        raise _bad("'scopes' must be a list of scope names")
    granted = frozenset(allowed) & frozenset(requested)
    if not granted:
        raise ApiError(
            403,
            "scope_denied",
            f"none of the requested scopes {sorted(set(requested))[:8]} is allowed for this "
            f"caller; allowed: {list(allowed)}",
        )
    return granted


def _condition(record: SandboxRecord) -> dict[str, str]:
    """The claim's ``Ready`` condition as the deployed brokers report it."""
    if record.phase == "Ready":
        return _ready("True", "SandboxReady", record.message or "the sandbox is ready")
    if record.phase == "Pending":
        bound = record.handle is not None
        return _ready(
            "False",
            "SandboxNotReady",
            "the sandbox is starting" if bound else "waiting for a sandbox to bind",
        )
    if record.phase == "Failed":
        if record.reason in ("WarmPoolNotFound", "TemplateNotFound"):
            return _ready("False", record.reason, record.message or "")
        return _ready("False", "crashed", f"{record.reason}: {record.message}")
    return _ready("False", record.reason or record.phase, record.message or "")


def _ready(status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": "Ready", "status": status, "reason": reason, "message": message}
