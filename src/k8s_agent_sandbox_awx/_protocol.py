"""The broker wire protocol (docs/broker-api.md) without any I/O.

Request building (paths, query, headers incl. router headers and ``Idempotency-Key``, JSON
bodies, multipart framing), response parsing, error mapping and retry decisions live here, so
that the sync client (``_transport``) and an async one only add the I/O.
"""

from __future__ import annotations

import json
import math
import posixpath
import random
import re
import secrets
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

from ._exceptions import (
    BrokerAuthenticationError,
    BrokerConflictError,
    BrokerError,
    BrokerNotFoundError,
    BrokerPermissionError,
    BrokerProtocolError,
    BrokerQuotaError,
    BrokerRedirectError,
    BrokerTemplateNotFoundError,
    BrokerUnavailableError,
)
from ._jwt import redact
from ._upstream import ExecutionResult, FileEntry

__all__ = [
    "COMMAND_TIMEOUT_MARGIN",
    "MAX_COMMAND_TIMEOUT",
    "MAX_SANDBOX_TIMEOUT",
    "MAX_WAIT_SECONDS",
    "TOKEN_REJECTION_CODES",
    "Multipart",
    "RequestSpec",
    "RetryPolicy",
    "RouterTarget",
    "SandboxInfo",
    "error_from_response",
    "is_token_rejection",
    "multipart_framing",
    "parse_execution_result",
    "parse_exists",
    "parse_file_entries",
    "parse_json",
    "parse_retry_after",
    "parse_sandbox",
    "parse_sandbox_list",
    "redact_answer",
    "redact_url",
    "validate_sandbox_path",
]

API = "/v1"
MAX_WAIT_SECONDS = 60.0
"""The broker's upper bound for one long-poll ``?wait=ready&timeout=``."""
COMMAND_TIMEOUT_MARGIN = 10.0
"""Seconds the client waits for an answer beyond a command's own time limit."""
MAX_SANDBOX_TIMEOUT = 86400.0
"""The largest ``X-Sandbox-Timeout`` the broker accepts (seconds it waits for a runtime)."""
MAX_COMMAND_TIMEOUT = MAX_SANDBOX_TIMEOUT - COMMAND_TIMEOUT_MARGIN / 2
"""The longest command time limit: the client sends ``X-Sandbox-Timeout`` = limit + 5 s."""
RESERVED_PREFIX = "broker.agent-sandbox-awx.io/"

# --------------------------------------------------------------------------------------------
# Value types


