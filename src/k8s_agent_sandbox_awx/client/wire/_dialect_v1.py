"""The broker API v1 (docs/broker-api.md): the first :class:`Dialect`.

``/v1/sandboxes`` with an ``Idempotency-Key`` on create, a long-poll ``?wait=ready``, a 404
on delete meaning "already gone", error bodies ``{"code", "detail"}`` mapped to typed errors
with hints, and upstream's router headers on the data plane.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

from ...errors import (
    BrokerAuthenticationError,
    BrokerConflictError,
    BrokerError,
    BrokerNotFoundError,
    BrokerPermissionError,
    BrokerQuotaError,
    BrokerRedirectError,
    BrokerTemplateNotFoundError,
    BrokerUnavailableError,
    BrokerWarmPoolNotFoundError,
    LifetimeExceedsPolicyError,
    ReservedMetadataError,
)
from ._commands_wire import MAX_COMMAND_TIMEOUT
from ._dialect import CreateRequest, Dialect, Lifetime, default_lifetime_marked
from ._protocol import (
    Call,
    Reply,
    RequestSpec,
    RouterTarget,
    SandboxInfo,
    check_reserved_metadata,
    json_body,
    json_object,
    parse_json,
    protocol_error,
    raw,
    redact_answer,
    redact_url,
    seconds,
    selector_text,
    str_mapping,
)
from ._refusals import broker_fix
from ._runtime_errors import is_runtime_answer, runtime_error

__all__ = [
    "API",
    "MAX_WAIT_SECONDS",
    "RESERVED_PREFIX",
    "TOKEN_REJECTION_CODES",
    "V1Dialect",
    "error_from_response",
    "is_token_rejection",
]

API = "/v1"
MAX_WAIT_SECONDS = 60.0
"""The broker's upper bound for one long-poll ``?wait=ready&timeout=``."""
RESERVED_PREFIX = "broker.agent-sandbox-awx.io/"
MAX_ENV_BYTES = 8192
"""The largest ``env=`` of a create, as compact JSON in UTF-8: the broker hands it to the
sandbox's runtime in one header with each command start (= the broker's
``runtime._env.MAX_ENV_BYTES``; a test holds them equal)."""

# --------------------------------------------------------------------------------------------
# Requests


def _name_path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"Invalid sandbox name {name!r}: use a name from Sandbox.list().")
    return f"{API}/sandboxes/{quote(name, safe='')}"


def healthz() -> RequestSpec:
    return RequestSpec("GET", f"{API}/healthz", "check the broker's health", retryable=True)


def whoami() -> RequestSpec:
    return RequestSpec("GET", f"{API}/whoami", "ask the broker who I am", retryable=True)


def create(
    *,
    idempotency_key: str,
    template: str | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    lifetime_seconds: int | None = None,
    env: Mapping[str, str] | None = None,
) -> RequestSpec:
    if not idempotency_key or len(idempotency_key) > 255 or not idempotency_key.isprintable():
        raise ValueError("An Idempotency-Key must be 1-255 printable ASCII characters.")
    labels, annotations = str_mapping("labels", labels), str_mapping("annotations", annotations)
    env = str_mapping("env", env)
    check_reserved_metadata("labels", "labels", labels)
    check_reserved_metadata("annotations", "annotations", annotations)
    if lifetime_seconds is not None and lifetime_seconds <= 0:
        raise ValueError(f"lifetime_seconds must be positive, got {lifetime_seconds}.")
    body: dict[str, Any] = {}
    if template is not None:
        body["template"] = template
    if labels:
        body["labels"] = dict(labels)
    if annotations:
        body["annotations"] = dict(annotations)
    if lifetime_seconds is not None:
        body["lifetime_seconds"] = lifetime_seconds
    if env:
        _check_env_size(env)
        body["env"] = dict(env)
    spec = RequestSpec(
        "POST",
        f"{API}/sandboxes",
        "create a sandbox",
        headers={"Idempotency-Key": idempotency_key},
        retryable=True,  # the key makes a retried create return the same sandbox
    )
    return json_body(spec, body)


