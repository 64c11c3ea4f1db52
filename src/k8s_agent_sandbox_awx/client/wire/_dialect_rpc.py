"""The ``/rpc`` dialect: the control plane of the identity brokers deployed for the original
package of this name (docs/broker-api.md, "The /rpc dialect").

One endpoint, ``POST {broker}/rpc`` with ``{"op": ..., ...}``: ``create`` (the broker names the
claim and pins the namespace), ``status`` (polled until the sandbox is bound and Ready),
``delete`` (``204`` also for an absent claim) and ``extend``. Errors are short plain text. There
is no list, no whoami and no idempotency key: a create is never retried, and one interrupted
mid-request cannot be looked up (it ends at its shutdown time). The data plane is the shared
one (``_dataplane``) with ``X-Sandbox-Claim-Name`` on every request.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from ..._upstream import CREATED_BY_LABEL
from ...errors import (
    BrokerError,
)
from . import _dialect_v1 as v1
from ._dialect import LIFETIME, CreateRequest, Dialect, Lifetime, default_lifetime_marked
from ._protocol import (
    Call,
    Reply,
    RequestSpec,
    RouterTarget,
    SandboxInfo,
    check_reserved_metadata,
    json_body,
    json_object,
    protocol_error,
    raw,
    redact_answer,
    scope_names,
    str_mapping,
)

__all__ = ["CLAIM_HEADER", "CREATED_BY", "ERROR_CHARS", "RPC", "RpcDialect", "RpcTarget"]

RPC = "/rpc"
CLAIM_HEADER = "X-Sandbox-Claim-Name"
CREATED_BY = "python-client"
"""The value of upstream's created-by label on a create, as the original package sent it."""
ERROR_CHARS = 200
"""How much of a plain-text error body a message shows."""
FIRST_POLL_PAUSE = 0.1
"""The pause before the second status poll; it doubles up to the poll interval."""
_API = "the /rpc dialect"
_FAILED_REASONS = frozenset(
    {"crashed", "InvalidMetadata", "VolumeClaimTemplatesError", "ClaimExpired"}
)
"""Terminal ``Ready=False`` reasons besides the two not-found ones (upstream's list + crashed)."""


@dataclass(frozen=True)
class RpcTarget:
    """The data-plane routing of a claim's sandbox: upstream's router headers + the claim."""

    router: RouterTarget
    claim_name: str

    @property
    def sandbox_id(self) -> str:
        return self.router.sandbox_id

    def headers(self) -> dict[str, str]:
        return {**self.router.headers(), CLAIM_HEADER: self.claim_name}


# --------------------------------------------------------------------------------------------
# Requests


def _op(op: str, what: str, fields: Mapping[str, Any], *, retryable: bool) -> RequestSpec:
    body = {"op": op, **{k: v for k, v in fields.items() if v not in (None, "", [], {})}}
    return json_body(RequestSpec("POST", RPC, what, retryable=retryable), body)