@dataclass(frozen=True)
class RouterTarget:
    """Where the data plane goes: the values of the router headers."""

    sandbox_id: str
    namespace: str = "default"
    port: int = 8888

    def headers(self) -> dict[str, str]:
        return {
            "X-Sandbox-ID": self.sandbox_id,
            "X-Sandbox-Namespace": self.namespace,
            "X-Sandbox-Port": str(self.port),
        }


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the broker reports it (the Sandbox object of the broker API)."""

    name: str
    namespace: str
    template: str | None
    phase: str
    ready: bool
    router: RouterTarget
    reason: str | None = None
    message: str | None = None
    created_at: str | None = None
    expires_at: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    owner: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "template": self.template,
            "phase": self.phase,
            "ready": self.ready,
            "reason": self.reason,
            "message": self.message,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "owner": dict(self.owner),
            "router": {
                "sandbox_id": self.router.sandbox_id,
                "namespace": self.router.namespace,
                "port": self.router.port,
            },
        }


@dataclass
class RequestSpec:
    """One request, described without I/O. ``path`` is relative to the broker URL."""

    method: str
    path: str
    what: str
    """What the request does, for messages: "create a sandbox", "run a command"..."""
    params: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None
    retryable: bool = False
    """Idempotent (GET, DELETE, create with its key, replayable upload): may be retried."""
    read_timeout: float | None = None
    """Overrides the request timeout for reading the answer (long-poll, commands)."""
    data_plane: bool = False
    not_found_ok: bool = False
    """A 404 is an answer, not an error (delete: already gone)."""


# --------------------------------------------------------------------------------------------
# Request builders: control plane


def _json_body(spec: RequestSpec, body: Any) -> RequestSpec:
    spec.content = json.dumps(body, separators=(",", ":")).encode("utf-8")
    spec.headers["Content-Type"] = "application/json"
    return spec


def _name_path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"Invalid sandbox name {name!r}: use a name from Sandbox.list().")
    return f"{API}/sandboxes/{quote(name, safe='')}"


def healthz() -> RequestSpec:
    return RequestSpec("GET", f"{API}/healthz", "check the broker's health", retryable=True)


def whoami() -> RequestSpec:
    return RequestSpec("GET", f"{API}/whoami", "ask the broker who I am", retryable=True)


def new_idempotency_key() -> str:
    return str(uuid.uuid4())


def str_mapping(argument: str, value: Mapping[str, str] | None) -> dict[str, str]:
    """``value`` as a dict of str to str, else a TypeError naming ``argument`` (never its
    values, which may be secrets such as ``env=``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{argument}= must be a mapping of str to str, such as {{'team': 'ml'}}, "
            f"not a {type(value).__name__}."
        )
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(
                f"{argument}= must map str to str; it has a key of type {type(key).__name__}: "
                "convert it with str()."
            )
        if not isinstance(item, str):
            raise TypeError(
                f"{argument}= must map str to str; the value of {key!r} is of type "
                f"{type(item).__name__}: convert it with str()."
            )
    return dict(value)


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
    for kind, meta in (("label", labels), ("annotation", annotations)):
        for key in meta:
            if key.startswith(RESERVED_PREFIX):
                raise ValueError(
                    f"The {kind} key {key!r} is reserved for the broker's attribution stamps "
                    f"(prefix {RESERVED_PREFIX}); choose another key."
                )
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
        body["env"] = dict(env)
    spec = RequestSpec(
        "POST",
        f"{API}/sandboxes",
        "create a sandbox",
        headers={"Idempotency-Key": idempotency_key},
        retryable=True,  # the key makes a retried create return the same sandbox
    )
    return _json_body(spec, body)


def get(
    name: str, *, wait_ready: float | None = None, request_timeout: float = 30.0
) -> RequestSpec:
    """``wait_ready``: seconds the broker may hold the request until Ready (long-poll)."""
    spec = RequestSpec("GET", _name_path(name), f"get sandbox {name!r}", retryable=True)
    if wait_ready is not None:
        wait = max(0.0, min(MAX_WAIT_SECONDS, wait_ready))
        spec.params = {"wait": "ready", "timeout": _seconds(wait)}
        spec.read_timeout = wait + request_timeout
        spec.what = f"wait for sandbox {name!r} to become ready"
    return spec


def list_sandboxes(label_selector: Mapping[str, str] | str | None = None) -> RequestSpec:
    spec = RequestSpec("GET", f"{API}/sandboxes", "list my sandboxes", retryable=True)
    if label_selector:
        if isinstance(label_selector, str):
            selector = label_selector
        elif not isinstance(label_selector, Mapping):
            raise TypeError(
                "label_selector must be a str such as 'team=ml' or a mapping such as "
                f"{{'team': 'ml'}}, not a {type(label_selector).__name__}."
            )
        else:
            pairs = str_mapping("label_selector", label_selector)
            selector = ",".join(f"{k}={v}" for k, v in pairs.items())
        spec.params = {"label_selector": selector}
    return spec


def delete(name: str) -> RequestSpec:
    return RequestSpec(
        "DELETE", _name_path(name), f"delete sandbox {name!r}", retryable=True, not_found_ok=True
    )


# --------------------------------------------------------------------------------------------
# Request builders: data plane (legacy python-runtime endpoints behind the router headers)