def _check_env_size(env: Mapping[str, str]) -> None:
    """Refuse an ``env=`` over :data:`MAX_ENV_BYTES` before anything is sent (never naming a
    value: they may be secrets)."""
    try:
        size = len(json.dumps(dict(env), separators=(",", ":"), ensure_ascii=False).encode())
    except UnicodeEncodeError:
        raise ValueError(
            "env= holds text that is not UTF-8 (a lone surrogate), which no environment can "
            "carry: remove it."
        ) from None
    if size > MAX_ENV_BYTES:
        raise ValueError(
            f"env= is {size} bytes as JSON, more than the {MAX_ENV_BYTES} a sandbox's "
            "environment may hold (it is sent to the runtime with each command): pass large "
            "values as files (sandbox.files.write) instead."
        )


def get(
    name: str, *, wait_ready: float | None = None, request_timeout: float = 30.0
) -> RequestSpec:
    """``wait_ready``: seconds the broker may hold the request until Ready (long-poll)."""
    if wait_ready is None:
        return RequestSpec("GET", _name_path(name), f"get sandbox {name!r}", retryable=True)
    wait = max(0.0, min(MAX_WAIT_SECONDS, wait_ready))
    return RequestSpec(
        "GET",
        _name_path(name),
        f"wait for sandbox {name!r} to become ready",
        params={"wait": "ready", "timeout": seconds(wait)},
        retryable=True,
        read_timeout=wait + request_timeout,
    )


def list_sandboxes(label_selector: Mapping[str, str] | str | None = None) -> RequestSpec:
    selector = selector_text(label_selector)
    params = {"label_selector": selector} if selector else {}
    return RequestSpec("GET", f"{API}/sandboxes", "list my sandboxes", params, retryable=True)


