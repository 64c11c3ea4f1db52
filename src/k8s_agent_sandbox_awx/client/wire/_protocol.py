"""What every broker dialect and the data plane share, without any I/O.

The value types (:class:`RequestSpec`, :class:`SandboxInfo`, :class:`RouterTarget`), JSON
bodies and parsing, NDJSON, redaction. Whether an attempt is retried is decided by the one
``RetryPolicy`` (``client/core/_retry.py``).
What one broker protocol decides lives in its dialect (``_dialect_v1``); what the sandbox
runtime endpoints decide lives in ``_dataplane`` and the modules of its endpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Generic, Protocol, TypeVar

from ...credentials._jwt import redact
from ...errors import BrokerProtocolError, BrokerUnavailableError, ReservedMetadataError

__all__ = [
    "Call",
    "NdjsonDecoder",
    "Reply",
    "RequestSpec",
    "RouterTarget",
    "SandboxInfo",
    "check_reserved_metadata",
    "compact_json",
    "json_body",
    "json_object",
    "new_idempotency_key",
    "parse_json",
    "protocol_error",
    "redact_answer",
    "redact_sent",
    "redact_url",
    "rfc3339_seconds",
    "scope_names",
    "selector_text",
    "str_mapping",
]

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
    """When the broker deletes the sandbox (its end time; RFC 3339 UTC)."""
    started_at: str | None = None
    """When the sandbox became Ready (``None`` before, or if the broker does not say)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    owner: Mapping[str, str] = field(default_factory=dict)

    @property
    def metadata(self) -> Mapping[str, str]:
        """E2B's ``metadata``: the caller's own annotations (what ``Sandbox.create(metadata=)``
        set), apart from the broker's attribution stamps and upstream's keys, which
        :attr:`annotations` has too (who made the sandbox is :attr:`owner`)."""
        return {k: v for k, v in self.annotations.items() if reserved_prefix(k) is None}

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until the broker deletes the sandbox (``None``: no end time known)."""
        end = rfc3339_seconds(self.expires_at)
        if end is None:
            return None
        return max(0.0, end - (time.time() if now is None else now))

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
            "started_at": self.started_at,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "owner": dict(self.owner),
            "router": {
                "sandbox_id": self.router.sandbox_id,
                "namespace": self.router.namespace,
                "port": self.router.port,
            },
        }


def rfc3339_seconds(value: str | None) -> float | None:
    """An RFC 3339 time as epoch seconds (``None`` if absent or unreadable)."""
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


@dataclass(frozen=True)
class RequestSpec:
    """One request, described without I/O. ``path`` is relative to the broker URL. Built once
    by a dialect or the data plane and never changed afterwards (a variant is a new spec:
    ``dataclasses.replace``)."""

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
    subject: str | None = None
    """The sandbox path a data-plane request is about (named by its errors)."""
    delay: float = 0.0
    """Seconds to wait before the first attempt (the interval of a status poll)."""
    probe: bool = False
    """A ``2xx`` and any ``4xx`` but 408 and 429 (busy) is an answer, not an error (a probe
    reads the status itself; a ``3xx`` is an error, never followed); sent without a token (a
    health check, the dialect probe: they must work before one is usable)."""


class Reply(Protocol):
    """A read answer: what parsers get (an ``httpx.Response`` is one)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content(self) -> bytes: ...


@dataclass(frozen=True)
class BrokerReply:
    """A read answer handed to users (``healthz()``): status, headers and body."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes


T = TypeVar("T")


def raw(reply: Reply) -> Reply:
    """The parser of a call whose operation reads the answer itself."""
    return reply


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its answer: what an operation asks the transport for.

    ``cleanup``: it must complete even while the caller is cancelled (async). ``fail``: turns
    the request's error into the operation's (``None``: raise it as is). ``body``: a streamed
    upload (``_upload.UploadBody``) the transport sends as the request's body. ``stream``: the
    answer is handed to ``parse`` unread (the caller reads and closes it)."""

    spec: RequestSpec
    parse: Callable[[Reply], T]
    cleanup: bool = False
    fail: Callable[[Exception], Exception | None] | None = None
    body: Any = None
    stream: bool = False


_COMPACT: Final = json.JSONEncoder(separators=(",", ":"))
"""``json.dumps(..., separators=(",", ":"))``'s encoder, made once (``dumps`` makes one per
call when given ``separators``; an encoder keeps no state between calls)."""


def compact_json(body: Any) -> bytes:
    """``body`` as compact JSON (the bodies the client sends)."""
    return _COMPACT.encode(body).encode("utf-8")


def json_body(spec: RequestSpec, body: Any) -> RequestSpec:
    """``spec`` with ``body`` as its compact JSON body."""
    headers = {**spec.headers, "Content-Type": "application/json"}
    return dataclasses.replace(spec, content=compact_json(body), headers=headers)