def _seconds(value: float) -> str:
    return f"{value:g}"


def validate_sandbox_path(
    path: str, *, allow_root: bool = False, allow_unsafe: bool = False
) -> str:
    """A sandbox-relative path, checked like upstream: no control characters, no empty name,
    no ``..`` segment. Returns the normalised relative path (``.`` for the root if allowed).

    ``allow_unsafe`` (a file operation's ``allow_unsafe_paths=True``) skips the name checks,
    as upstream does, but never the control characters: a CR/LF would end up in the upload's
    multipart headers (another file name, the framing in the content), a NUL in the runtime's
    system calls."""
    if not isinstance(path, str):
        raise TypeError(f"A sandbox path must be a str, got {type(path).__name__}.")
    bad = next((i for i, c in enumerate(path) if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(
            f"The sandbox path {path!r} contains a control character (U+{ord(path[bad]):04X} "
            f"at index {bad}). Paths must not contain control characters (U+0000-U+001F, "
            "U+007F), even with allow_unsafe_paths=True; remove them."
        )
    if allow_unsafe:
        if not path:
            raise ValueError("The sandbox path is empty; name a file relative to the sandbox root.")
        return path.lstrip("/") or "."
    if not path.strip():
        if allow_root:
            return "."
        raise ValueError("The sandbox path is empty; name a file relative to the sandbox root.")
    if any(part == ".." for part in path.split("/")):
        raise ValueError(
            f"The sandbox path {path!r} contains '..'; paths must stay inside the sandbox root."
        )
    normalized = posixpath.normpath(path).lstrip("/")
    if not normalized or normalized == ".":
        if allow_root:
            return "."
        raise ValueError(f"The sandbox path {path!r} does not name a file.")
    return normalized


def _data(method: str, endpoint: str, what: str, router: RouterTarget) -> RequestSpec:
    return RequestSpec(
        method, endpoint, what, headers=router.headers(), retryable=method == "GET", data_plane=True
    )


def execute(router: RouterTarget, command: str, *, command_timeout: float) -> RequestSpec:
    """``POST /execute``: never retried (it is not idempotent)."""
    if not isinstance(command, str) or not command.strip():
        raise ValueError("The command is empty; pass the command line to run, e.g. 'echo hi'.")
    if not math.isfinite(command_timeout) or command_timeout <= 0:
        raise ValueError(
            f"The command timeout must be a finite number of seconds greater than 0, got "
            f"{command_timeout}; pass timeout= (or command_timeout=) as, e.g., 60."
        )
    if command_timeout > MAX_COMMAND_TIMEOUT:
        raise ValueError(
            f"The command timeout {command_timeout:g} s is over the limit of "
            f"{MAX_COMMAND_TIMEOUT:g} s: the broker waits at most {MAX_SANDBOX_TIMEOUT:g} s for "
            f"a sandbox's answer (X-Sandbox-Timeout), and the client asks for the command's "
            f"limit plus {COMMAND_TIMEOUT_MARGIN / 2:g} s. Pass timeout= (or command_timeout=) "
            f"of at most {MAX_COMMAND_TIMEOUT:g}, or start longer work in the background "
            "(e.g. `sh -c 'nohup CMD > out.log 2>&1 &'`) and poll for its result."
        )
    spec = _data("POST", "/execute", "run a command", router)
    spec.headers["X-Sandbox-Timeout"] = _seconds(command_timeout + COMMAND_TIMEOUT_MARGIN / 2)
    spec.read_timeout = command_timeout + COMMAND_TIMEOUT_MARGIN
    return _json_body(spec, {"command": command, "timeout_seconds": command_timeout})


def upload(router: RouterTarget, path: str, multipart: Multipart) -> RequestSpec:
    """``POST /upload``; the body (``multipart.prefix``, content, ``.suffix``) is added by the
    I/O layer, which decides whether it can be replayed (and so retried)."""
    spec = _data("POST", "/upload", f"write {path!r}", router)
    spec.headers["Content-Type"] = multipart.content_type
    return spec


def download(router: RouterTarget, path: str) -> RequestSpec:
    return _data("GET", f"/download/{quote(path, safe='')}", f"read {path!r}", router)


def list_files(router: RouterTarget, path: str) -> RequestSpec:
    return _data("GET", f"/list/{quote(path, safe='')}", f"list {path!r}", router)


def exists(router: RouterTarget, path: str) -> RequestSpec:
    return _data("GET", f"/exists/{quote(path, safe='')}", f"check whether {path!r} exists", router)


@dataclass(frozen=True)
class Multipart:
    """Framing of a single-file ``multipart/form-data`` body (field ``file``)."""

    prefix: bytes
    suffix: bytes
    content_type: str

    def length(self, content_length: int) -> int:
        return len(self.prefix) + content_length + len(self.suffix)


def multipart_framing(path: str, boundary: str | None = None) -> Multipart:
    boundary = boundary or secrets.token_hex(16)
    # The filename is the destination path, a quoted-string: '\\' and '"' are escaped with a
    # backslash, which multipart parsers undo (a "%22" would be kept: another file's name).
    filename = path.replace("\\", "\\\\").replace('"', '\\"')
    prefix = (
        f"--{boundary}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    suffix = f"\r\n--{boundary}--\r\n".encode()
    return Multipart(prefix, suffix, f"multipart/form-data; boundary={boundary}")


# --------------------------------------------------------------------------------------------
# Response parsing

_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+")


def redact_answer(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` from a server's answer, fit for a message: the caller's token (``secrets``),
    anything shaped like a JWT and the credential after any ``Bearer`` are replaced. Every
    message (and error attribute) built from an answer goes through it, before any truncation
    (a cut token would no longer be recognised). Where the caller's token is not at hand (a
    successful answer that does not parse), the shapes suffice: the broker accepts only JWTs."""
    return _BEARER.sub(r"\1 <redacted>", redact(text, secrets))


def redact_url(url: str, *, typed: bool = False) -> str:
    """``url`` fit for a message: a user name and password (``user:password@``) become
    ``***@``. Everything up to the last ``@`` before the query is treated as user info, so that
    a password with unencoded ``@`` or ``/`` is hidden too; a URL that does not parse (a bad
    port, no scheme) is redacted all the same. ``typed=True`` (a URL a person typed, such as
    the broker URL): up to the last ``@`` anywhere, as a typed password may also hold an
    unencoded ``?`` or ``#`` (a server's URL, such as a redirect's ``Location``, may have an
    ``@`` in its query instead)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    ends = [i for i in (rest.find("?"), rest.find("#")) if i >= 0 and not typed]
    at = rest.rfind("@", 0, min(ends, default=len(rest)))
    return url if at < 0 else f"{scheme}{sep}***@{rest[at + 1 :]}"


def parse_json(body: bytes, what: str) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        snippet = redact_answer(body[:4096].decode("utf-8", "replace"))[:200]
        raise BrokerProtocolError(
            f"Could not {what}: the answer is not JSON ({exc}); it starts with {snippet!r}. "
            "Check that the broker URL points at an agent-sandbox broker."
        ) from exc


def _protocol_error(what: str, problem: str) -> BrokerProtocolError:
    """``problem`` may quote the answer (a bad field's value): it is redacted."""
    return BrokerProtocolError(
        f"Could not {what}: {redact_answer(problem)}. The broker does not follow the broker "
        "API v1; check the broker URL and the broker's version."
    )


def _object_field(obj: dict[str, Any], key: str, what: str) -> dict[str, Any]:
    """``obj[key]`` as a JSON object (absent or null: empty)."""
    value = obj.get(key) or {}
    if not isinstance(value, dict):
        raise _protocol_error(
            what, f"the Sandbox object's {key!r} is a {type(value).__name__}, not a JSON object"
        )
    return value


def parse_sandbox(obj: Any, what: str = "read the sandbox") -> SandboxInfo:
    if not isinstance(obj, dict):
        raise _protocol_error(what, "the Sandbox object is not a JSON object")
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
        raise _protocol_error(what, f"the Sandbox object lacks or has a bad field ({exc})") from exc
    if not isinstance(name, str) or not isinstance(phase, str):
        raise _protocol_error(what, "'name' and 'phase' must be strings")
    for key in ("namespace", "template", "reason", "message", "created_at", "expires_at"):
        if not isinstance(obj.get(key), str | None):
            raise _protocol_error(what, f"the Sandbox object's {key!r} is not a string")
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
        labels=dict(labels),
        annotations=dict(annotations),
        owner=dict(owner),
    )


def parse_sandbox_list(obj: Any) -> list[SandboxInfo]:
    what = "list my sandboxes"
    if not isinstance(obj, dict) or not isinstance(obj.get("items"), list):
        raise _protocol_error(what, 'expected {"items": [...]}')
    return [parse_sandbox(item, what) for item in obj["items"]]


def parse_execution_result(obj: Any) -> ExecutionResult:
    if not isinstance(obj, dict) or "exit_code" not in obj:
        raise _protocol_error("run a command", "the answer has no exit_code")
    try:
        return ExecutionResult(
            stdout=obj.get("stdout") or "",
            stderr=obj.get("stderr") or "",
            exit_code=obj["exit_code"],
            timed_out=bool(obj.get("timed_out", False)),
            output_truncated=obj.get("output_truncated") is True,
        )
    except ValueError as exc:
        raise _protocol_error("run a command", f"bad execution result ({exc})") from exc


def parse_file_entries(obj: Any, path: str) -> list[FileEntry]:
    what = f"list {path!r}"
    if not isinstance(obj, list):
        raise _protocol_error(what, "the listing is not a JSON array")
    try:
        return [FileEntry.from_legacy(entry) for entry in obj]
    except (KeyError, TypeError, ValueError) as exc:
        raise _protocol_error(what, f"bad listing entry ({exc})") from exc


def parse_exists(obj: Any, path: str) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("exists"), bool):
        raise _protocol_error(f"check whether {path!r} exists", 'expected {"exists": true|false}')
    return bool(obj["exists"])


# --------------------------------------------------------------------------------------------
# Error mapping

_HINTS: dict[str, str] = {
    "invalid_request": "Fix the request as the detail says.",
    "invalid_header": "X-Sandbox-ID, -Namespace and -Port come from the sandbox object "
    "(reconnect with Sandbox.connect(name)); X-Sandbox-Timeout comes from the command's timeout "
    f"(at most {MAX_COMMAND_TIMEOUT:g} s).",
    "invalid_path": "Use a path relative to the sandbox root.",
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
    "reserved_metadata": f"Remove labels/annotations under {RESERVED_PREFIX}; the broker sets "
    "them.",
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
    "unavailable": "The broker or the sandbox is temporarily unavailable; retry later.",
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


def is_token_rejection(status: int, body: bytes) -> bool:
    """Whether an answer is the broker rejecting the token: a ``401`` whose error body carries
    one of the documented token codes. Only such an answer makes the client re-read the
    credential and send the request once more (the broker refused it before it reached a
    sandbox). Any other ``401`` comes from behind the broker (a sandbox runtime's own answer,
    passed through unchanged): it is a result or an error, never a reason to replay (a
    command must not run twice)."""
    return status == 401 and _error_body(body)[0] in TOKEN_REJECTION_CODES


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
    if spec.data_plane and code is None and 400 <= status < 500:
        # An answer of the sandbox runtime itself, passed through by the broker.
        hint = {
            404: "The path does not exist in the sandbox (or is not a file/directory as needed).",
            403: "The path escapes the sandbox's base directory; use a relative path inside it.",
        }.get(status, "See the runtime's detail.")
        return BrokerError(
            f"Could not {spec.what}: the sandbox runtime answered {status} ({reason}). {hint}",
            **common,
        )
    if code == "template_not_found":
        cls: type[BrokerError] = BrokerTemplateNotFoundError
    else:
        cls = _STATUS_CLASSES.get(status, BrokerError)
        if status >= 500 and cls is BrokerError:
            cls = BrokerUnavailableError
    hint = _HINTS.get(code or "", "")
    if code == "invalid_path" and not spec.data_plane:
        hint = "Sandbox names are DNS-1123 labels; check the name with `agent-sandbox-awx ls`."
    if not hint:
        hint = {
            400: "The request was malformed; this is likely a client bug, please report it.",
            401: "Run `agent-sandbox-awx doctor` to check the token.",
            403: "Your identity is not allowed to do this; see `agent-sandbox-awx whoami` for "
            "your policy or ask the broker's operator.",
            413: "Send less data per request.",
        }.get(status, "Retry later; if it persists, contact the broker's operator.")
    extra = ""
    if status == 401 and retried_auth:
        extra = " (the credential was re-read and the request retried once)"
    retry_after = headers.get("retry-after")
    if retry_after and status in (429, 503):
        extra += f" (Retry-After: {redact_answer(retry_after, secrets)})"
    label = f"{status} {code}" if code else str(status)
    return cls(
        f"Could not {spec.what} ({request}): the broker answered {label}: {reason}{extra}. {hint}",
        **common,
    )


def unexpected_status(status: int, spec: RequestSpec) -> BrokerProtocolError:
    return BrokerProtocolError(
        f"Could not {spec.what}: unexpected HTTP status {status} for {spec.method} {spec.path}. "
        "Check that the broker URL points at an agent-sandbox broker.",
        status_code=status,
        method=spec.method,
        path=spec.path,
    )


# --------------------------------------------------------------------------------------------
# Retry decisions

RETRYABLE_STATUSES = frozenset({502, 503, 504})


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or HTTP date); ``None`` if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # isdigit() alone: also "²" and other digits
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    now = now or datetime.now(UTC)
    return max(0.0, (when - now).total_seconds())


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter; ``Retry-After`` honoured up to the cap."""

    max_attempts: int = 4
    backoff_base: float = 0.2
    backoff_max: float = 10.0
    rand: Callable[[float, float], float] = field(default=random.uniform, repr=False)

    def backoff(self, attempt: int) -> float:
        """Delay before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
        ceiling = min(self.backoff_max, self.backoff_base * (2 ** (attempt - 1)))
        return self.rand(0.0, ceiling)

    def after_status(
        self,
        spec: RequestSpec,
        attempt: int,
        status: int,
        headers: Mapping[str, str],
        now: datetime | None = None,
    ) -> float | None:
        """Seconds to wait before retrying after ``status``, or ``None``: do not retry."""
        if not spec.retryable or attempt >= self.max_attempts:
            return None
        retry_after = parse_retry_after(headers.get("retry-after"), now)
        if status == 429:
            if retry_after is None:  # quota_exceeded: retrying cannot help
                return None
        elif status not in RETRYABLE_STATUSES:
            return None
        if retry_after is not None:
            return min(self.backoff_max, retry_after)
        return self.backoff(attempt)

    def after_transport_error(
        self, spec: RequestSpec, attempt: int, *, request_sent: bool
    ) -> float | None:
        """Seconds to wait before retrying after a connection error, or ``None``.

        A request that may have reached the server is retried only if it is idempotent; a
        non-retryable request (``POST /execute``) is never retried."""
        del request_sent  # every retryable request is idempotent; others are never retried
        if not spec.retryable or attempt >= self.max_attempts:
            return None
        return self.backoff(attempt)