def set_lifetime(name: str, seconds: int) -> RequestSpec:
    """``PUT .../lifetime``: the deadline becomes now + ``seconds`` (retryable: idempotent in
    effect)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds <= 0:
        raise ValueError(
            f"A sandbox's timeout must be a positive whole number of seconds, got {seconds!r}."
        )
    spec = RequestSpec(
        "PUT",
        f"{_name_path(name)}/lifetime",
        f"set the lifetime of sandbox {name!r}",
        retryable=True,
    )
    return json_body(spec, {"seconds": seconds})


def delete(name: str) -> RequestSpec:
    return RequestSpec(
        "DELETE", _name_path(name), f"delete sandbox {name!r}", retryable=True, not_found_ok=True
    )


# --------------------------------------------------------------------------------------------
# Answers


def _object_field(obj: dict[str, Any], key: str, what: str) -> dict[str, Any]:
    """``obj[key]`` as a JSON object (absent or null: empty)."""
    value = obj.get(key) or {}
    if not isinstance(value, dict):
        raise protocol_error(
            what, f"the Sandbox object's {key!r} is a {type(value).__name__}, not a JSON object"
        )
    return value


def parse_sandbox(obj: Any, what: str = "read the sandbox") -> SandboxInfo:
    if not isinstance(obj, dict):
        raise protocol_error(what, "the Sandbox object is not a JSON object")
    router_obj = _object_field(obj, "router", what)
    labels = _object_field(obj, "labels", what)
    annotations = _object_field(obj, "annotations", what)
    owner = _object_field(obj, "owner", what)
    try:
        name = obj["name"]
        phase = obj["phase"]
        namespace = obj.get("namespace") or "default"
        router = RouterTarget(
            sandbox_id=str(router_obj.get("sandbox_id") or name),
            namespace=str(router_obj.get("namespace") or namespace),
            port=int(router_obj.get("port") or 8888),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise protocol_error(what, f"the Sandbox object lacks or has a bad field ({exc})") from exc
    if not isinstance(name, str) or not isinstance(phase, str):
        raise protocol_error(what, "'name' and 'phase' must be strings")
    keys = ("namespace", "template", "reason", "message", "created_at", "expires_at", "started_at")
    for key in keys:
        if not isinstance(obj.get(key), str | None):
            raise protocol_error(what, f"the Sandbox object's {key!r} is not a string")
    return SandboxInfo(
        name=name,
        namespace=str(namespace),
        template=obj.get("template"),
        phase=phase,
        ready=bool(obj.get("ready", phase == "Ready")),
        router=router,
        reason=obj.get("reason"),
        message=obj.get("message"),
        created_at=obj.get("created_at"),
        expires_at=obj.get("expires_at"),
        started_at=obj.get("started_at"),
        labels=dict(labels),
        annotations=dict(annotations),
        owner=dict(owner),
    )


def parse_sandbox_list(obj: Any) -> list[SandboxInfo]:
    what = "list my sandboxes"
    if not isinstance(obj, dict) or not isinstance(obj.get("items"), list):
        raise protocol_error(what, 'expected {"items": [...]}')
    return [parse_sandbox(item, what) for item in obj["items"]]


def parse_whoami(reply: Reply, spec: RequestSpec) -> dict[str, Any]:
    result = json_object(reply.content, spec.what)
    for key in ("attributes", "policy"):
        value = result.get(key)
        if value is not None and not isinstance(value, dict):
            raise protocol_error(
                spec.what, f"{key!r} is a {type(value).__name__}, not a JSON object"
            )
    return result


# --------------------------------------------------------------------------------------------
# Error mapping

_HINTS: dict[str, str] = {
    "invalid_request": "Fix the request as the detail says.",
    "invalid_header": "X-Sandbox-ID, -Namespace and -Port come from the sandbox object "
    "(reconnect with Sandbox.connect(name)); X-Sandbox-Timeout comes from the command's timeout "
    f"(at most {MAX_COMMAND_TIMEOUT:g} s).",
    "invalid_path": "Use a path relative to the sandbox root.",
    "path_not_normalized": "Send the request path resolved (no '.', '..' or empty segments, "
    "no '\\' or ';', percent-encoding only in a file path or the query), as the SDK builds it.",
    "invalid_method": "Send the HTTP method in upper case (POST, not post), as the SDK does.",
    "token_missing": "No token reached the broker; run `agent-sandbox-awx doctor`.",
    "token_malformed": "The token is not a valid JWT; check the token source with "
    "`agent-sandbox-awx doctor`.",
    "token_expired": "The token expired: refresh its source (projected token file, CI job token) "
    "and retry; `agent-sandbox-awx doctor` shows its expiry.",
    "token_not_yet_valid": "The token is not valid yet: check this machine's clock "
    "(`agent-sandbox-awx doctor` shows the skew).",
    "audience_mismatch": "Request a token whose audience is exactly the broker URL.",
    "unknown_issuer": "The broker does not trust the token's issuer; use a token from a "
    "trusted issuer or ask the broker's operator to add it.",
    "bad_signature": "The token's signature does not verify (keys may have rotated); get a "
    "fresh token.",
    "token_revoked": "The broker revoked this token; get a fresh one from its source.",
    "algorithm_not_allowed": "The token's signing algorithm is not allowed by the broker; use "
    "a token from a supported issuer.",
    "token_too_large": "The token is larger than the broker accepts; use a smaller token.",
    "missing_claim": "The token lacks a claim the broker requires; use a token from a "
    "supported provider.",
    "policy_denied": "Your identity's policy does not allow this; see `agent-sandbox-awx "
    "whoami` for your policy or ask the broker's operator.",
    "template_not_allowed": "Choose a template your policy allows (`agent-sandbox-awx whoami` "
    "lists them).",
    "reserved_metadata": f"Remove the labels/annotations under {RESERVED_PREFIX} (the broker "
    "sets them) and agents.x-k8s.io/ (upstream's controller reads them), subdomains included; "
    "use keys under a prefix of your own, e.g. 'example.com/...'.",
    "lifetime_exceeds_policy": "Ask for a shorter timeout (timeout= or "
    "AGENT_SANDBOX_TTL_SECONDS): the policy caps a sandbox's lifetime from its creation "
    "(`agent-sandbox-awx whoami` shows max_lifetime_seconds); with neither set, the SDK's "
    "default of 300 s is cut at the cap by a broker that honours 'Prefer: clamp-lifetime'.",
    "not_owner": "This sandbox belongs to another identity; use one of yours "
    "(`agent-sandbox-awx ls`).",
    "not_found": "Check the name with `agent-sandbox-awx ls`; it may have expired or been deleted.",
    "template_not_found": "Check the template name (`agent-sandbox-awx whoami` lists the "
    "allowed ones).",
    "idempotency_conflict": "An earlier create used this Idempotency-Key with another body; "
    "use a new key.",
    "not_ready": "Wait until the sandbox is Ready (Sandbox.create waits for you).",
    "terminating": "The sandbox is being deleted; create a new one.",
    "too_large": "The body is larger than the broker accepts; send less data per request.",
    "quota_exceeded": "You hold too many sandboxes: kill the ones you no longer need "
    "(`agent-sandbox-awx ls`, `agent-sandbox-awx kill NAME`).",
    "rate_limited": "Too many requests; retry later.",
    "sandbox_unreachable": "The broker could not reach the sandbox runtime; retry later or "
    "create a new sandbox.",
    "sandbox_answer_lost": "The request may have reached the sandbox (a command may run): it is "
    "retried only if it is idempotent; check the sandbox's state (commands.list()).",
    "unavailable": "The broker or the sandbox is temporarily unavailable; retry later.",
    "issuer_unavailable": "The broker cannot check tokens of your issuer right now (it cannot "
    "fetch the issuer's keys): an outage of the issuer, not a bad token; retry later.",
    "sandbox_timeout": "The sandbox runtime did not answer in time; retry, or allow more time.",
}

TOKEN_REJECTION_CODES = frozenset(
    {
        "token_missing",
        "token_malformed",
        "token_expired",
        "token_not_yet_valid",
        "audience_mismatch",
        "unknown_issuer",
        "bad_signature",
        "algorithm_not_allowed",
        "token_too_large",
        "missing_claim",
        "token_revoked",
    }
)
"""The ``code`` values of the broker's own 401 answers (docs/broker-api.md, Errors)."""


