"""The broker API v1 (``/v1/...``, docs/broker-api.md): its routes and wire shapes only.

Requests are parsed and answered here; what they do is :class:`._claims.Claims`' (policy,
quota, attribution, idempotency) over the backend. Errors are ``{"detail", "code"}``
(:class:`..common._errors.ApiError`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..backends._interface import PENDING, RUNTIME_PORT, ClaimState, Idempotency, rfc3339
from ..common._errors import ApiError
from ..common._gate import Gate
from ..common._metadata import check_env, check_metadata, check_name, check_qualified_key
from ..identity._policy import Caller
from ._claims import Claims
from ._prefer import CLAMP_LIFETIME, applied, prefers

log = logging.getLogger("k8s_agent_sandbox_awx.broker")

API_VERSION = "v1"
_CREATE_FIELDS = frozenset({"template", "labels", "annotations", "lifetime_seconds", "env"})
_IDEMPOTENCY_KEY = re.compile(r"^[\x20-\x7e]{1,255}$")


def sandbox_json(state: ClaimState) -> dict[str, Any]:
    """A sandbox as the v1 API shows it."""
    return {
        "name": state.name,
        "namespace": state.namespace,
        "template": state.template,
        "phase": state.phase,
        "ready": state.phase == "Ready",
        "reason": state.reason,
        "message": state.message,
        "created_at": rfc3339(state.created_at),
        "started_at": rfc3339(state.started_at) if state.started_at is not None else None,
        "expires_at": rfc3339(state.expires_at),
        "labels": dict(state.labels),
        "annotations": {**state.annotations, **state.stamps},
        "owner": {
            "provider": state.owner.provider,
            "issuer": state.owner.issuer,
            "subject": state.owner.subject,
        },
        "router": {"sandbox_id": state.name, "namespace": state.namespace, "port": RUNTIME_PORT},
    }


class V1:
    """The ``/v1`` front-end of one broker."""

    def __init__(self, claims: Claims, gate: Gate) -> None:
        self.claims = claims
        self.gate = gate

    async def handle(self, request: Request) -> Response:
        """Answer one request whose path is ``/v1`` or below it."""
        path, method = request.url.path, request.method
        if path == "/v1/healthz":
            if method != "GET":
                raise _no_route(method, path)
            return JSONResponse({"status": "ok", "api_version": API_VERSION})
        if path == "/v1/whoami" and method == "GET":
            caller = await self.gate.authenticate(request)
            return JSONResponse(self._whoami(caller))
        if path == "/v1/sandboxes" and method in ("POST", "GET"):
            caller = await self.gate.authenticate(request)
            if method == "POST":
                return await self._create(request, caller)
            return await self._list(request, caller)
        if path.startswith("/v1/sandboxes/") and path.count("/") == 3:
            name = path.rsplit("/", 1)[1]
            if method in ("GET", "DELETE"):
                check_name(name)
                caller = await self.gate.authenticate(request)
                if method == "GET":
                    return await self._get(request, caller, name)
                return await self._delete(caller, name)
        elif path.startswith("/v1/sandboxes/") and path.count("/") == 4:
            name, _, sub = path[len("/v1/sandboxes/") :].partition("/")
            if sub == "lifetime" and method == "PUT":
                check_name(name)
                caller = await self.gate.authenticate(request)
                return await self._extend(request, caller, name)
        raise _no_route(method, path)

    def _whoami(self, caller: Caller) -> dict[str, Any]:
        policy = self.claims.describe(caller, self.claims.policy(caller))
        return {
            "provider": caller.provider,
            "issuer": caller.issuer,
            "subject": caller.subject,
            "audience": caller.audience,
            "expires_at": rfc3339(caller.expires_at),
            "attributes": dict(caller.attributes),
            "policy": policy,
        }

    # -- create --------------------------------------------------------------------------------
    async def _create(self, request: Request, caller: Caller) -> Response:
        key = request.headers.get("idempotency-key")
        if key is not None and not _IDEMPOTENCY_KEY.match(key):
            raise ApiError(
                400,
                "invalid_header",
                "Idempotency-Key must be 1-255 printable ASCII characters",
            )
        raw = await self.gate.json_body(request)
        policy = self.claims.policy(caller)
        clamp = prefers(request.headers, CLAMP_LIFETIME)
        fields = _create_fields(raw, policy.max_lifetime_seconds, clamp=clamp)
        clamped = applied(CLAMP_LIFETIME, fields.pop("clamped"))
        digest = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
        replay = await self.claims.replay(caller, key, digest) if key is not None else None
        replayed = {"Idempotency-Replayed": "true", **clamped}
        if replay is not None:
            return JSONResponse(sandbox_json(replay), 200, headers=replayed)
        template = fields.pop("template") or policy.effective_default_template
        await self.claims.check_template(caller, policy, template)
        created = await self.claims.admit(
            caller,
            policy,
            template=template,
            scopes=frozenset(policy.scopes),
            idempotency=Idempotency(key, digest) if key is not None else None,
            **fields,
        )
        state = created.state
        if created.replayed:  # the claim an earlier create with this key made (a replica's)
            return JSONResponse(sandbox_json(state), 200, headers=replayed)
        log.info("created sandbox %s for %s (%s)", state.name, caller.subject, caller.provider)
        return JSONResponse(sandbox_json(state), 201, headers=clamped)

    # -- the caller's sandboxes ----------------------------------------------------------------
    async def _get(self, request: Request, caller: Caller, name: str) -> Response:
        params = request.query_params
        wait = params.get("wait")
        if wait not in (None, "ready"):
            raise ApiError(400, "invalid_request", f"wait={wait!r}: the only value is 'ready'")
        timeout = 30.0
        if "timeout" in params:
            try:
                timeout = float(params["timeout"])
            except ValueError:
                timeout = -1.0
            if not 0 <= timeout <= 60:
                raise ApiError(
                    400, "invalid_request", "timeout must be a number of seconds from 0 to 60"
                )
        state = await self.claims.owned(caller, name)
        if wait == "ready" and state.phase == PENDING and timeout > 0:
            state = await self.claims.wait_ready(state, timeout)
        return JSONResponse(sandbox_json(state))

    async def _list(self, request: Request, caller: Caller) -> Response:
        selector = _label_selector(request.query_params.get("label_selector"))
        mine = [
            s
            for s in await self.claims.mine(caller)
            if all(s.labels.get(k) == v for k, v in selector.items())
        ]
        mine.sort(key=lambda s: s.created_at, reverse=True)
        return JSONResponse({"items": [sandbox_json(s) for s in mine]})

    async def _delete(self, caller: Caller, name: str) -> Response:
        state = await self.claims.delete(await self.claims.owned(caller, name))
        return JSONResponse(sandbox_json(state), 202)

    async def _extend(self, request: Request, caller: Caller, name: str) -> Response:
        body = await self.gate.json_body(request)
        if not isinstance(body, dict) or set(body) != {"seconds"}:
            raise ApiError(
                400, "invalid_request", 'the body must be {"seconds": N} (N a positive integer)'
            )
        seconds = body["seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds <= 0:
            raise ApiError(400, "invalid_request", "'seconds' must be a positive integer")
        state = await self.claims.owned(caller, name)
        if state.ending:
            raise ApiError(409, "terminating", f"sandbox {name!r} is being deleted")
        cap = self.claims.policy(caller).max_lifetime_seconds
        now = time.time()
        if now + seconds > state.created_at + cap:
            left = max(0, int(state.created_at + cap - now))
            raise ApiError(
                403,
                "lifetime_exceeds_policy",
                f"sandbox {name!r} cannot live {seconds} s more: its policy caps a sandbox's "
                f"lifetime at {cap} s from its creation (created {rfc3339(state.created_at)}), so "
                f"it ends at the latest at {rfc3339(state.created_at + cap)}; at most {left} s "
                "are left",
            )
        state = await self.claims.set_expiry(state, now + seconds)
        log.info("sandbox %s now expires in %d s", name, seconds)
        return JSONResponse(sandbox_json(state))


def _no_route(method: str, path: str) -> ApiError:
    return ApiError(
        404, "not_found", f"no route for {method} {path}", logged="no v1 route for this request"
    )


def _create_fields(body: Any, max_lifetime: int, *, clamp: bool = False) -> dict[str, Any]:
    """A v1 create body, checked: ``template`` (``None``: the policy's default), ``labels``,
    ``annotations``, ``lifetime`` (default and cap: ``max_lifetime``; ``clamp``: one past the
    cap is cut at it, not refused, and ``clamped`` says so) and ``env``."""
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "the body must be a JSON object")
    unknown = sorted(set(body) - _CREATE_FIELDS)
    if unknown:
        allowed = f"allowed: {sorted(_CREATE_FIELDS)}"
        raise ApiError(
            400,
            "invalid_request",
            f"unknown field(s) {unknown}; {allowed}",
            logged=f"{len(unknown)} unknown field(s); {allowed}",
        )
    template = body.get("template")
    if template is not None and (not isinstance(template, str) or not template):
        raise ApiError(400, "invalid_request", "'template' must be a non-empty string or null")
    labels, annotations = check_metadata(body)
    lifetime = body.get("lifetime_seconds")
    if lifetime is None:
        lifetime = max_lifetime
    if isinstance(lifetime, bool) or not isinstance(lifetime, int) or lifetime <= 0:
        raise ApiError(400, "invalid_request", "'lifetime_seconds' must be a positive integer")
    clamped = clamp and lifetime > max_lifetime
    if clamped:
        lifetime = max_lifetime  # the client's default, not its caller's choice: cut at the cap
    if lifetime > max_lifetime:
        raise ApiError(
            403,
            "lifetime_exceeds_policy",
            f"'lifetime_seconds' {lifetime} is over the policy's cap of {max_lifetime} s "
            "from creation; ask for at most that",
        )
    env = check_env(body.get("env"))
    return {
        "template": template,
        "labels": labels,
        "annotations": annotations,
        "lifetime": lifetime,
        "env": env,
        "clamped": clamped,
    }


def _label_selector(raw: str | None) -> dict[str, str]:
    """``label_selector``: ``key=value`` terms (equality only), comma-separated."""
    selector: dict[str, str] = {}
    for term in raw.split(",") if raw else ():
        k, sep, v = term.partition("=")
        bad = ApiError(
            400,
            "invalid_request",
            f"label_selector term {term!r} is not 'key=value' (equality only)",
        )
        if not sep or not k.strip() or v.startswith("="):
            raise bad
        try:
            check_qualified_key(k.strip(), "label_selector")
        except ApiError:
            raise bad from None
        selector[k.strip()] = v.strip()
    return selector
