"""The ``/rpc`` control-plane dialect, as the identity brokers deployed today speak it.

``POST {broker}/rpc`` with a JSON body ``{"op": ..., ...}``: ``create``, ``status``, ``delete``
and ``extend`` (see docs/local-broker.md). Behind it are the same claims, owner checks,
attribution stamps and policy as behind ``/v1`` (:class:`._claims.Claims`); only the wire shapes
differ: broker-generated claim names (``broker-…``), a pinned namespace returned by create,
claim conditions instead of phases, ``204`` for any delete, and errors as a short plain-text
body instead of ``{"detail", "code"}``.

Data-plane requests to a sandbox created here carry ``X-Sandbox-Claim-Name``; the data-plane
forward checks that the claim is bound to the ``X-Sandbox-ID`` sandbox on every request
(:func:`..dataplane._forward.check_claim_binding`).
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import string
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..backends._interface import (
    PENDING,
    READY,
    TERMINATING,
    BackendUnavailable,
    ClaimNameTaken,
    ClaimState,
    rfc3339,
)
from ..backends._stamps import RPC_CLAIM, SCOPES
from ..common._errors import BACKEND_RETRY_AFTER, ApiError
from ..common._gate import Gate
from ..common._metadata import check_metadata
from ..common._observed import note_error, note_route, note_sandbox
from ..common._route_names import rpc_route
from ..identity._policy import Caller, Policy
from ._claims import Claims
from ._prefer import CLAMP_LIFETIME, applied, prefers

log = logging.getLogger("k8s_agent_sandbox_awx.broker")

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
_REASONS_KEPT = frozenset(
    {"WarmPoolNotFound", "TemplateNotFound", "InvalidMetadata", "VolumeClaimTemplatesError"}
)
"""Terminal reasons a Failed claim's condition keeps as upstream's controller writes them (the
clients know them); any other is ``crashed``, the reason in the message."""
_CLAIM_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ALPHABET = string.ascii_lowercase + string.digits
_PLAIN_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A delete's request_purpose written into the log line as it is (the original's
``create_cleanup``); any other is named, never written."""
_PLAIN_TEXT = "text/plain; charset=utf-8"


def plain_error(status: int, text: str, headers: Mapping[str, str] | None = None) -> Response:
    """An ``/rpc`` error: a short plain-text body (never a token: details name no secret)."""
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 3] + "..."
    return Response(text + "\n", status, headers=dict(headers or {}), media_type=_PLAIN_TEXT)


def _bad(detail: str, logged: str | None = None) -> ApiError:
    """A ``400 invalid_request`` (``logged``: its reason without the caller's values)."""
    return ApiError(400, "invalid_request", detail, logged=logged)