BROKER_ERROR_HEADER = "Agent-Sandbox-Broker-Error"
"""The header a v1 broker sets (to the error code) on the error answers it makes itself and
strips from every answer it forwards from a sandbox."""


def is_token_rejection(status: int, headers: Mapping[str, str], body: bytes) -> bool:
    """Whether an answer is the broker rejecting the token: a ``401`` carrying the broker's mark
    (:data:`BROKER_ERROR_HEADER`) with one of the documented token codes, the same code as its
    error body. Only such an answer makes the client re-read the credential and send the
    request once more (the broker refused it before it reached a sandbox). Any other ``401``
    comes from behind the broker (a sandbox runtime's own answer, passed through unchanged;
    code in a sandbox can imitate the body, but the broker strips the mark from what it
    forwards): it is a result or an error, never a reason to replay (a command must not run
    twice)."""
    if status != 401:
        return False
    mark = headers.get(BROKER_ERROR_HEADER)
    return mark in TOKEN_REJECTION_CODES and _error_body(body)[0] == mark


_STATUS_CLASSES: dict[int, type[BrokerError]] = {
    401: BrokerAuthenticationError,
    403: BrokerPermissionError,
    404: BrokerNotFoundError,
    409: BrokerConflictError,
    429: BrokerQuotaError,
    502: BrokerUnavailableError,
    503: BrokerUnavailableError,
    504: BrokerUnavailableError,
}