def new_idempotency_key() -> str:
    """A random UUID (version 4, the RFC 9562 variant) as text, as ``str(uuid.uuid4())`` is:
    formatted from its 16 random bytes without the ``UUID`` object (0.6 against 1.8 µs; one per
    command start, code run and create)."""
    h = os.urandom(16).hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[int(h[16], 16) & 3]}{h[17:20]}-{h[20:]}"


_VARIANT: Final = "89ab"
"""The first hex digit of a UUID's fourth group: its variant bits (10) and one random bit."""


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


BROKER_DOMAIN = "broker.agent-sandbox-awx.io"
"""The broker's attribution stamps (``RESERVED_PREFIX`` = this and ``/``)."""
UPSTREAM_DOMAIN = "agents.x-k8s.io"
"""Upstream's own metadata keys, which its controller reads and writes."""
UPSTREAM_CLIENT_LABELS = frozenset({UPSTREAM_DOMAIN + "/created-by"})
"""The keys under :data:`UPSTREAM_DOMAIN` a caller may set: the label upstream's own client
marks its claims with (the ``/rpc`` dialect sends it; the controller does not act on it)."""
_WHOSE = {
    BROKER_DOMAIN: "the broker writes keys there itself (who made the sandbox), so no caller "
    "can forge them",
    UPSTREAM_DOMAIN: "upstream's agent-sandbox controller reads keys there (on a claim, "
    f"{UPSTREAM_DOMAIN}/sandbox-name names a Sandbox to adopt), so only the broker and the "
    "controller set them",
}


def reserved_prefix(key: str, *, claim_label: bool = False) -> str | None:
    """The reserved prefix (``domain/``) that metadata key ``key`` is under: the broker's or
    upstream's domain or a subdomain of one (``None``: the caller's key). ``claim_label``:
    ``key`` is a claim's label, where upstream's client label is allowed."""
    domain, slash, _ = key.partition("/")
    if not slash or (claim_label and key in UPSTREAM_CLIENT_LABELS):
        return None
    domain = domain.lower()
    for reserved in (BROKER_DOMAIN, UPSTREAM_DOMAIN):
        if domain == reserved or domain.endswith("." + reserved):
            return domain + "/"
    return None


def check_reserved_metadata(argument: str, field: str, value: Mapping[str, str]) -> None:
    """Refuse (:class:`ReservedMetadataError`, before anything is sent) a key of ``value`` under
    a reserved prefix; ``field``: ``labels``, ``annotations``, ``pod_labels`` or
    ``pod_annotations``; ``argument``: the keyword it was given as (``metadata=``)."""
    what = ("pod " if field.startswith("pod_") else "") + field.removeprefix("pod_")[:-1]
    for key in value:
        prefix = reserved_prefix(key, claim_label=field == "labels")
        if prefix is None:
            continue
        owner = BROKER_DOMAIN if prefix.rstrip("/").endswith(BROKER_DOMAIN) else UPSTREAM_DOMAIN
        name = key.rpartition("/")[2] or "name"
        raise ReservedMetadataError(
            f"The {what} key {key!r} ({argument}=) is under the reserved prefix {prefix!r} "
            f"({owner}/ and its subdomains): {_WHOSE[owner]}. Nothing was sent. Use a key "
            f"under a prefix of your own, e.g. 'example.com/{name}'.",
            key=key,
            field=argument,
            prefix=prefix,
            request_sent=False,
        )


def scope_names(scopes: Iterable[str] | None) -> tuple[str, ...] | None:
    """``scopes=`` as the scope names to ask for (``None``: the policy's), else a TypeError
    naming it: a list of non-empty str (one str is refused, never split into letters)."""
    if scopes is None:
        return None
    names = None if isinstance(scopes, str) else tuple(scopes)
    if names is None or not all(isinstance(s, str) and s for s in names):
        raise TypeError("scopes= must be a list of scope names, e.g. ['commands', 'files'].")
    return names


def selector_text(label_selector: Mapping[str, str] | str | None) -> str | None:
    """A label selector as sent: ``'team=ml'`` as is, ``{'team': 'ml'}`` joined; checked."""
    if not label_selector:
        return None
    if isinstance(label_selector, str):
        return label_selector
    if not isinstance(label_selector, Mapping):
        raise TypeError(
            "label_selector must be a str such as 'team=ml' or a mapping such as "
            f"{{'team': 'ml'}}, not a {type(label_selector).__name__}."
        )
    pairs = str_mapping("label_selector", label_selector)
    return ",".join(f"{k}={v}" for k, v in pairs.items())


def seconds(value: float) -> str:
    """A number of seconds as sent in a header or query parameter."""
    return f"{value:g}"


# --------------------------------------------------------------------------------------------
# Response parsing (shared by every dialect and the data plane)


_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+")