class Rpc:
    """The ``/rpc`` front-end of one broker (runs on the broker's event loop)."""

    def __init__(self, claims: Claims, gate: Gate) -> None:
        self.claims = claims
        self.gate = gate

    async def handle(self, request: Request) -> Response:
        if request.method != "POST":
            text = 'use POST /rpc with a JSON body {"op": ...}; ops: ' + ", ".join(OPS)
            note_error("method_not_allowed", text)
            return plain_error(405, text, {"Allow": "POST"})
        try:
            caller = await self.gate.authenticate(request)
            body = await self.gate.json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("op"), str):
                raise _bad(
                    'the body must be a JSON object with an "op" string: one of ' + ", ".join(OPS)
                )
            op = body["op"]
            note_route(rpc_route(op, OPS))
            if op == "create":
                return await self._create(body, caller, prefers(request.headers, CLAMP_LIFETIME))
            if op == "status":
                return await self._status(body, caller)
            if op == "delete":
                return await self._delete(body, caller)
            if op == "extend":
                return await self._extend(body, caller)
            if op in _UNSUPPORTED_OPS:
                raise _bad(f"op {op!r} is not served by the local broker (GKE snapshots only)")
            served = "this broker serves " + ", ".join(OPS)
            raise _bad(f"unknown op {op[:40]!r}; {served}", f"an unknown op; {served}")
        except ApiError as exc:
            note_error(exc.code, exc.logged)
            return plain_error(exc.status, exc.detail, exc.headers)
        except BackendUnavailable as exc:
            note_error("backend_unavailable", exc.detail)
            return plain_error(503, exc.detail, {"Retry-After": str(BACKEND_RETRY_AFTER)})

    # -- ops -----------------------------------------------------------------------------------
    async def _create(self, body: dict[str, Any], caller: Caller, clamp: bool) -> Response:
        """``clamp``: the lifetime is the client's default (``Prefer: clamp-lifetime``): one
        past the policy's cap is cut at it instead of refused."""
        _check_create_fields(body)
        policy = self.claims.policy(caller)
        labels, annotations = check_metadata(body)
        pod_labels, pod_annotations = check_metadata(body, "pod_labels", "pod_annotations")
        lifetime, clamped = _lifetime(body.get("lifecycle"), policy, clamp=clamp)
        scopes = _granted_scopes(body.get("scopes"), policy.scopes)
        pool, template, failure = await self._warm_pool(body.get("warmpool"), caller, policy)
        pod_metadata = {
            key: value
            for key, value in (("labels", pod_labels), ("annotations", pod_annotations))
            if value
        }
        while True:
            claim_name = _new_claim_name()
            try:
                created = await self.claims.admit(
                    caller,
                    policy,
                    template=template,
                    labels=labels,
                    annotations=annotations,
                    env={},
                    lifetime=lifetime,
                    scopes=scopes,
                    extra_stamps={
                        RPC_CLAIM: claim_name,
                        SCOPES: ",".join(sorted(scopes)),
                    },
                    claim_name=claim_name,
                    warm_pool=pool,
                    pod_metadata=pod_metadata,
                    failure=failure,
                )
            except ClaimNameTaken:
                continue
            break
        state = created.state
        log.info(
            "rpc: created claim %s (sandbox %s) for %s (%s)",
            claim_name,
            state.name,
            caller.subject,
            caller.provider,
        )
        return JSONResponse(
            {"claim_name": claim_name, "namespace": state.namespace},
            headers=applied(CLAMP_LIFETIME, clamped),
        )

    async def _warm_pool(
        self, pool: Any, caller: Caller, policy: Policy
    ) -> tuple[str, str, tuple[str, str] | None]:
        """A create's ``warmpool``: ``(pool, template, failure)`` (``None``: the policy's
        default template, its own pool)."""
        if pool is None:
            template = policy.effective_default_template
            return template, template, None
        if not isinstance(pool, str) or not _CLAIM_NAME.match(pool) or len(pool) > 253:
            raise _bad("'warmpool' must be a warm pool name (a DNS-1123 name)")
        resolved = await self.claims.resolve_pool(caller, policy, pool)
        return pool, resolved.template, resolved.failure

    async def _status(self, body: dict[str, Any], caller: Caller) -> Response:
        state = await self._claim(body, caller)
        return JSONResponse(
            {
                "sandbox_name": state.data_plane_name if state.bound else None,
                "namespace": state.namespace,
                "ready": state.phase == READY,
                "conditions": [_condition(state)],
            }
        )

    async def _delete(self, body: dict[str, Any], caller: Caller) -> Response:
        purpose = body.get("request_purpose")
        if purpose is not None and (not isinstance(purpose, str) or len(purpose) > 64):
            raise _bad("'request_purpose' must be a string of at most 64 characters")
        state = await self._lookup(_name(body), caller)
        if state is not None:
            await self.claims.delete(state)
            log.info(
                "rpc: deleting claim %s (sandbox %s)%s",
                _name(body),
                state.name,
                _purpose_shown(purpose),
            )
        return Response(status_code=204)

    async def _extend(self, body: dict[str, Any], caller: Caller) -> Response:
        state = await self._claim(body, caller)
        if body.get("lifecycle") is None:
            raise _bad("op 'extend' needs 'lifecycle': {\"shutdownTime\": RFC 3339 time}")
        requested = _shutdown_time(body["lifecycle"])
        if requested <= time.time():
            raise _bad(
                "lifecycle.shutdownTime is not in the future; to end the sandbox now use op "
                "'delete'"
            )
        cap = state.created_at + self.claims.policy(caller).max_lifetime_seconds
        state = await self.claims.set_expiry(state, min(requested, cap))
        return JSONResponse(
            {
                "claim_name": _name(body),
                "namespace": state.namespace,
                "shutdown_time": rfc3339(state.expires_at),
                "capped": requested > cap,
            }
        )

    # -- claims --------------------------------------------------------------------------------
    async def _claim(self, body: Mapping[str, Any], caller: Caller) -> ClaimState:
        name = _name(body)
        state = await self._lookup(name, caller)
        if state is None:
            raise ApiError(404, "not_found", f"claim {name!r} does not exist")
        return state

    async def _lookup(self, name: str, caller: Caller) -> ClaimState | None:
        """The live claim ``name`` (``None``: absent or being deleted); 403 if not the owner's."""
        state = await self.claims.find(caller, name)
        if state is None or state.phase == TERMINATING:
            return None
        if state.owner.key != caller.key:
            raise ApiError(
                403, "not_owner", f"claim {name!r} belongs to another identity; only its owner"
            )
        return state