def _error_body(body: bytes, secrets: Iterable[str] = ()) -> tuple[str | None, str | None]:
    """``(code, detail)`` of an error body, redacted (:func:`redact_answer`)."""
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        text = redact_answer(body.decode("utf-8", "replace"), secrets).strip()[:300]
        return None, text or None
    if not isinstance(obj, dict):
        return None, None
    code = obj.get("code")
    detail = obj.get("detail")
    if detail is not None:
        limit = None if isinstance(detail, str) else 500
        text = detail if isinstance(detail, str) else json.dumps(detail)
        detail = redact_answer(text, secrets)[:limit]
    return (redact_answer(code, secrets) if isinstance(code, str) else None), detail


def _error_class(status: int, code: str | None) -> type[BrokerError]:
    if code == "template_not_found":
        return BrokerTemplateNotFoundError
    if code == "lifetime_exceeds_policy":
        return LifetimeExceedsPolicyError
    if code == "reserved_metadata":
        return ReservedMetadataError
    cls = _STATUS_CLASSES.get(status, BrokerError)
    if status >= 500 and cls is BrokerError:
        return BrokerUnavailableError
    return cls


def _hint(status: int, code: str | None, spec: RequestSpec) -> str:
    if code == "invalid_path" and not spec.data_plane:
        return "Sandbox names are DNS-1123 labels; check the name with `agent-sandbox-awx ls`."
    return _HINTS.get(code or "") or {
        400: "The request was malformed; this is likely a client bug, please report it.",
        401: "Run `agent-sandbox-awx doctor` to check the token.",
        403: "Your identity is not allowed to do this; see `agent-sandbox-awx whoami` for "
        "your policy or ask the broker's operator.",
        413: "Send less data per request.",
    }.get(status, "Retry later; if it persists, contact the broker's operator.")


def error_from_response(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    spec: RequestSpec,
    retried_auth: bool = False,
    secrets: Iterable[str] = (),
) -> BrokerError:
    """Map an error response to a typed exception whose message says what to do. Everything
    taken from the answer is redacted, ``secrets`` (the caller's token) included."""
    secrets = tuple(secrets)
    code, detail = _error_body(body, secrets)
    request = f"{spec.method} {spec.path}"
    common: dict[str, Any] = {
        "status_code": status,
        "code": code,
        "detail": detail,
        "method": spec.method,
        "path": spec.path,
    }
    if 300 <= status < 400:
        location = headers.get("location")
        if location is not None:
            location = redact_url(redact_answer(location, secrets))
        return BrokerRedirectError(
            f"Could not {spec.what}: the server answered {status} with a redirect to "
            f"{location or '(no Location)'}. Redirects are never followed, so that the token "
            "cannot reach another origin; set the broker URL to the broker's final URL.",
            location=location,
            **common,
        )
    reason = detail or "no detail given"
    if spec.data_plane and is_runtime_answer(status, code):
        return runtime_error(status, reason, spec, common, body)
    cls, hint = _error_class(status, code), _hint(status, code, spec)
    extra = ""
    if status == 401 and retried_auth:
        extra = " (the credential was re-read and the request retried once)"
    retry_after = headers.get("retry-after")
    if retry_after and status in (429, 503):
        extra += f" (Retry-After: {redact_answer(retry_after, secrets)})"
    label = f"{status} {code}" if code else str(status)
    fix = broker_fix(code, spec.path)  # a setting to change: named as the user's surface does
    return cls(
        f"Could not {spec.what} ({request}): the broker answered {label}: {reason}{extra}."
        + ("" if fix else f" {hint}"),
        fix=fix,
        **common,
    )


# --------------------------------------------------------------------------------------------
# The dialect


NOT_FOUND_CHARS = 200
"""The controller's message shown in a not-found error, at most this long."""