def redact_answer(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` from a server's answer, fit for a message: the caller's token (``secrets``),
    anything shaped like a JWT and the credential after any ``Bearer`` are replaced. Every
    message (and error attribute) built from an answer goes through it, before any truncation
    (a cut token would no longer be recognised). Where the caller's token is not at hand (a
    successful answer that does not parse), the shapes suffice: the broker accepts only JWTs."""
    return _BEARER.sub(r"\1 <redacted>", redact(text, secrets))


def redact_sent(exc: BaseException, tokens: Iterable[str]) -> None:
    """Remove the tokens the requests carried from an error built from a successful answer (an
    answer that does not parse, a Failed sandbox's reason): it may quote the answer, and so an
    opaque token, which has no shape to recognise. Replaced in the message and the text
    attributes; a cause that quotes one is dropped."""
    secrets = tuple(t for t in tokens if t)
    if not secrets:
        return
    exc.args = tuple(redact_answer(a, secrets) if isinstance(a, str) else a for a in exc.args)
    for name, value in vars(exc).items():
        if isinstance(value, str):
            setattr(exc, name, redact_answer(value, secrets))
    causes = (exc.__cause__, exc.__context__)
    if any(c is not None and any(t in str(c) for t in secrets) for c in causes):
        exc.__cause__ = exc.__context__ = None


def sent_token(request_headers: Mapping[str, str]) -> str:
    """The bearer token a request carried (``""`` if none): the one reading of it, for the
    exchange's messages about an attempt and the transports' redaction of answers."""
    return str(request_headers.get("Authorization", "")).partition(" ")[2].strip()


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


def protocol_error(what: str, problem: str, api: str = "the broker API v1") -> BrokerProtocolError:
    """``problem`` may quote the answer (a bad field's value): it is redacted."""
    return BrokerProtocolError(
        f"Could not {what}: {redact_answer(problem)}. The broker does not follow {api}; "
        "check the broker URL and the broker's version."
    )


class NdjsonDecoder:
    """Splits a streamed answer into JSON values, one per line (NDJSON: event streams such as
    a command's output or a directory watch); chunks may end anywhere, blank lines are skipped,
    a line longer than ``max_line`` bytes is a :class:`BrokerProtocolError`. The start of an
    unfinished line is kept as the chunks it came in (joined once, when its end arrives): a
    long line is never copied again for each chunk."""

    def __init__(self, what: str, max_line: int = 16 * 1024 * 1024) -> None:
        self.what = what
        self.max_line = max_line
        self._parts: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[Any]:
        """The values completed by ``chunk``."""
        if b"\n" not in chunk:  # no line completed
            self._hold(chunk)
            return []
        lines = chunk.split(b"\n")
        if self._parts:
            self._parts.append(lines[0])
            lines[0] = b"".join(self._parts)
            self._parts, self._size = [], 0
            if len(lines[0]) > self.max_line:
                raise self._too_long()
        self._hold(lines.pop())
        return [parse_json(line, self.what) for line in lines if line and not line.isspace()]

    def _hold(self, part: bytes) -> None:
        if part:
            self._parts.append(bytes(part))
            self._size += len(part)
            if self._size > self.max_line:
                raise self._too_long()

    def _too_long(self) -> BrokerProtocolError:
        return protocol_error(self.what, f"an event line is longer than {self.max_line} bytes")

    def end(self) -> list[Any]:
        """The last value, if the stream did not end with a newline. A last line that starts
        as a JSON object but is not one is the start of a line whose end never came: a
        connection closed inside it (a close-delimited answer ends cleanly when cut) is a
        :class:`BrokerUnavailableError`, a drop that a reader resumes from its cursor, not a
        malformed answer (which anything else, e.g. an HTML page, is)."""
        rest, self._parts, self._size = b"".join(self._parts), [], 0
        if not rest.strip():
            return []
        try:
            return [parse_json(rest, self.what)]
        except BrokerProtocolError:
            if not rest.lstrip().startswith(b"{"):
                raise
            raise BrokerUnavailableError(
                f"Could not {self.what}: the answer ended inside a line ({len(rest)} bytes "
                "without their end): the connection was closed before the line was complete."
            ) from None


class JsonAnswerDecoder(NdjsonDecoder):
    """A plain JSON answer (not ``application/x-ndjson``) read as a stream of one value: the
    answer of a runtime that does not stream a request that asked for NDJSON (the streamed
    start)."""

    def feed(self, chunk: bytes) -> list[Any]:
        self._hold(chunk)
        return []

    def end(self) -> list[Any]:
        """The answer's one value (an empty answer: none)."""
        rest, self._parts, self._size = b"".join(self._parts), [], 0
        return [parse_json(rest, self.what)] if rest.strip() else []


def event_decoder(what: str, content_type: str | None, json_answer: bool) -> NdjsonDecoder:
    """The decoder of a streamed answer: NDJSON, or with ``json_answer`` any answer not
    labelled ``application/x-ndjson`` as one value (read whole, as a plain answer is: e.g.
    pretty-printed JSON without its content type)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if json_answer and media != "application/x-ndjson":
        return JsonAnswerDecoder(what)
    return NdjsonDecoder(what)


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """``body`` as a JSON object, else a :class:`BrokerProtocolError`."""
    result = parse_json(body, what)
    if not isinstance(result, dict):
        raise protocol_error(what, "expected a JSON object")
    return result
