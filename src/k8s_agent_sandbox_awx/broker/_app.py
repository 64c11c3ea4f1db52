"""The broker's ASGI application: issuers' documents, the control plane and the data plane.

Everything here runs on the broker's event loop thread. State that the test thread reads or
changes (faults, revocations, the claim list) is guarded by ``threading.Lock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.cookiejar
import json
import logging
import re
import secrets
import ssl
import string
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from ._stream_faults import EVENTS_PATH, CutRule, DropRule, StreamDropped, StreamPlan
from ._target import CODE as TARGET_CODE
from ._target import NonNormalTarget, Target, checked_target
from .backends._interface import RuntimeHandle, RuntimeStartError, SandboxBackend, SandboxSpec
from .identity._issuer import PublishedIssuer, TrustedIssuer
from .identity._policy import RESERVED_PREFIX, SCOPES, Caller, Policy, required_scope
from .identity._verify import TokenRejected, TokenVerifier

if TYPE_CHECKING:
    from ._rpc import RpcClaim, RpcEndpoint

log = logging.getLogger("k8s_agent_sandbox_awx.testing")

API_VERSION = "v1"
MAX_JSON_BODY = 1024 * 1024
DEFAULT_PORT = 8888
DEFAULT_DATA_PLANE_TIMEOUT = 300.0
DEFAULT_KEEP_DELETED = 1000
"""Deleted sandboxes whose records the broker keeps (the newest; see ``prune_deleted``)."""
DEFAULT_KEEP_DELETED_SECONDS = 3600.0
"""Seconds a deleted sandbox's record is kept at most (see ``prune_deleted``)."""
IDEMPOTENCY_SECONDS = 86400
"""How long the broker remembers a create's Idempotency-Key."""
CLAIM_API_VERSION = "extensions.agents.x-k8s.io/v1beta1"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IDEMPOTENCY_KEY = re.compile(r"^[\x20-\x7e]{1,255}$")
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
_BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
"""Data-plane methods without a request body (one sent with them is refused)."""
_CREATE_FIELDS = frozenset({"template", "labels", "annotations", "lifetime_seconds", "env"})
_NAME_ALPHABET = string.ascii_lowercase + string.digits
BROKER_ERROR_HEADER = "Agent-Sandbox-Broker-Error"
"""Set (to the error code) on every error answer the broker itself makes, never on a
forwarded one: the client re-sends after a 401 only when it carries a token code."""
_BROKER_ERROR_HEADER_RAW = BROKER_ERROR_HEADER.lower().encode("latin-1")