def _claim(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 253:
        raise ValueError(
            f"Invalid claim name {name!r}: use the name create returned (Sandbox.name)."
        )
    return name


def lifecycle(seconds: int, now: datetime | None = None) -> dict[str, str]:
    """Upstream's claim lifecycle spec: shut down (delete) ``seconds`` from now (whole
    seconds, never later than asked)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds <= 0:
        raise ValueError(
            f"The lifetime must be a positive whole number of seconds, got {seconds!r}."
        )
    moment = (now or datetime.now(UTC)).replace(microsecond=0) + timedelta(seconds=seconds)
    return {"shutdownTime": moment.strftime("%Y-%m-%dT%H:%M:%SZ"), "shutdownPolicy": "Delete"}


def create(request: CreateRequest) -> RequestSpec:
    for name in ("labels", "annotations", "pod_labels", "pod_annotations"):
        check_reserved_metadata(name, name, str_mapping(name, getattr(request, name)))
    labels = {CREATED_BY_LABEL: CREATED_BY, **str_mapping("labels", request.labels)}
    scopes = scope_names(request.scopes)
    fields = {
        "warmpool": request.template,
        "labels": labels,
        "annotations": str_mapping("annotations", request.annotations),
        "pod_labels": str_mapping("pod_labels", request.pod_labels),
        "pod_annotations": str_mapping("pod_annotations", request.pod_annotations),
        "lifecycle": (
            lifecycle(request.lifetime_seconds) if request.lifetime_seconds is not None else None
        ),
        "scopes": None if scopes is None else list(scopes),
    }
    # No idempotency key: sending the create again would make a second sandbox.
    spec = _op("create", "create a sandbox", fields, retryable=False)
    return default_lifetime_marked(spec, request)


def status(name: str, *, delay: float = 0.0, what: str | None = None) -> RequestSpec:
    spec = _op(
        "status", what or f"get sandbox {name!r}", {"claim_name": _claim(name)}, retryable=True
    )
    return dataclasses.replace(spec, delay=delay)


# --------------------------------------------------------------------------------------------
# Answers


def parse_created(reply: Reply, spec: RequestSpec) -> SandboxInfo:
    obj = json_object(reply.content, spec.what)
    name, namespace = obj.get("claim_name"), obj.get("namespace")
    if not isinstance(name, str) or not name or not isinstance(namespace, str) or not namespace:
        raise protocol_error(spec.what, "the answer lacks 'claim_name' or 'namespace'", _API)
    return SandboxInfo(
        name=name,
        namespace=namespace,
        template=None,
        phase="Pending",
        ready=False,
        router=RouterTarget(sandbox_id="", namespace=namespace),
    )


def _ready_condition(obj: dict[str, Any], what: str) -> dict[str, Any]:
    conditions = obj.get("conditions") or []
    if not isinstance(conditions, list):
        raise protocol_error(what, "'conditions' is not a list", _API)
    for condition in conditions:
        if isinstance(condition, dict) and condition.get("type") == "Ready":
            return condition
    return {}


def parse_status(name: str, reply: Reply, what: str) -> SandboxInfo:
    """A status answer as a :class:`SandboxInfo`: ``name`` is the claim, ``router`` the bound
    sandbox (empty until bound); phase ``Ready``, ``Failed`` (a terminal condition) or
    ``Pending``."""
    obj = json_object(reply.content, what)
    sandbox, namespace = obj.get("sandbox_name"), obj.get("namespace")
    if not isinstance(sandbox, str | None) or not isinstance(namespace, str) or not namespace:
        raise protocol_error(what, "'sandbox_name' or 'namespace' is missing or not a string", _API)
    condition = _ready_condition(obj, what)
    reason = condition.get("reason") if isinstance(condition.get("reason"), str) else None
    message = condition.get("message") if isinstance(condition.get("message"), str) else None
    ready = obj.get("ready") is True and bool(sandbox)
    failed = condition.get("status") == "False" and (
        reason in _FAILED_REASONS or reason in ("TemplateNotFound", "WarmPoolNotFound")
    )
    return SandboxInfo(
        name=name,
        namespace=namespace,
        template=None,
        phase="Ready" if ready else "Failed" if failed else "Pending",
        ready=ready,
        router=RouterTarget(sandbox_id=sandbox or "", namespace=namespace),
        reason=reason,
        message=message,
    )


def parse_lifetime(reply: Reply, what: str) -> Lifetime:
    obj = json_object(reply.content, what)
    when = obj.get("shutdown_time")
    return Lifetime(when if isinstance(when, str) else None, obj.get("capped") is True)


# --------------------------------------------------------------------------------------------
# Errors

_HINTS = {
    400: "The broker refused the request as malformed; the text above says which field.",
    401: "The broker did not accept the token; run `agent-sandbox-awx doctor`.",
    403: "Your identity may not do this (another identity's claim, a warm pool or scopes your "
    "policy does not allow); ask the broker's operator.",
    404: "The claim does not exist (any more): it may have expired or been deleted.",
    413: "Send less data per request.",
    429: "Too many sandboxes or requests: kill the ones you no longer need, or retry later.",
}
_CREATE_400_HINT = (
    " Of the create's fields, 'lifecycle' is the lifetime (timeout=, AGENT_SANDBOX_TTL_SECONDS; "
    "with neither, the default 300 s, which only a broker that honours 'Prefer: "
    "clamp-lifetime' cuts at its policy's cap) and 'warmpool' the template (template=, "
    "AGENT_SANDBOX_TEMPLATE or AGENT_SANDBOX_WARMPOOL)."
)
"""Added to a create's 400: the text names the wire field, the user set the SDK's."""


def _op_of(spec: RequestSpec) -> str:
    try:
        op = json.loads(spec.content or b"{}").get("op")
    except (ValueError, AttributeError):
        op = None
    return op if isinstance(op, str) else "?"


def error_from_response(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    spec: RequestSpec,
    retried_auth: bool = False,
    secrets: Iterable[str] = (),
) -> BrokerError:
    """An ``/rpc`` error answer: its plain-text body (the first 200 characters, redacted)."""
    if spec.data_plane or 300 <= status < 400:  # the shared data plane; redirects alike
        return v1.error_from_response(
            status, headers, body, spec=spec, retried_auth=retried_auth, secrets=secrets
        )
    secrets = tuple(secrets)
    text = " ".join(redact_answer(body.decode("utf-8", "replace"), secrets).split())
    text = text[:ERROR_CHARS] or "no detail given"
    cls = v1._error_class(status, None)
    extra = " (the credential was re-read and the request retried once)" if retried_auth else ""
    retry_after = headers.get("retry-after")
    if retry_after and status in (429, 503):
        extra += f" (Retry-After: {redact_answer(retry_after, secrets)[:40]})"
    hint = _HINTS.get(status, "Retry later; if it persists, contact the broker's operator.")
    if status == 400 and _op_of(spec) == "create":
        hint += _CREATE_400_HINT
    return cls(
        f"Could not {spec.what} (POST {RPC}, op {_op_of(spec)}): the broker answered "
        f"{status}: {text}{extra}. {hint}",
        status_code=status,
        detail=text,
        method=spec.method,
        path=spec.path,
    )


# --------------------------------------------------------------------------------------------
# The dialect


class RpcDialect(Dialect):
    """The ``/rpc`` dialect (no list, no whoami, no replay of a create, no sandbox-wide
    environment)."""

    name = "rpc"
    features = frozenset({LIFETIME})  # no list, no whoami, no replay, no sandbox env
    created_name_field = "claim_name"
    error_from_response = staticmethod(error_from_response)

    def healthz(self) -> Call[Reply]:
        # No health op: any answer of the endpoint (405 to a GET) shows the broker is there.
        return Call(RequestSpec("GET", RPC, "reach the broker", retryable=True, probe=True), raw)

    def whoami(self) -> Call[dict[str, Any]]:
        raise self.unsupported(
            "whoami",
            "Deployed /rpc brokers do not say who you are; `agent-sandbox-awx doctor` shows "
            "the token's claims.",
        )

    def create(self, request: CreateRequest) -> RequestSpec:
        if request.env:  # no SANDBOX_ENV feature
            raise self.unsupported(
                "envs= (env=)",
                "Give the variables to each command instead: commands.run(..., envs={...}).",
            )
        return create(request)

    def parse_created(self, reply: Reply, spec: RequestSpec) -> SandboxInfo:
        return parse_created(reply, spec)

    def get(self, name: str) -> Call[SandboxInfo]:
        spec = status(name)
        return Call(spec, lambda reply: parse_status(name, reply, spec.what))

    def wait_ready(
        self,
        name: str,
        remaining: float,
        request_timeout: float,
        *,
        poll: int = 0,
        poll_interval: float = 2.0,
    ) -> Call[SandboxInfo]:
        del request_timeout  # one short status request per poll
        pause = 0.0 if poll == 0 else min(poll_interval, FIRST_POLL_PAUSE * 2 ** (poll - 1))
        what = f"wait for sandbox {name!r} to become ready"
        spec = status(name, delay=max(0.0, min(pause, remaining)), what=what)
        return Call(spec, lambda reply: v1.raise_not_found(parse_status(name, reply, spec.what)))

    def list_sandboxes(
        self, label_selector: Mapping[str, str] | str | None
    ) -> Call[list[SandboxInfo]]:
        raise self.unsupported(
            "list",
            "Deployed /rpc brokers cannot list sandboxes; keep the names create returned "
            "(Sandbox.name) and use Sandbox.connect(name).",
        )

    def delete(self, name: str, *, purpose: str | None = None) -> Call[bool]:
        fields = {"claim_name": _claim(name), "request_purpose": purpose}
        # 204 also for an absent claim: the dialect cannot tell "already gone".
        return Call(_op("delete", f"delete sandbox {name!r}", fields, retryable=True), _true)

    def extend(self, name: str, seconds: int) -> Call[Lifetime]:
        fields = {"claim_name": _claim(name), "lifecycle": lifecycle(seconds)}
        spec = _op("extend", f"extend sandbox {name!r}", fields, retryable=True)
        return Call(spec, lambda reply: parse_lifetime(reply, spec.what))

    def token_rejected(
        self,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
        spec: RequestSpec | None = None,
    ) -> bool:
        if spec is not None and spec.data_plane:
            return v1.is_token_rejection(status, headers, body)
        return status == 401  # the control plane is the broker itself

    def data_target(self, info: SandboxInfo) -> RpcTarget:
        return RpcTarget(info.router, info.name)


def _true(reply: Reply) -> bool:
    del reply
    return True