def raise_not_found(info: SandboxInfo) -> SandboxInfo:
    """``info``, unless its claim failed because its warm pool or template does not exist:
    then the typed error (the create that waits for it deletes the claim). Both dialects: a
    Kubernetes-backed broker learns it from the controller, after the create."""
    if info.phase != "Failed" or info.reason not in ("TemplateNotFound", "WarmPoolNotFound"):
        return info
    detail = redact_answer(info.message or "no message")[:NOT_FOUND_CHARS]
    if info.reason == "TemplateNotFound":
        raise BrokerTemplateNotFoundError(
            f"Sandbox {info.name!r} cannot start: its warm pool's template does not exist "
            f"({detail}). Ask the broker's operator, or choose another warm pool (template=).",
            code="TemplateNotFound",
            detail=detail,
        )
    raise BrokerWarmPoolNotFoundError(
        f"Sandbox {info.name!r} cannot start: the warm pool does not exist ({detail}). Check "
        "the name given as template= (or warmpool=, AGENT_SANDBOX_WARMPOOL).",
        name=info.name,
        reason=info.reason,
        detail=detail,
    )


def _sandbox_of(spec: RequestSpec) -> Call[SandboxInfo]:
    return Call(spec, lambda reply: parse_sandbox(parse_json(reply.content, spec.what), spec.what))


class V1Dialect(Dialect):
    """The broker API v1 (every optional operation)."""

    name = "v1"
    error_from_response = staticmethod(error_from_response)

    def healthz(self) -> Call[Reply]:
        return Call(healthz(), raw)

    def whoami(self) -> Call[dict[str, Any]]:
        spec = whoami()
        return Call(spec, lambda reply: parse_whoami(reply, spec))

    def create(self, request: CreateRequest) -> RequestSpec:
        for option in ("pod_labels", "pod_annotations", "scopes"):
            if getattr(request, option):
                raise self.unsupported(
                    f"{option}=",
                    "The broker API v1 decides the pod and the scopes from its policy; leave "
                    f"{option}= out (the /rpc dialect of deployed brokers accepts it).",
                )
        spec = create(
            idempotency_key=request.idempotency_key,
            template=request.template,
            labels=request.labels,
            annotations=request.annotations,
            lifetime_seconds=request.lifetime_seconds,
            env=request.env,
        )
        return default_lifetime_marked(spec, request)

    def parse_created(self, reply: Reply, spec: RequestSpec) -> SandboxInfo:
        return parse_sandbox(parse_json(reply.content, spec.what), spec.what)

    def get(self, name: str) -> Call[SandboxInfo]:
        return _sandbox_of(get(name))

    def wait_ready(
        self,
        name: str,
        remaining: float,
        request_timeout: float,
        *,
        poll: int = 0,
        poll_interval: float = 2.0,
    ) -> Call[SandboxInfo]:
        del poll, poll_interval  # a long-poll: the broker answers when Ready (or at the wait)
        spec = get(name, wait_ready=remaining, request_timeout=request_timeout)
        return Call(
            spec,
            lambda reply: raise_not_found(
                parse_sandbox(parse_json(reply.content, spec.what), spec.what)
            ),
        )

    def list_sandboxes(
        self, label_selector: Mapping[str, str] | str | None
    ) -> Call[list[SandboxInfo]]:
        spec = list_sandboxes(label_selector)
        return Call(spec, lambda reply: parse_sandbox_list(parse_json(reply.content, spec.what)))

    def delete(self, name: str, *, purpose: str | None = None) -> Call[bool]:
        del purpose  # v1 has no field for it
        return Call(delete(name), lambda reply: reply.status_code != 404)

    def extend(self, name: str, seconds: int) -> Call[Lifetime]:
        spec = set_lifetime(name, seconds)

        def parse(reply: Reply) -> Lifetime:
            info = parse_sandbox(parse_json(reply.content, spec.what), spec.what)
            return Lifetime(info.expires_at, info=info)

        return Call(spec, parse)

    def token_rejected(
        self,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
        spec: RequestSpec | None = None,
    ) -> bool:
        return is_token_rejection(status, headers, body)