class _NoCookies(http.cookiejar.CookieJar):
    """The router is stateless (like upstream's): it never stores a sandbox's cookies to
    replay them on later requests."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def add_cookie_header(self, request: Any) -> None:
        return None


class ApiError(Exception):
    """An error response of the broker API (``{"detail", "code"}``)."""

    def __init__(
        self, status: int, code: str, detail: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = dict(headers or {})

    def response(self) -> Response:
        # the mark of the broker's own answers: stripped from every forwarded answer, so a
        # sandbox runtime cannot pass its answer off as the broker's (docs/broker-api.md)
        headers = {**self.headers, BROKER_ERROR_HEADER: self.code}
        return JSONResponse(
            {"detail": self.detail, "code": self.code}, self.status, headers=headers
        )


class _DroppedConnection(Exception):
    """Raised after the response started, so the server drops the connection (fault injection)."""


class _DropFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, _DroppedConnection)


def install_log_filter() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropFilter) for f in logger.filters):
        logger.addFilter(_DropFilter())


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stamps(caller: Caller, rpc: RpcClaim | None, now: float) -> dict[str, str]:
    """The attribution stamps of a sandbox ``caller`` creates ``now``."""
    stamps = {
        RESERVED_PREFIX + "issuer": caller.issuer,
        RESERVED_PREFIX + "subject": caller.subject,
        RESERVED_PREFIX + "provider": caller.provider,
        RESERVED_PREFIX + "created-at": _rfc3339(now),
    }
    for attr, value in caller.attributes.items():
        stamps[RESERVED_PREFIX + "attr." + attr] = (
            json.dumps(value) if not isinstance(value, str) else value
        )
    if rpc is not None:
        stamps.update(rpc.stamps())
    return stamps


def _auth_header(detail: str) -> str:
    safe = detail.replace("\\", "\\\\").replace('"', "'")
    safe = safe.encode("ascii", "replace").decode("ascii")
    return f'Bearer error="invalid_token", error_description="{safe}"'


@dataclass
class SandboxRecord:
    name: str
    namespace: str
    template: str
    owner: Caller
    labels: dict[str, str]
    annotations: dict[str, str]
    stamps: dict[str, str]
    env: dict[str, str]
    created_at: float
    expires_at: float
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    phase: str = "Pending"
    reason: str | None = None
    message: str | None = None
    transition_at: float = field(default_factory=time.time)
    handle: RuntimeHandle | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    executions: int = 0
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    started_at: float | None = None
    deleted: bool = False
    deleted_at: float | None = None
    router_http: httpx.AsyncClient | None = None
    """The router's connections to this sandbox's runtime: closed with the sandbox, so that no
    keep-alive connection to an exited runtime is left behind (CLOSE_WAIT)."""
    scopes: frozenset[str] = frozenset(SCOPES)
    """The data-plane action scopes granted to this sandbox (see ``Policy.scopes``)."""
    rpc: RpcClaim | None = None
    """The ``/rpc`` claim bound to this sandbox (``None``: created through ``/v1``)."""

    def set_phase(self, phase: str, reason: str | None = None, message: str | None = None) -> None:
        self.phase, self.reason, self.message = phase, reason, message
        self.transition_at = time.time()
        if phase != "Pending":
            self.settled.set()

    def api(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "template": self.template,
            "phase": self.phase,
            "ready": self.phase == "Ready",
            "reason": self.reason,
            "message": self.message,
            "created_at": _rfc3339(self.created_at),
            "started_at": _rfc3339(self.started_at) if self.started_at is not None else None,
            "expires_at": _rfc3339(self.expires_at),
            "labels": dict(self.labels),
            "annotations": {**self.annotations, **self.stamps},
            "owner": {
                "provider": self.owner.provider,
                "issuer": self.owner.issuer,
                "subject": self.owner.subject,
            },
            "router": {"sandbox_id": self.name, "namespace": self.namespace, "port": DEFAULT_PORT},
        }

    def manifest(self) -> dict[str, Any]:
        ready = self.phase == "Ready"
        metadata: dict[str, Any] = {
            "name": self.rpc.claim_name if self.rpc is not None else self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "creationTimestamp": _rfc3339(self.created_at),
            "labels": {**self.labels, "app.kubernetes.io/managed-by": "agent-sandbox-awx-broker"},
            "annotations": {**self.annotations, **self.stamps},
        }
        if self.deleted or self.phase == "Terminating":
            metadata["deletionTimestamp"] = _rfc3339(self.transition_at)
        spec: dict[str, Any] = {
            "warmPoolRef": {"name": self.rpc.warm_pool if self.rpc is not None else self.template},
            "lifecycle": {
                "shutdownTime": _rfc3339(self.expires_at),
                "shutdownPolicy": "Delete",
            },
            "env": [{"name": k, "value": v} for k, v in self.env.items()],
        }
        if self.rpc is not None and self.rpc.pod_metadata:
            spec["additionalPodMetadata"] = self.rpc.pod_metadata
        return {
            "apiVersion": CLAIM_API_VERSION,
            "kind": "SandboxClaim",
            "metadata": metadata,
            "spec": spec,
            "status": {
                "sandbox": {"name": self.name},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True" if ready else "False",
                        "reason": self.reason or ("SandboxReady" if ready else self.phase),
                        "message": self.message or "",
                        "lastTransitionTime": _rfc3339(self.transition_at),
                    }
                ],
            },
        }


@dataclass
class _UnavailableRule:
    remaining: int
    retry_after: int
    scope: str
    path: str | None
    sandbox: str | None


class Faults:
    """Failure injection, set from any thread (see ``LocalBroker`` for the public methods)."""

    def __init__(self, readiness_delay: float = 0.0) -> None:
        self.lock = threading.Lock()
        self.readiness_delay = readiness_delay
        self.unavailable: list[_UnavailableRule] = []
        self.drops: list[list[Any]] = []  # [remaining, sandbox or None]
        self.event_cuts: list[CutRule] = []
        self.event_drops: list[DropRule] = []
        self.crashes = 0  # the next N sandboxes crash at startup

    def take_unavailable(self, scope: str, path: str, sandbox: str | None) -> int | None:
        with self.lock:
            for rule in self.unavailable:
                if rule.remaining <= 0:
                    continue
                if rule.scope not in ("any", scope):
                    continue
                if rule.path is not None and not path.startswith(rule.path):
                    continue
                if rule.sandbox is not None and rule.sandbox != sandbox:
                    continue
                rule.remaining -= 1
                return rule.retry_after
            return None

    def take_drop(self, sandbox: str) -> bool:
        with self.lock:
            for rule in self.drops:
                if rule[0] > 0 and rule[1] in (None, sandbox):
                    rule[0] -= 1
                    return True
            return False

    def event_stream_plan(self, sandbox: str) -> StreamPlan | None:
        """How to damage one event stream of ``sandbox`` (``None``: pass it through)."""
        with self.lock:
            cut = next((r for r in self.event_cuts if r.sandbox in (None, sandbox)), None)
            drop = next(
                (r for r in self.event_drops if r.remaining > 0 and r.sandbox in (None, sandbox)),
                None,
            )
        if cut is None and drop is None:
            return None

        def take_drop() -> bool:
            with self.lock:
                if drop is None or drop.remaining <= 0:
                    return False
                drop.remaining -= 1
                return True

        return StreamPlan(cut, drop.after_events if drop is not None else None, take_drop)

    def take_crash(self) -> bool:
        with self.lock:
            if self.crashes > 0:
                self.crashes -= 1
                return True
            return False

    def clear(self) -> None:
        with self.lock:
            self.unavailable.clear()
            self.drops.clear()
            self.event_cuts.clear()
            self.event_drops.clear()
            self.crashes = 0


class BrokerApp:
    """The ASGI application of one local broker."""

    def __init__(
        self,
        *,
        url: str,
        issuers: Callable[[], Mapping[str, TrustedIssuer]],
        issuer_by_name: Callable[[str], PublishedIssuer | None],
        templates: Mapping[str, str | list[str] | None],
        backend: SandboxBackend,
        ca_bundle: str,
        faults: Faults,
        skew_seconds: int,
        max_token_bytes: int,
        protocols: tuple[str, ...] = ("v1", "rpc"),
        keep_deleted: int = DEFAULT_KEEP_DELETED,
        keep_deleted_seconds: float = DEFAULT_KEEP_DELETED_SECONDS,
    ) -> None:
        self.url = url
        self.protocols = protocols
        self.keep_deleted = keep_deleted
        self.keep_deleted_seconds = keep_deleted_seconds
        self.rpc: RpcEndpoint | None = None
        """The ``/rpc`` dialect's handler (set by ``LocalBroker``; routed to only when
        ``protocols`` has ``rpc``, while its claim-header check runs on every data request)."""
        self.templates = dict(templates)
        self.backend = backend
        self.faults = faults
        self.ca_bundle = ca_bundle
        self._issuers = issuers
        self._issuer_by_name = issuer_by_name
        self.lock = threading.Lock()
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.history: list[SandboxRecord] = []
        """Every live record and the deleted ones not pruned yet, oldest first."""
        self._deleted: deque[SandboxRecord] = deque()  # in the order they were deleted
        self.idempotency: dict[tuple[str, str, str], tuple[str, str, float]] = {}
        self.revoked: set[str] = set()
        self._jwks_http: httpx.AsyncClient | None = None
        self._router_tls = ssl.create_default_context()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.verifier = TokenVerifier(
            audience=url,
            issuers=issuers,
            http=self._jwks_client,
            skew_seconds=skew_seconds,
            max_token_bytes=max_token_bytes,
            is_revoked=self._is_revoked,
        )

    # -- shared clients ------------------------------------------------------------------------
    def _jwks_client(self) -> httpx.AsyncClient:
        if self._jwks_http is None:
            self._jwks_http = httpx.AsyncClient(
                verify=ssl.create_default_context(cafile=self.ca_bundle),
                timeout=httpx.Timeout(5.0),
                follow_redirects=False,
                trust_env=False,
            )
        return self._jwks_http

    def _router_client(self, record: SandboxRecord) -> httpx.AsyncClient:
        """The router's client for ``record``'s runtime (one per sandbox, see ``router_http``)."""
        if record.router_http is None:
            record.router_http = httpx.AsyncClient(
                follow_redirects=False,
                trust_env=False,
                verify=self._router_tls,  # one context for all: runtimes speak plain http
                timeout=httpx.Timeout(
                    connect=5.0, read=DEFAULT_DATA_PLANE_TIMEOUT, write=300.0, pool=10.0
                ),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=20),
                cookies=_NoCookies(),
            )
        return record.router_http

    def _is_revoked(self, claims: Mapping[str, Any], token: str) -> bool:
        jti = claims.get("jti")
        with self.lock:
            if isinstance(jti, str) and f"jti:{jti}" in self.revoked:
                return True
            return "sha256:" + hashlib.sha256(token.encode()).hexdigest() in self.revoked

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- ASGI entry ----------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        path: str = scope["path"]
        is_control = path == "/v1" or path.startswith("/v1/")
        is_rpc = path == "/rpc" and "rpc" in self.protocols
        try:
            _origin_form(scope)
            if not is_control and not is_rpc and "x-sandbox-id" in request.headers:
                await self._data_plane(request, send)
                return
            if path.startswith("/issuers/") and request.method == "GET":
                response = self._issuer_document(path)
            elif is_control and "v1" in self.protocols:
                response = await self._control_plane(request)
            elif is_rpc and self.rpc is not None:
                response = await self.rpc.handle(request)
            else:
                served = " and ".join(
                    {"v1": "/v1/ (v1 dialect)", "rpc": "POST /rpc (rpc dialect)"}[p]
                    for p in self.protocols
                )
                raise ApiError(
                    404,
                    "not_found",
                    f"no route for {request.method} {path}: this broker's control plane is "
                    f"{served}; data-plane requests carry X-Sandbox-ID",
                )
        except ApiError as exc:
            response = exc.response()
        except ClientDisconnect:
            return
        await response(scope, receive, send)

    def _issuer_document(self, path: str) -> Response:
        _, _, rest = path.partition("/issuers/")
        name, _, doc = rest.partition("/")
        issuer = self._issuer_by_name(name)
        if issuer is not None and doc == ".well-known/openid-configuration":
            return JSONResponse(issuer.openid_configuration())
        if issuer is not None and doc == "jwks":
            return JSONResponse(issuer.jwks())
        raise ApiError(404, "not_found", f"no issuer document at {path}")

    async def _authenticate(self, request: Request) -> tuple[Caller, TrustedIssuer]:
        try:
            return await self.verifier.verify(request.headers.get("authorization"))
        except TokenRejected as exc:
            raise ApiError(
                401, exc.code, exc.detail, {"WWW-Authenticate": _auth_header(exc.detail)}
            ) from None

    def _check_unavailable(self, scope: str, path: str, sandbox: str | None = None) -> None:
        retry_after = self.faults.take_unavailable(scope, path, sandbox)
        if retry_after is not None:
            raise ApiError(
                503,
                "unavailable",
                f"the broker is temporarily unavailable (injected); retry after {retry_after} s",
                {"Retry-After": str(retry_after)},
            )

    # -- control plane -------------------------------------------------------------------------
    async def _control_plane(self, request: Request) -> Response:
        path = request.url.path
        method = request.method
        if path == "/v1/healthz":
            if method != "GET":
                raise ApiError(404, "not_found", f"no route for {method} {path}")
            return JSONResponse({"status": "ok", "api_version": API_VERSION})
        self._check_unavailable("control", path)
        if path == "/v1/whoami" and method == "GET":
            caller, issuer = await self._authenticate(request)
            return JSONResponse(self._whoami(caller, issuer))
        if path == "/v1/sandboxes":
            if method == "POST":
                caller, issuer = await self._authenticate(request)
                return await self._create(request, caller, issuer)
            if method == "GET":
                caller, _ = await self._authenticate(request)
                return self._list(request, caller)
        elif path.startswith("/v1/sandboxes/") and path.count("/") == 3:
            name = path.rsplit("/", 1)[1]
            if method in ("GET", "DELETE"):
                _check_name(name)
            if method == "GET":
                caller, _ = await self._authenticate(request)
                return await self._get(request, caller, name)
            if method == "DELETE":
                caller, _ = await self._authenticate(request)
                return await self._delete(caller, name)
        elif path.startswith("/v1/sandboxes/") and path.count("/") == 4:
            name, _, sub = path[len("/v1/sandboxes/") :].partition("/")
            if sub == "lifetime" and method == "PUT":
                _check_name(name)
                caller, issuer = await self._authenticate(request)
                return await self._extend(request, caller, issuer, name)
        raise ApiError(404, "not_found", f"no route for {method} {path}")

    def _whoami(self, caller: Caller, issuer: TrustedIssuer) -> dict[str, Any]:
        try:
            policy = issuer.policy.describe(caller)
        except (ValueError, KeyError) as exc:
            raise ApiError(
                403, "policy_denied", f"no policy applies to this caller: {exc}"
            ) from None
        return {
            "provider": caller.provider,
            "issuer": caller.issuer,
            "subject": caller.subject,
            "audience": caller.audience,
            "expires_at": _rfc3339(caller.expires_at),
            "attributes": dict(caller.attributes),
            "policy": policy,
        }

    async def _json_body(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_JSON_BODY:
            raise ApiError(413, "too_large", f"the body is over {MAX_JSON_BODY} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_JSON_BODY:
                raise ApiError(413, "too_large", f"the body is over {MAX_JSON_BODY} bytes")
        if not body.strip():
            return {}
        try:
            return json.loads(body)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", f"the body is not valid JSON: {exc}") from None

    def _validate_create(self, body: Any, max_lifetime: int) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_request", "the body must be a JSON object")
        unknown = sorted(set(body) - _CREATE_FIELDS)
        if unknown:
            raise ApiError(
                400,
                "invalid_request",
                f"unknown field(s) {unknown}; allowed: {sorted(_CREATE_FIELDS)}",
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
        if lifetime > max_lifetime:
            raise ApiError(
                403,
                "lifetime_exceeds_policy",
                f"'lifetime_seconds' {lifetime} is over the policy's cap of {max_lifetime} s "
                "from creation; ask for at most that",
            )
        env = _string_map(body.get("env"), "env")
        for name in env:
            if not _ENV_NAME.match(name):
                raise ApiError(
                    400,
                    "invalid_request",
                    f"env name {name!r} is invalid: letters, digits and '_', not starting "
                    "with a digit",
                )
        return {
            "template": template,
            "labels": labels,
            "annotations": annotations,
            "lifetime": lifetime,
            "env": env,
        }

    async def _create(self, request: Request, caller: Caller, issuer: TrustedIssuer) -> Response:
        key = request.headers.get("idempotency-key")
        if key is not None and not _IDEMPOTENCY_KEY.match(key):
            raise ApiError(
                400,
                "invalid_header",
                "Idempotency-Key must be 1-255 printable ASCII characters",
            )
        raw = await self._json_body(request)
        policy = issuer.policy
        fields = self._validate_create(raw, policy.max_lifetime_seconds)
        digest = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
        # From here to the insert there is no await: concurrent creates cannot interleave.
        replay = self._replay(caller, key, digest) if key is not None else None
        if replay is not None:
            return replay
        template = fields["template"] or policy.effective_default_template
        if template not in self.templates:
            raise ApiError(
                404,
                "template_not_found",
                f"template {template!r} does not exist; known: {sorted(self.templates)}",
            )
        if template not in policy.templates:
            raise ApiError(
                403,
                "template_not_allowed",
                f"provider {caller.provider!r} may not use template {template!r}; allowed: "
                f"{list(policy.templates)}",
            )
        record = self._admit(
            caller,
            policy,
            template=template,
            labels=fields["labels"],
            annotations=fields["annotations"],
            env=fields["env"],
            lifetime=fields["lifetime"],
        )
        if key is not None:
            self._forget_old_keys()
            self.idempotency[(caller.issuer, caller.subject, key)] = (
                digest,
                record.name,
                record.created_at,
            )
        log.info("created sandbox %s for %s (%s)", record.name, caller.subject, caller.provider)
        return JSONResponse(record.api(), 201)

    def _replay(self, caller: Caller, key: str, digest: str) -> Response | None:
        """The answer to a create that repeats a remembered Idempotency-Key (``None``: the
        key is new, or older than :data:`IDEMPOTENCY_SECONDS`)."""
        remembered = self.idempotency.get((caller.issuer, caller.subject, key))
        if remembered is None or time.time() - remembered[2] >= IDEMPOTENCY_SECONDS:
            return None
        if remembered[0] != digest:
            raise ApiError(
                409,
                "idempotency_conflict",
                "this Idempotency-Key was used with a different body; use a new key "
                "for a different create",
            )
        with self.lock:
            record = self.sandboxes.get(remembered[1]) or next(
                (r for r in self.history if r.name == remembered[1]), None
            )
        if record is None:  # deleted, and its record pruned since (see prune_deleted)
            raise ApiError(
                404,
                "not_found",
                f"sandbox {remembered[1]!r}, which this Idempotency-Key created, was deleted "
                "and is no longer remembered; use a new Idempotency-Key to create another "
                "sandbox",
            )
        return JSONResponse(record.api(), 200, headers={"Idempotency-Replayed": "true"})

    def _admit(
        self,
        caller: Caller,
        policy: Policy,
        *,
        template: str,
        labels: dict[str, str],
        annotations: dict[str, str],
        env: dict[str, str],
        lifetime: float,
        rpc: RpcClaim | None = None,
        failure: tuple[str, str] | None = None,
    ) -> SandboxRecord:
        """Admit one sandbox for ``caller`` (both dialects): namespace, quota, attribution
        stamps, the record, its expiry timer and its start (or ``failure``: the record is
        ``Failed`` with that reason and message and nothing starts). No await in here, so
        concurrent creates cannot interleave."""
        try:
            namespace = policy.namespace_for(caller)
        except (ValueError, KeyError) as exc:
            raise ApiError(403, "policy_denied", f"no namespace for this caller: {exc}") from None
        with self.lock:
            live = [
                r
                for r in self.sandboxes.values()
                if r.owner.key == caller.key and r.phase in ("Pending", "Ready")
            ]
            if len(live) >= policy.max_sandboxes:
                raise ApiError(
                    429,
                    "quota_exceeded",
                    f"caller {caller.subject!r} holds {len(live)} sandboxes, the maximum of its "
                    f"policy ({policy.max_sandboxes}); delete one first",
                )
            name = self._new_name()
            now = time.time()
            record = SandboxRecord(
                name=name,
                namespace=namespace,
                template=template,
                owner=caller,
                labels=labels,
                annotations=annotations,
                stamps=_stamps(caller, rpc, now),
                env=env,
                created_at=now,
                expires_at=now + lifetime,
                scopes=rpc.scopes if rpc is not None else frozenset(policy.scopes),
                rpc=rpc,
            )
            if failure is not None:
                record.set_phase("Failed", *failure)
            self.sandboxes[name] = record
            self.history.append(record)
            self.prune_deleted()
        self.schedule_expiry(record)
        if failure is None:
            self._spawn(self._provision(record))
        return record

    def schedule_expiry(self, record: SandboxRecord) -> None:
        """(Re)arm ``record``'s expiry timer for its ``expires_at``."""
        for timer in record.timers:
            timer.cancel()
        record.timers.clear()
        delay = max(0.0, record.expires_at - time.time())
        record.timers.append(
            asyncio.get_running_loop().call_later(
                delay, lambda: self._spawn(self._terminate(record, "Expired"))
            )
        )

    def _new_name(self) -> str:
        while True:
            name = "sbx-" + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(8))
            if name not in self.sandboxes:
                return name

    async def _provision(self, record: SandboxRecord) -> None:
        spec = SandboxSpec(
            name=record.name,
            namespace=record.namespace,
            template=record.template,
            env=record.env,
            command=self.templates.get(record.template),
        )
        if self.faults.take_crash():
            record.set_phase("Failed", "RuntimeCrashed", "injected: the sandbox crashed at startup")
            return
        try:
            handle = await self.backend.start(spec)
        except RuntimeStartError as exc:
            if record.phase == "Pending":
                record.set_phase("Failed", exc.reason, exc.message)
            return
        except Exception as exc:  # a backend bug must still fail the sandbox visibly
            log.exception("backend failed to start %s", record.name)
            if record.phase == "Pending":
                record.set_phase("Failed", "BackendError", f"{type(exc).__name__}: {exc}")
            return
        record.handle = handle
        delay = self.faults.readiness_delay
        if delay > 0:
            await asyncio.sleep(delay)
        if record.phase != "Pending":  # deleted or expired while starting
            await self.backend.stop(handle)
            return
        record.started_at = time.time()
        record.set_phase("Ready", "SandboxReady", "the sandbox runtime is ready")

    async def _terminate(self, record: SandboxRecord, reason: str) -> None:
        if record.deleted:
            return
        if record.phase != "Terminating":
            record.set_phase("Terminating", reason, f"the sandbox is being deleted ({reason})")
        for timer in record.timers:
            timer.cancel()
        handle = record.handle
        if handle is not None:
            try:
                await self.backend.stop(handle)
            except Exception:
                log.exception("backend failed to stop %s", record.name)
        with self.lock:
            self.sandboxes.pop(record.name, None)
            record.deleted = True
            record.deleted_at = time.time()
            record.timers.clear()
            self._deleted.append(record)
            self.prune_deleted()
        if record.router_http is not None:
            await record.router_http.aclose()

    def prune_deleted(self) -> None:
        """Forget deleted sandboxes past the retention: beyond the newest ``keep_deleted``, or
        deleted more than ``keep_deleted_seconds`` ago (live records are kept). The caller
        holds ``self.lock``; it runs at every create and delete and before ``LocalBroker``
        reads the records."""
        now = time.time()
        pruned: set[int] = set()
        while self._deleted and (
            len(self._deleted) > self.keep_deleted
            or now - (self._deleted[0].deleted_at or now) >= self.keep_deleted_seconds
        ):
            pruned.add(id(self._deleted.popleft()))
        if pruned:
            self.history = [r for r in self.history if id(r) not in pruned]

    def _forget_old_keys(self) -> None:
        """Forget Idempotency-Keys older than :data:`IDEMPOTENCY_SECONDS` (at each keyed
        create, on the event loop: the only place that reads or writes them)."""
        now = time.time()
        stale = [k for k, v in self.idempotency.items() if now - v[2] >= IDEMPOTENCY_SECONDS]
        for key in stale:
            del self.idempotency[key]

    async def _extend(
        self, request: Request, caller: Caller, issuer: TrustedIssuer, name: str
    ) -> Response:
        body = await self._json_body(request)
        if not isinstance(body, dict) or set(body) != {"seconds"}:
            raise ApiError(
                400, "invalid_request", 'the body must be {"seconds": N} (N a positive integer)'
            )
        seconds = body["seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds <= 0:
            raise ApiError(400, "invalid_request", "'seconds' must be a positive integer")
        record = self._owned(caller, name)
        if record.phase == "Terminating" or record.deleted:
            raise ApiError(409, "terminating", f"sandbox {name!r} is being deleted")
        cap = issuer.policy.max_lifetime_seconds
        now = time.time()
        if now + seconds > record.created_at + cap:
            left = max(0, int(record.created_at + cap - now))
            raise ApiError(
                403,
                "lifetime_exceeds_policy",
                f"sandbox {name!r} cannot live {seconds} s more: its policy caps a sandbox's "
                f"lifetime at {cap} s from its creation ({_rfc3339(record.created_at + cap)}); "
                f"at most {left} s are left",
            )
        record.expires_at = now + seconds
        self.schedule_expiry(record)
        log.info("sandbox %s now expires in %d s", name, seconds)
        return JSONResponse(record.api())

    def _owned(self, caller: Caller, name: str) -> SandboxRecord:
        with self.lock:
            record = self.sandboxes.get(name)
        if record is None or record.owner.key != caller.key:
            raise ApiError(404, "not_found", f"sandbox {name!r} does not exist for this caller")
        return record

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
        record = self._owned(caller, name)
        if wait == "ready" and record.phase == "Pending" and timeout > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.settled.wait(), timeout)
        self._check_alive(record)
        return JSONResponse(record.api())

    def _check_alive(self, record: SandboxRecord) -> None:
        handle = record.handle
        if record.phase == "Ready" and handle is not None and not self.backend.is_alive(handle):
            record.set_phase("Failed", "RuntimeExited", "the sandbox runtime process exited")
            if record.router_http is not None:  # its connections lead nowhere now
                self._spawn(record.router_http.aclose())

    def _list(self, request: Request, caller: Caller) -> Response:
        selector: dict[str, str] = {}
        raw = request.query_params.get("label_selector")
        if raw:
            for term in raw.split(","):
                k, sep, v = term.partition("=")
                if not sep or not k.strip() or v.startswith("="):
                    raise ApiError(
                        400,
                        "invalid_request",
                        f"label_selector term {term!r} is not 'key=value' (equality only)",
                    )
                try:
                    _check_qualified_key(k.strip(), "label_selector")
                except ApiError:
                    raise ApiError(
                        400,
                        "invalid_request",
                        f"label_selector term {term!r} is not 'key=value' (equality only)",
                    ) from None
                selector[k.strip()] = v.strip()
        with self.lock:
            mine = [r for r in self.sandboxes.values() if r.owner.key == caller.key]
        mine = [r for r in mine if all(r.labels.get(k) == v for k, v in selector.items())]
        mine.sort(key=lambda r: r.created_at, reverse=True)
        return JSONResponse({"items": [r.api() for r in mine]})

    async def _delete(self, caller: Caller, name: str) -> Response:
        record = self._owned(caller, name)
        self.begin_delete(record)
        return JSONResponse(record.api(), 202)

    def begin_delete(self, record: SandboxRecord) -> None:
        """Mark ``record`` Terminating and stop it in the background (both dialects)."""
        if record.phase != "Terminating":
            record.set_phase("Terminating", "Deleted", "the sandbox is being deleted")
            self._spawn(self._terminate(record, "Deleted"))

    # -- data plane ----------------------------------------------------------------------------
    def _router_headers(self, request: Request) -> tuple[str, str, int, float]:
        headers = request.headers
        sandbox_id = headers.get("x-sandbox-id", "")
        if len(sandbox_id) > 63 or not _DNS_LABEL.match(sandbox_id):
            raise ApiError(
                400,
                "invalid_header",
                "X-Sandbox-ID must be a DNS-1123 label (lowercase alphanumerics and '-', at most "
                "63 characters)",
            )
        namespace = headers.get("x-sandbox-namespace", "default")
        if len(namespace) > 63 or not _DNS_LABEL.match(namespace):
            raise ApiError(400, "invalid_header", "X-Sandbox-Namespace must be a DNS-1123 label")
        raw_port = headers.get("x-sandbox-port", str(DEFAULT_PORT))
        if not raw_port.isdigit() or not 1 <= int(raw_port) <= 65535:
            raise ApiError(
                400, "invalid_header", "X-Sandbox-Port must be an integer from 1 to 65535"
            )
        timeout = DEFAULT_DATA_PLANE_TIMEOUT
        raw_timeout = headers.get("x-sandbox-timeout")
        if raw_timeout is not None:
            try:
                timeout = float(raw_timeout)
            except ValueError:
                timeout = -1.0
            if not 0 < timeout <= 86400:
                raise ApiError(
                    400,
                    "invalid_header",
                    "X-Sandbox-Timeout must be a positive number of seconds (at most 86400)",
                )
        return sandbox_id, namespace, int(raw_port), timeout

    async def _data_plane(self, request: Request, send: Send) -> None:
        _check_method(request)
        sandbox_id, namespace, port, timeout = self._router_headers(request)
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in request.url.path):
            raise ApiError(
                400, "invalid_path", "the path contains control characters (after URL decoding)"
            )
        # The one target every decision below is made on, and the bytes that are forwarded.
        target = _normal_target(request.scope)
        self._check_unavailable("data", target.path, sandbox_id)
        caller, _ = await self._authenticate(request)
        record = self._data_record(caller, sandbox_id, namespace)
        if self.rpc is not None:
            self.rpc.check_data_request(request, record)
        scope = required_scope(target.path)
        if scope is not None and scope not in record.scopes:
            raise ApiError(
                403,
                "scope_denied",
                f"sandbox {sandbox_id!r} was not granted the {scope!r} scope (granted: "
                f"{sorted(record.scopes)}); request it at create, within the caller's policy",
            )
        self._check_alive(record)
        if record.phase == "Terminating":
            raise ApiError(409, "terminating", f"sandbox {sandbox_id!r} is being deleted")
        if record.phase != "Ready" or record.handle is None:
            raise ApiError(
                409,
                "not_ready",
                f"sandbox {sandbox_id!r} is {record.phase}, not Ready; wait for Ready first",
            )
        if port != DEFAULT_PORT:
            raise ApiError(
                502,
                "sandbox_unreachable",
                f"nothing listens on port {port} in sandbox {sandbox_id!r} (it serves "
                f"{DEFAULT_PORT})",
            )
        await self._forward(request, send, record, record.handle, target, timeout)

    def _data_record(self, caller: Caller, sandbox_id: str, namespace: str) -> SandboxRecord:
        """The live sandbox a data-plane request names, if ``caller`` owns it."""
        with self.lock:
            record = self.sandboxes.get(sandbox_id)
        if record is None or record.namespace != namespace:
            raise ApiError(
                404, "not_found", f"no sandbox {sandbox_id!r} in namespace {namespace!r}"
            )
        if record.owner.key != caller.key:
            raise ApiError(
                403,
                "not_owner",
                f"sandbox {sandbox_id!r} belongs to another identity; only its owner may use it",
            )
        return record

    async def _forward(
        self,
        request: Request,
        send: Send,
        record: SandboxRecord,
        handle: RuntimeHandle,
        target: Target,
        read_timeout: float,
    ) -> None:
        # Built from parts: the request target is only ever the path (and query) of the URL,
        # never its authority (see _origin_form), and exactly the bytes that were checked.
        url = httpx.URL(scheme="http", host=handle.host, port=handle.port, raw_path=target.raw)
        if url.raw_path != target.raw:  # checked_target refuses what httpx would rewrite
            raise ApiError(
                400,
                TARGET_CODE,
                f"the request path {target.path!r} is not in normal form: the router would "
                "send it changed",
            )
        headers = [
            (k, v)
            for k, v in request.headers.raw
            if k.decode("latin-1").lower() not in _HOP_BY_HOP
            and k.lower() not in (b"authorization", b"host", b"cookie", b"content-length")
            and not k.lower().startswith(b"x-sandbox-")
        ]
        content = _forwarded_body(request, headers)
        if record.deleted:  # terminated since the checks above
            raise ApiError(409, "terminating", f"sandbox {record.name!r} is being deleted")
        client = self._router_client(record)
        upstream = client.build_request(
            request.method,
            url,
            headers=headers,
            content=content,
            timeout=httpx.Timeout(connect=5.0, read=read_timeout, write=300.0, pool=10.0),
        )
        is_execute = request.method == "POST" and target.path in ("/execute", "/commands")
        plan = None  # an event stream, or a start that may answer with one (NDJSON)
        if (request.method == "GET" and EVENTS_PATH.match(target.path)) or (
            request.method == "POST" and target.path == "/commands"
        ):
            plan = self.faults.event_stream_plan(record.name)
        response = await self._send_upstream(client, upstream, record, is_execute, read_timeout)
        try:
            relay = _Relay(request, send, record, f"{request.method} {target.path}")
            await self._relay(relay, response, is_execute, plan)
        finally:
            await response.aclose()

    async def _send_upstream(
        self,
        client: httpx.AsyncClient,
        upstream: httpx.Request,
        record: SandboxRecord,
        is_execute: bool,
        read_timeout: float,
    ) -> httpx.Response:
        """Send ``upstream`` to ``record``'s runtime (counted if ``is_execute``); its answer
        streams. A failure before the answer starts is the broker's 502 or 504, whose code
        says whether the request may have reached the sandbox: ``sandbox_unreachable`` (no
        connection: nothing was sent, nothing counted), ``sandbox_answer_lost`` (the
        connection broke after the request was sent) or ``sandbox_timeout`` (sent, no answer
        in time)."""
        if is_execute:
            record.executions += 1
        try:
            return await client.send(upstream, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            if is_execute:
                record.executions -= 1
            how = "" if isinstance(exc, httpx.ConnectError) else " (timed out)"
            raise ApiError(
                502, "sandbox_unreachable", f"cannot connect to sandbox {record.name!r}{how}"
            ) from None
        except httpx.TimeoutException:
            raise ApiError(
                504,
                "sandbox_timeout",
                f"sandbox {record.name!r} did not answer within {read_timeout:g} s "
                "(X-Sandbox-Timeout); the request may have reached it",
            ) from None
        except httpx.HTTPError as exc:
            raise ApiError(
                502,
                "sandbox_answer_lost",
                f"the connection to sandbox {record.name!r} broke after the request was sent "
                f"({type(exc).__name__}): the request may have reached the sandbox",
            ) from None

    async def _relay(
        self,
        relay: _Relay,
        response: httpx.Response,
        is_execute: bool,
        plan: StreamPlan | None,
    ) -> None:
        """Stream the runtime's answer to the client, as it comes."""
        out_headers = [
            (k.lower(), v)
            for k, v in response.headers.raw
            if k.decode("latin-1").lower() not in _HOP_BY_HOP
            and k.lower() not in (b"date", b"server", _BROKER_ERROR_HEADER_RAW)
        ]
        if is_execute and self.faults.take_drop(relay.record.name):
            async for _ in response.aiter_raw():  # the command ran; now lose the answer
                pass  # (read and dropped, never held: an answer may be large)
            await relay.send({"type": "http.response.start", "status": 200, "headers": out_headers})
            raise _DroppedConnection("injected: connection dropped after the command ran")
        await relay.send(
            {"type": "http.response.start", "status": response.status_code, "headers": out_headers}
        )
        chunks = response.aiter_raw()
        ndjson = response.headers.get("content-type", "").startswith("application/x-ndjson")
        if plan is not None and 200 <= response.status_code < 300 and ndjson:
            chunks = plan.apply(chunks)
        await relay.pump(chunks)

    # -- lifecycle -----------------------------------------------------------------------------
    async def delete_all(self) -> None:
        with self.lock:
            records = list(self.sandboxes.values())
        await asyncio.gather(*(self._terminate(r, "Deleted") for r in records))

    async def shutdown(self) -> None:
        await self.delete_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.backend.close()
        if self._jwks_http is not None:
            await self._jwks_http.aclose()


def _origin_form(scope: Scope) -> bytes:
    """The request target (path and query, raw) if it is origin-form ('/' + path), else 400.

    The absolute form (``http://host:port/path``), the authority form (``host:port``), the
    asterisk form and anything else not starting with '/' (``@host:port/path``) are refused:
    such a target must never become part of the authority of the URL the router forwards to.
    """
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    if not raw_path.startswith(b"/"):
        raise ApiError(
            400,
            "invalid_path",
            "the request target must be origin-form ('/' followed by the path, as in "
            "'GET /download/file HTTP/1.1'), not an absolute URL, an authority or '*'",
        )
    query: bytes = scope.get("query_string") or b""
    target = raw_path + b"?" + query if query else raw_path
    if b"#" in target or not target.isascii():
        raise ApiError(
            400,
            "invalid_path",
            "the request target has a fragment ('#') or a non-ASCII byte; percent-encode them",
        )
    return target


def _check_method(request: Request) -> None:
    """What the router forwards is what was checked: the method is in upper case (HTTP
    methods are case-sensitive, RFC 9110 section 9.1, and the router's HTTP client sends
    ``post`` as ``POST``, which would run as a method other than the one checked and counted),
    and a method without a body (``GET``, ``HEAD``, ``DELETE``, ``OPTIONS``) carries none."""
    method = request.method
    shown = method if len(method) <= 20 else method[:17] + "..."
    if method != method.upper():
        raise ApiError(
            400,
            "invalid_method",
            f"the request method {shown!r} is not in upper case: HTTP methods are "
            f"case-sensitive (RFC 9110, section 9.1); send {shown.upper()!r}",
        )
    length = request.headers.get("content-length", "0").strip()
    if method in _BODYLESS and ("transfer-encoding" in request.headers or length != "0"):
        raise ApiError(
            400,
            "invalid_request",
            f"a {method} request to a sandbox carries no body (it would not be forwarded); "
            "send it without one (no Content-Length other than 0, no Transfer-Encoding)",
        )


def _forwarded_body(request: Request, headers: list[tuple[bytes, bytes]]) -> Any:
    """The body the router forwards, framed by the router, never by the client's own framing
    headers (``headers``: the forwarded ones, without them): none for a method without a body;
    a client's chunked body is sent chunked; a body the client sent with a ``Content-Length``
    (which the server read it by) with that length; no framing at all: empty."""
    if request.method in _BODYLESS:
        return None
    if "transfer-encoding" not in request.headers:
        length = request.headers.get("content-length")
        if length is None:
            return b""
        headers.append((b"content-length", str(int(length)).encode()))

    async def body() -> AsyncIterator[bytes]:
        async for chunk in request.stream():
            if chunk:
                yield chunk

    return body()


def _normal_target(scope: Scope) -> Target:
    """The request target (origin-form, see :func:`_origin_form`) if it is in normal form,
    else ``400 path_not_normalized`` (see ``_target``)."""
    try:
        return checked_target(_origin_form(scope))
    except NonNormalTarget as exc:
        raise ApiError(400, TARGET_CODE, exc.detail) from None


async def _client_gone(receive: Receive) -> None:
    """Return when the client disconnects (the request body has been read by then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Relay:
    """One runtime answer on its way to the client (``what``: its method and path).

    A peer that goes away mid-stream is an expected event, logged as one line without a
    traceback: the client going away (it closed a ``watch_dir`` or an event stream early) stops
    the relay at once (INFO) and the broker stops reading from the runtime; the runtime breaking
    off its answer (killed, or silent past the read timeout) drops the client's connection, so
    that the client sees a broken answer, never a complete one (WARNING; INFO when the sandbox
    is being deleted)."""

    def __init__(self, request: Request, send: Send, record: SandboxRecord, what: str) -> None:
        self.request = request
        self.send = send
        self.record = record
        self.what = what

    async def pump(self, chunks: AsyncIterator[bytes]) -> None:
        """Send ``chunks`` as the body, then end it, unless a peer goes away first."""
        loop = asyncio.get_running_loop()
        gone = loop.create_task(_client_gone(self.request.receive))
        copy = loop.create_task(self._copy(chunks))
        try:
            await asyncio.wait({gone, copy}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            copy.cancel()  # no-op once done; else the client went away (or the broker stops)
        await asyncio.wait({copy})
        if not copy.cancelled():
            self._raise_for(copy.exception())
            return
        log.info(
            "sandbox %s: the client went away during %s; stopped relaying the runtime's answer",
            self.record.name,
            self.what,
        )

    async def _copy(self, chunks: AsyncIterator[bytes]) -> None:
        async for chunk in chunks:
            if chunk:
                message: Message = {"type": "http.response.body", "body": chunk, "more_body": True}
                await self.send(message)
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    def _raise_for(self, exc: BaseException | None) -> None:
        if exc is None:
            return
        if isinstance(exc, StreamDropped):  # injected (cut_event_streams and friends)
            raise _DroppedConnection(str(exc)) from None
        if isinstance(exc, httpx.HTTPError):
            deleting = self.record.deleted or self.record.phase == "Terminating"
            log.log(
                logging.INFO if deleting else logging.WARNING,
                "sandbox %s: the runtime's answer to %s broke off mid-stream (%s: %s)%s; "
                "dropped the client's connection",
                self.record.name,
                self.what,
                type(exc).__name__,
                str(exc)[:200],
                " as the sandbox is being deleted" if deleting else "",
            )
            raise _DroppedConnection(f"the runtime's answer broke off: {exc}") from None
        raise exc


def _string_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ApiError(400, "invalid_request", f"'{what}' must be an object of string values")
    return dict(value)


def _check_name(name: str) -> None:
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise ApiError(
            400,
            "invalid_path",
            f"sandbox name {name!r} is not a DNS-1123 label (lowercase alphanumerics "
            "and '-', at most 63 characters)",
        )


def check_metadata(
    body: Mapping[str, Any], labels_field: str = "labels", annotations_field: str = "annotations"
) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations of a create body, checked as Kubernetes checks them (both
    dialects; ``/rpc`` also for ``pod_labels`` / ``pod_annotations``)."""
    labels = _string_map(body.get(labels_field), labels_field)
    annotations = _string_map(body.get(annotations_field), annotations_field)
    label_kind = labels_field.removesuffix("s").replace("_", " ")
    annotation_kind = annotations_field.removesuffix("s").replace("_", " ")
    for kind, mapping in ((label_kind, labels), (annotation_kind, annotations)):
        for key in mapping:
            if key.startswith(RESERVED_PREFIX):
                raise ApiError(
                    403,
                    "reserved_metadata",
                    f"{kind} {key!r} is under the reserved prefix {RESERVED_PREFIX!r}, which "
                    "only the broker sets; use another key",
                )
    for key, value in labels.items():
        _check_qualified_key(key, label_kind)
        if len(value) > 63 or (value and not _QUALIFIED_NAME.match(value)):
            raise ApiError(
                400,
                "invalid_request",
                f"{label_kind} {key!r} has an invalid value: at most 63 characters, "
                "alphanumerics, '-', '_' or '.', beginning and ending with an alphanumeric",
            )
    for key in annotations:
        _check_qualified_key(key, annotation_kind)
    if sum(len(k) + len(v) for k, v in annotations.items()) > 256 * 1024:
        raise ApiError(400, "invalid_request", f"{annotations_field} are over 256 KiB in total")
    return labels, annotations


def _check_qualified_key(key: str, kind: str) -> None:
    prefix, sep, name = key.rpartition("/")
    ok = bool(name) and len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))
    if sep:
        ok = ok and 0 < len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.match(prefix))
    if not ok:
        raise ApiError(
            400,
            "invalid_request",
            f"{kind} key {key!r} is invalid: [prefix/]name, name at most 63 characters of "
            "alphanumerics, '-', '_', '.', prefix a DNS subdomain",
        )