def _check_create_fields(body: Mapping[str, Any]) -> None:
    """A create's fields are known ones, and its ``backend`` (if any) the one served."""
    unknown = sorted(set(body) - _CREATE_FIELDS)
    if unknown:
        allowed = f"allowed: {sorted(_CREATE_FIELDS)}"
        raise _bad(
            f"unknown create field(s) {unknown}; {allowed}",
            f"{len(unknown)} unknown create field(s); {allowed}",
        )
    backend = body.get("backend", "kubernetes")
    if backend != "kubernetes":
        only = "the only one is 'kubernetes'"
        raise _bad(
            f"backend {backend!r} is not available here; {only}",
            f"the backend the request names is not available here; {only}",
        )


def _purpose_shown(purpose: str | None) -> str:
    """A delete's ``request_purpose`` for the log line: a plain word (``create_cleanup``) as it
    is; any other text the caller sent is not written, its rule is."""
    if not purpose:
        return ""
    if _PLAIN_WORD.fullmatch(purpose):
        return f" for {purpose}"
    return " (its request_purpose is not shown: not a plain word)"


def _name(body: Mapping[str, Any]) -> str:
    name = body.get("claim_name")
    if not isinstance(name, str) or len(name) > 63 or not _CLAIM_NAME.match(name):
        raise _bad("'claim_name' must be the claim name that create returned")
    note_sandbox(claim=name)
    return name


def _new_claim_name() -> str:
    """A new claim name as the deployed brokers make them (the backend refuses one taken)."""
    return "broker-" + "".join(secrets.choice(_ALPHABET) for _ in range(10))


def _lifetime(lifecycle: Any, policy: Policy, *, clamp: bool = False) -> tuple[float, bool]:
    """A create's lifetime: its ``lifecycle.shutdownTime`` from now (clamped to the policy's
    cap within :data:`LIFETIME_TOLERANCE_SECONDS`, or at any distance with ``clamp``), else the
    cap; and whether ``clamp`` cut it."""
    cap = float(policy.max_lifetime_seconds)
    if lifecycle is None:
        return cap, False
    lifetime = _shutdown_time(lifecycle) - time.time()
    if lifetime <= 0:
        raise _bad("lifecycle.shutdownTime is in the past; give a time in the future")
    if clamp and lifetime > cap:
        return cap, True  # the client's default, not its caller's choice: cut at the cap
    if lifetime > cap + LIFETIME_TOLERANCE_SECONDS:
        raise _bad(
            f"lifecycle.shutdownTime is {math.ceil(lifetime)} s away, over the policy "
            f"maximum lifetime of {policy.max_lifetime_seconds} s"
        )
    return min(lifetime, cap), False


def _shutdown_time(lifecycle: Any) -> float:
    """``lifecycle`` (upstream's claim lifecycle spec) -> the shutdown time (epoch seconds)."""
    if not isinstance(lifecycle, dict):
        raise _bad(
            "'lifecycle' must be an object {\"shutdownTime\": RFC 3339 time, "
            '"shutdownPolicy": "Delete"}'
        )
    unknown = sorted(set(lifecycle) - {"shutdownTime", "shutdownPolicy"})
    if unknown:
        allowed = "allowed: shutdownTime, shutdownPolicy"
        raise _bad(
            f"unknown lifecycle field(s) {unknown}; {allowed}",
            f"{len(unknown)} unknown lifecycle field(s); {allowed}",
        )
    policy = lifecycle.get("shutdownPolicy", "Delete")
    if policy != "Delete":
        raise _bad(
            f"lifecycle.shutdownPolicy {policy!r} is not served here; use 'Delete'",
            "this lifecycle.shutdownPolicy is not served here; use 'Delete'",
        )
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
            logged=f"none of the requested scopes is allowed for this caller; allowed: "
            f"{list(allowed)}",
        )
    return granted


def _condition(record: ClaimState) -> dict[str, str]:
    """The claim's ``Ready`` condition as the deployed brokers report it."""
    if record.phase == READY:
        return _ready("True", "SandboxReady", record.message or "the sandbox is ready")
    if record.phase == PENDING:
        bound = record.bound
        return _ready(
            "False",
            "SandboxNotReady",
            "the sandbox is starting" if bound else "waiting for a sandbox to bind",
        )
    if record.phase == "Failed":
        if record.reason in _REASONS_KEPT:
            return _ready("False", record.reason, record.message or "")
        return _ready("False", "crashed", f"{record.reason}: {record.message}")
    return _ready("False", record.reason or record.phase, record.message or "")


def _ready(status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": "Ready", "status": status, "reason": reason, "message": message}
