"""A thin async client of the Kubernetes REST API over httpx: what the broker's Kubernetes
backend needs, and nothing more.

``KubeClient(config)`` (a ``KubeConfig`` from ``in_cluster()``, ``from_kubeconfig()`` or
``connection()``) holds ONE ``httpx.AsyncClient``, shared by concurrent tasks; use it as an
async context manager or call ``aclose()``. Resources are addressed by ``Resource(group,
version, plural)``; objects are plain ``dict[str, Any]``. The operations: ``get``, ``list``
(one page: labelSelector, fieldSelector, limit, continue) and ``list_all`` (every page),
``create`` (a name or ``generateName``; ``fieldManager``), ``merge_patch`` and ``json_patch``
(optionally of a subresource such as ``status``; a ``resourceVersion`` precondition, or the JSON
patch's own ``test`` operations), ``delete`` (propagationPolicy; uid / resourceVersion
preconditions), ``watch`` (an async iterator of ``(type, object)``), ``token_review``,
``access_review`` and ``require_access`` (the start-up check naming each missing verb).
Next to it: ``_api_config`` (where the API is, how to authenticate), ``_api_errors`` (the typed
errors), ``_api_watch`` (the watch iterator). They import nothing else of the package but
``_version``.

Decisions (docs/architecture.md, "The broker's Kubernetes API client"):

- Retries: a request the server cannot have seen (the connection was never made, or it
  answered 429, which its filters send before any handler runs) is sent again whatever it is.
  After a failure that may have reached the server (a dropped connection, a read timeout,
  5xx), only idempotent requests are sent again: get, list, the start of a watch, a delete with
  a uid or resourceVersion precondition, TokenReview and access reviews (they store nothing).
  A create or a patch is not: its caller resolves the ambiguity (a get; a create uses a
  deterministic name). Bounded attempts, exponential backoff with jitter, ``Retry-After``
  honoured up to a cap; then ``Unavailable``.
- Watch: the ERROR event with code 410 (1.20 answers 200 and then sends it) and an HTTP 410
  both raise ``WatchExpired``. The iterator ends cleanly when the server closes the stream
  (``Watch.end is WatchEnd.TIMEOUT``: its timeoutSeconds elapsed) or when the connection drops
  or stalls (``WatchEnd.DROPPED``, a read waits timeoutSeconds plus a margin, never forever);
  either way ``Watch.resource_version`` is the last one seen (from an event or a BOOKMARK) to
  resume from.
- Redirects are never followed (a token must not go elsewhere); proxy variables and netrc are
  ignored (``trust_env=False``).
- No token, no ``Authorization`` header in any message, repr or log record: the token is
  added per request by an ``httpx.Auth`` (read again each time from a token file), and anything
  the server echoes is scrubbed of it.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import random
import re
import ssl
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import httpx

from ...._version import __version__
from ._api_config import KubeConfig, TokenFile, TokenSource
from ._api_errors import (
    KubeError,
    KubeUsageError,
    MissingPermissions,
    Unavailable,
    error_for_status,
)
from ._api_watch import Watch, WatchEnd

__all__ = [
    "CONFIG_MAPS",
    "NAMESPACES",
    "PODS",
    "SANDBOXES",
    "SANDBOX_CLAIMS",
    "SANDBOX_TEMPLATES",
    "SANDBOX_WARM_POOLS",
    "SECRETS",
    "SELF_SUBJECT_ACCESS_REVIEWS",
    "SERVICE_ACCOUNTS",
    "TOKEN_REVIEWS",
    "USER_AGENT",
    "Access",
    "AccessReview",
    "KubeClient",
    "ObjectList",
    "Resource",
    "Retry",
    "Timeouts",
    "Watch",
    "WatchEnd",
]

USER_AGENT: Final = f"k8s-agent-sandbox-awx/{__version__} (broker)"
DEFAULT_FIELD_MANAGER: Final = "agent-sandbox-awx"
_log = logging.getLogger(__name__)
_SEGMENT: Final = re.compile(r"[^/%?#\s\\]+")
_NOT_SERVED: Final = ("the server could not find the requested resource", "404 page not found")


# ------------------------------------------------------------------------------ addressing


@dataclass(frozen=True)
class Resource:
    """A resource type: ``group`` (``""`` for the core group), ``version``, ``plural``;
    ``kind`` fills ``kind``/``apiVersion`` of a created object that lacks them."""

    group: str
    version: str
    plural: str
    kind: str = ""
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def __str__(self) -> str:  # kubectl's spelling: sandboxclaims.extensions.agents.x-k8s.io
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The REST path: the collection without ``name`` (all namespaces without
        ``namespace``), an object with it, one of its subresources with ``subresource``."""
        path = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            path += f"/namespaces/{_segment(namespace, 'namespace')}"
        path += f"/{self.plural}"
        if name is not None:
            path += f"/{_segment(name, 'name')}"
            if subresource is not None:
                path += f"/{_segment(subresource, 'subresource')}"
        return path


def _segment(value: str, what: str) -> str:
    if not isinstance(value, str) or value in (".", "..") or not _SEGMENT.fullmatch(value):
        raise KubeUsageError(
            f"the {what} {value!r} cannot be part of a Kubernetes API path: give a non-empty "
            "name without '/', '%', '?', '#', '\\' or whitespace"
        )
    return value


_EXT = "extensions.agents.x-k8s.io"
SANDBOX_CLAIMS: Final = Resource(_EXT, "v1beta1", "sandboxclaims", "SandboxClaim")
SANDBOX_TEMPLATES: Final = Resource(_EXT, "v1beta1", "sandboxtemplates", "SandboxTemplate")
SANDBOX_WARM_POOLS: Final = Resource(_EXT, "v1beta1", "sandboxwarmpools", "SandboxWarmPool")
SANDBOXES: Final = Resource("agents.x-k8s.io", "v1beta1", "sandboxes", "Sandbox")
PODS: Final = Resource("", "v1", "pods", "Pod")
SECRETS: Final = Resource("", "v1", "secrets", "Secret")
CONFIG_MAPS: Final = Resource("", "v1", "configmaps", "ConfigMap")
SERVICE_ACCOUNTS: Final = Resource("", "v1", "serviceaccounts", "ServiceAccount")
NAMESPACES: Final = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
TOKEN_REVIEWS: Final = Resource(
    "authentication.k8s.io", "v1", "tokenreviews", "TokenReview", namespaced=False
)
SELF_SUBJECT_ACCESS_REVIEWS: Final = Resource(
    "authorization.k8s.io", "v1", "selfsubjectaccessreviews", "SelfSubjectAccessReview",
    namespaced=False,
)  # fmt: skip


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Timeouts:
    """Seconds: to connect (TCP and TLS), to wait for each read of an answer, to write a
    request, to wait for a free pooled connection. A watch's reads wait its timeoutSeconds
    plus ``watch_margin``: the server ends a watch itself; silence beyond that is a stall."""

    connect: float = 5.0
    read: float = 30.0
    write: float = 30.0
    pool: float = 30.0
    watch_margin: float = 15.0

    def httpx(self, read: float | None = None) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.connect, read=self.read if read is None else read,
            write=self.write, pool=self.pool,
        )  # fmt: skip


@dataclass(frozen=True)
class Retry:
    """How often and how patiently a request is sent again (see the module's docstring for
    which requests). ``attempts`` counts the first one; the n-th retry waits between half of
    and all of ``min(backoff_max, backoff * 2**(n-1))``; a ``Retry-After`` (seconds) is
    honoured up to ``retry_after_max``."""

    attempts: int = 6
    backoff: float = 0.25
    backoff_max: float = 4.0
    retry_after_max: float = 10.0
    rand: Callable[[float, float], float] = field(default=random.uniform, repr=False)

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff < 0 or self.backoff_max < 0:
            raise KubeUsageError(
                f"Retry(attempts={self.attempts}, backoff={self.backoff}, "
                f"backoff_max={self.backoff_max}): attempts must be at least 1 and the "
                "backoffs at least 0"
            )

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after attempt ``attempt`` (from 1) failed."""
        if retry_after is not None:
            return max(0.0, min(retry_after, self.retry_after_max))
        ceiling = min(self.backoff_max, self.backoff * 2.0 ** (attempt - 1))
        return ceiling / 2 + self.rand(0.0, ceiling / 2)


# ------------------------------------------------------------------------------ answers


@dataclass(frozen=True)
class ObjectList:
    """One page of a list (or every page, from ``list_all``): the ``items``, the list's
    ``resource_version`` (watch from it to see every later change), the ``continue_token`` of
    the next page (None on the last) and the server's ``remaining_item_count`` estimate."""

    items: list[dict[str, Any]]
    resource_version: str
    continue_token: str | None = None
    remaining_item_count: int | None = None


@dataclass(frozen=True)
class Access:
    """A permission to check: ``verb`` on ``resource`` (in ``namespace``; all namespaces
    when None), optionally one ``name`` or ``subresource``; or ``verb`` on a non-resource
    ``path`` (``/openid/v1/jwks``) when ``resource`` is None."""

    verb: str
    resource: Resource | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    path: str | None = None

    def __str__(self) -> str:
        if self.resource is None:
            return f"`{self.verb}` `{self.path}`"
        what = f"{self.resource.plural}/{self.subresource}" if self.subresource else (
            self.resource.plural
        )  # fmt: skip
        group = f" ({self.resource.group})" if self.resource.group else ""
        where = (
            "" if not self.resource.namespaced
            else f" in namespace {self.namespace}" if self.namespace else " in every namespace"
        )  # fmt: skip
        one = f" named {self.name!r}" if self.name else ""
        return f"`{self.verb}` `{what}`{group}{one}{where}"

    def attributes(self) -> dict[str, Any]:
        """The SelfSubjectAccessReview spec for this permission."""
        if self.resource is None:
            return {"nonResourceAttributes": {"verb": self.verb, "path": self.path or "/"}}
        attributes: dict[str, Any] = {
            "verb": self.verb, "group": self.resource.group, "version": self.resource.version,
            "resource": self.resource.plural,
        }  # fmt: skip
        for key, value in (("namespace", self.namespace), ("name", self.name),
                           ("subresource", self.subresource)):  # fmt: skip
            if value:
                attributes[key] = value
        return {"resourceAttributes": attributes}


@dataclass(frozen=True)
class AccessReview:
    """What the API server's authorizer said about one ``Access``."""

    access: Access
    allowed: bool
    denied: bool = False
    reason: str = ""


# ------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class _Call:
    """One API request: the Kubernetes verb (for messages and retries) and the HTTP parts."""

    verb: str
    method: str
    resource: Resource
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    params: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None
    content_type: str | None = None
    idempotent: bool = False
    json_patch: bool = False
    secrets: tuple[str, ...] = ()  # to scrub from what the server says (a reviewed token)

    @property
    def path(self) -> str:
        return self.resource.path(self.namespace, self.name, self.subresource)

    def describe(self) -> str:
        what = f"{self.resource}/{self.subresource}" if self.subresource else str(self.resource)
        where = "/".join(p for p in (self.namespace, self.name) if p)
        return f"{self.verb} {what}" + (f" {where}" if where else "")


def _json_body(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class _BearerAuth(httpx.Auth):
    """Adds ``Authorization: Bearer`` to each request, reading the token source each time."""

    def __init__(self, token: TokenSource) -> None:
        self._token = token
        self.last = ""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        self.last = self._token.read()
        request.headers["Authorization"] = f"Bearer {self.last}"
        yield request

    def __repr__(self) -> str:
        return f"_BearerAuth({self._token!r})"


def _scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret and len(secret) >= 8:
            text = text.replace(secret, "[redacted]")
    return text


def _retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after", "").strip()
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _not_sent(exc: httpx.TransportError) -> bool:
    """The request cannot have reached the server: no connection was made."""
    return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)


def _certificate_failure(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(
            seen
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# ------------------------------------------------------------------------------ the client


class KubeClient:
    """The Kubernetes API, as one identity (``config``). Safe to share between tasks of one
    event loop. ``max_connections`` bounds the pooled connections (each open watch holds
    one); ``field_manager`` names this client in objects' managedFields."""

    def __init__(
        self,
        config: KubeConfig,
        *,
        timeouts: Timeouts | None = None,
        retry: Retry | None = None,
        max_connections: int = 100,
        field_manager: str = DEFAULT_FIELD_MANAGER,
    ) -> None:
        if max_connections < 1:
            raise KubeUsageError(f"max_connections={max_connections}: give at least 1")
        self.config = config
        self.timeouts = timeouts or Timeouts()
        self.retry = retry or Retry()
        self.field_manager = field_manager
        self._auth = _BearerAuth(config.token) if config.token is not None else None
        self._http = httpx.AsyncClient(
            base_url=config.server, verify=config.ssl_context, auth=self._auth,
            timeout=self.timeouts.httpx(), follow_redirects=False, trust_env=False,
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
            headers={"User-Agent": USER_AGENT, "Accept": "application/json"},
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"KubeClient(server={self.config.server!r}, source={self.config.source!r})"

    @property
    def namespace(self) -> str | None:
        """The configuration's default namespace (the pod's, or the context's)."""
        return self.config.namespace

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---------------------------------------------------------------------- sending

    async def _request(self, call: _Call) -> dict[str, Any]:
        """Send ``call`` (with the retries it may have); the decoded JSON answer."""
        response = await self._send(call)
        return self._decode(call, response)

    async def _send(self, call: _Call, *, stream: bool = False, read: float | None = None
                    ) -> httpx.Response:  # fmt: skip
        """Send ``call`` until an answer below 300 comes (returned; when ``stream``, unread),
        retrying what may be retried; else raise its typed error."""
        headers = {"Content-Type": call.content_type} if call.content_type else {}
        attempt = 0
        while True:
            attempt += 1
            request = self._http.build_request(
                call.method, call.path, params=dict(call.params), content=call.body,
                headers=headers, timeout=self.timeouts.httpx(read),
            )  # fmt: skip
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                delay = self._after_transport_error(call, exc, attempt)
            else:
                if response.status_code < 300:
                    return response
                delay = await self._after_status(call, response, attempt)
            await asyncio.sleep(delay)

    def _after_transport_error(self, call: _Call, exc: httpx.TransportError, attempt: int
                               ) -> float:  # fmt: skip
        """Seconds before sending ``call`` again, or raise ``Unavailable``."""
        detail = f"{type(exc).__name__}: {_scrub(str(exc), self._secrets(call))}"
        if _certificate_failure(exc):
            raise Unavailable(
                f"{call.describe()}: the API server's certificate does not verify ({detail}): "
                f"give the cluster's CA in {self.config.source}",
                verb=call.verb, resource=str(call.resource), namespace=call.namespace,
                name=call.name,
            ) from None  # fmt: skip
        retryable = _not_sent(exc) or call.idempotent
        if retryable and attempt < self.retry.attempts:
            return self._again(call, attempt, type(exc).__name__, self.retry.delay(attempt))
        why = (
            f"after {attempt} attempts" if retryable
            else "not sent again: it may have reached the server; read the object to see"
        )  # fmt: skip
        raise Unavailable(
            f"{call.describe()}: the API server at {self.config.server} did not answer "
            f"({detail}); {why}",
            verb=call.verb, resource=str(call.resource), namespace=call.namespace, name=call.name,
        ) from None  # fmt: skip

    async def _after_status(self, call: _Call, response: httpx.Response, attempt: int) -> float:
        """Seconds before sending ``call`` again after an error answer, or raise its error."""
        await response.aread()
        await response.aclose()
        code = response.status_code
        retryable = code == 429 or (code >= 500 and call.idempotent)
        if retryable and attempt < self.retry.attempts:
            delay = self.retry.delay(attempt, _retry_after(response.headers))
            return self._again(call, attempt, f"{code} {response.reason_phrase}", delay)
        raise self._error(call, response, attempts=attempt if retryable else 0)

    def _again(self, call: _Call, attempt: int, why: str, delay: float) -> float:
        _log.info("%s: attempt %d of %d failed (%s); again in %.2f s", call.describe(), attempt,
                  self.retry.attempts, why, delay)  # fmt: skip
        return delay

    def _secrets(self, call: _Call) -> tuple[str, ...]:
        return (*call.secrets, self._auth.last if self._auth is not None else "")

    def _error(self, call: _Call, response: httpx.Response, *, attempts: int = 0) -> KubeError:
        """The typed error for an error answer to ``call`` (its body read)."""
        try:
            status = response.json()
        except ValueError:
            status = None
        if not isinstance(status, dict):
            status = {"message": response.text[:300]}
        code = response.status_code
        cls, extra = error_for_status(code, status, json_patch=call.json_patch)
        reason = str(status.get("reason") or response.reason_phrase)
        message = _scrub(str(status.get("message") or "").strip(), self._secrets(call))
        text = f"{call.describe()}: {code} {reason}" + (f": {message}" if message else "")
        text += self._hint(call, code, message, response, attempts)
        return cls(
            text, status=code, reason=reason, message=message, verb=call.verb,
            resource=str(call.resource), namespace=call.namespace, name=call.name, **extra,
        )  # fmt: skip

    def _hint(
        self, call: _Call, code: int, message: str, response: httpx.Response, attempts: int
    ) -> str:
        """What to do about an error answer, where the answer alone does not say."""
        if 300 <= code < 400:
            return (
                f" (to {response.headers.get('location', '?')}): redirects are never followed, "
                f"so that no token goes elsewhere; check the server address in "
                f"{self.config.source}"
            )
        if attempts:
            return f" (after {attempts} attempts)"
        if code == 401:
            return self._unauthorized_hint()
        if code == 403:
            where = f" in namespace {call.namespace}" if call.namespace else ""
            return (
                f": grant `{call.verb}` on `{call.resource}`{where} to this identity (a Role "
                "and a RoleBinding)"
            )
        if code == 404 and message in _NOT_SERVED:
            return f": the API server does not serve {call.resource}; is its CRD installed?"
        return ""

    def _unauthorized_hint(self) -> str:
        token = self.config.token
        if isinstance(token, TokenFile):
            fix = (f"is the token in {token.path} expired or revoked? It is read again for "
                   "every request: replacing the file is enough")  # fmt: skip
        elif token is not None:
            fix = f"is the token expired or revoked? Renew it in {token.source}"
        elif self.config.client_certificate:
            fix = "does the API server trust the client certificate's CA?"
        else:
            fix = "no credential is configured: give a token, a token file or a certificate"
        return f": the API server did not accept the credential of {self.config.source}: {fix}"

    def _decode(self, call: _Call, response: httpx.Response) -> dict[str, Any]:
        try:
            value = response.json()
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise KubeError(
                f"{call.describe()}: the API server answered {response.status_code} with "
                "something that is not a JSON object",
                status=response.status_code, reason="InvalidResponse", verb=call.verb,
                resource=str(call.resource), namespace=call.namespace, name=call.name,
            )  # fmt: skip
        return value

    def _namespace(self, resource: Resource, namespace: str | None, verb: str) -> str | None:
        if resource.namespaced and namespace is None:
            raise KubeUsageError(
                f"{verb} {resource}: {resource.plural} are namespaced: give namespace= "
                "(the configuration's own is KubeClient.namespace)"
            )
        return namespace if resource.namespaced else None

    # ---------------------------------------------------------------------- reading

    async def get(
        self, resource: Resource, name: str, *, namespace: str | None = None,
        subresource: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The object ``name``; ``NotFound`` when there is none."""
        call = _Call(
            "get", "GET", resource, self._namespace(resource, namespace, "get"), name,
            subresource, idempotent=True,
        )  # fmt: skip
        return await self._request(call)

    async def list(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> ObjectList:
        """One page of objects (every namespace when ``namespace`` is None): at most
        ``limit`` of them, from ``continue_token`` on. An expired token raises ``Gone``."""
        params = _selectors(label_selector, field_selector)
        if limit is not None:
            if limit < 1:
                raise KubeUsageError(f"list {resource}: limit={limit}: give at least 1")
            params["limit"] = str(limit)
        if continue_token:
            params["continue"] = continue_token
        call = _Call("list", "GET", resource, namespace if resource.namespaced else None,
                     params=params, idempotent=True)  # fmt: skip
        answer = await self._request(call)
        meta = answer.get("metadata") or {}
        remaining = meta.get("remainingItemCount")
        return ObjectList(
            items=list(answer.get("items") or []),
            resource_version=str(meta.get("resourceVersion", "")),
            continue_token=meta.get("continue") or None,
            remaining_item_count=remaining if isinstance(remaining, int) else None,
        )

    async def list_all(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        page_size: int = 500,
    ) -> ObjectList:
        """Every object, fetched ``page_size`` at a time; one consistent snapshot (the pages
        of one list share its resourceVersion, returned)."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        first_version = ""
        while True:
            page = await self.list(
                resource, namespace=namespace, label_selector=label_selector,
                field_selector=field_selector, limit=page_size, continue_token=token,
            )  # fmt: skip
            items.extend(page.items)
            first_version = first_version or page.resource_version
            token = page.continue_token
            if token is None:
                return ObjectList(items, first_version)

    def watch(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        resource_version: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        allow_bookmarks: bool = True,
        timeout_seconds: int = 300,
    ) -> Watch:
        """A watch of ``resource`` (every namespace when ``namespace`` is None) from
        ``resource_version`` (None: the current state first, as ADDED events). Use as
        ``async with client.watch(...) as events: async for type, obj in events``; the start
        (and a ``WatchExpired`` or ``Forbidden`` answer) happens on entering."""
        if timeout_seconds < 1:
            raise KubeUsageError(f"watch {resource}: timeout_seconds={timeout_seconds}: give "
                                 "at least 1 (the server then ends the watch)")  # fmt: skip
        params = _selectors(label_selector, field_selector)
        params.update(watch="1", timeoutSeconds=str(timeout_seconds))
        if allow_bookmarks:
            params["allowWatchBookmarks"] = "true"
        if resource_version is not None:
            params["resourceVersion"] = resource_version
        call = _Call("watch", "GET", resource, namespace if resource.namespaced else None,
                     params=params, idempotent=True)  # fmt: skip
        read = timeout_seconds + self.timeouts.watch_margin
        return Watch(
            lambda: self._send(call, stream=True, read=read), what=call.describe(),
            resource=str(resource), namespace=call.namespace, since=resource_version,
        )  # fmt: skip

    # ---------------------------------------------------------------------- writing

    async def create(
        self, resource: Resource, obj: Mapping[str, Any], *, namespace: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Create ``obj`` (``metadata.name`` or ``metadata.generateName``); the created
        object. ``AlreadyExists`` when the name is taken. Sent again only when it cannot have
        reached the server: after an ``Unavailable``, get the object by its name to know."""
        meta = obj.get("metadata")
        if not isinstance(meta, Mapping) or not (meta.get("name") or meta.get("generateName")):
            raise KubeUsageError(
                f"create {resource}: the object has neither metadata.name nor "
                "metadata.generateName: give one (a deterministic name makes a retry safe)"
            )
        body = dict(obj)
        if resource.kind:
            body.setdefault("apiVersion", resource.api_version)
            body.setdefault("kind", resource.kind)
        call = _Call(
            "create", "POST", resource, self._namespace(resource, namespace, "create"),
            params={"fieldManager": field_manager or self.field_manager},
            body=_json_body(body), content_type="application/json",
        )  # fmt: skip
        return await self._request(call)

    async def merge_patch(
        self,
        resource: Resource,
        name: str,
        patch: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        resource_version: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386) of ``name`` (or of its ``subresource``, e.g.
        ``status``); with ``resource_version``, applied only if the object still has it, else
        ``Conflict``. The patched object."""
        body = dict(patch)
        if resource_version is not None:
            meta = dict(body.get("metadata") or {})
            body["metadata"] = {**meta, "resourceVersion": resource_version}
        return await self._patch(
            resource, name, body, "application/merge-patch+json", namespace=namespace,
            subresource=subresource, field_manager=field_manager,
        )  # fmt: skip

    async def json_patch(
        self,
        resource: Resource,
        name: str,
        operations: Sequence[Mapping[str, Any]],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        resource_version: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        """A JSON patch (RFC 6902) of ``name``: all operations or none. A failed ``test``
        operation raises ``PatchTestFailed`` (a ``Conflict``); with ``resource_version``, the
        patch applies only to that version of the object, else ``Conflict``."""
        ops = [dict(op) for op in operations]
        if not ops:
            raise KubeUsageError(f"json_patch {resource} {name}: give at least one operation")
        if resource_version is not None:  # a replace of it makes the server check it (409)
            ops.insert(0, {"op": "replace", "path": "/metadata/resourceVersion",
                           "value": resource_version})  # fmt: skip
        return await self._patch(
            resource, name, ops, "application/json-patch+json", namespace=namespace,
            subresource=subresource, field_manager=field_manager,
        )  # fmt: skip

    async def _patch(
        self, resource: Resource, name: str, body: Any, content_type: str, *,
        namespace: str | None, subresource: str | None, field_manager: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        call = _Call(
            "patch", "PATCH", resource, self._namespace(resource, namespace, "patch"), name,
            subresource, params={"fieldManager": field_manager or self.field_manager},
            body=_json_body(body), content_type=content_type,
            json_patch=content_type == "application/json-patch+json",
        )  # fmt: skip
        return await self._request(call)

    async def delete(
        self,
        resource: Resource,
        name: str,
        *,
        namespace: str | None = None,
        propagation_policy: str | None = None,
        uid: str | None = None,
        resource_version: str | None = None,
        grace_period_seconds: int | None = None,
    ) -> dict[str, Any]:
        """Delete ``name``; the answer (a Status, or the object while finalizers hold it).
        ``NotFound`` means it is already gone. With ``uid`` / ``resource_version``, only that
        object / version is deleted (else ``Conflict``), and the request may be retried."""
        if propagation_policy not in (None, "Foreground", "Background", "Orphan"):
            raise KubeUsageError(
                f"delete {resource} {name}: propagation_policy={propagation_policy!r}: give "
                "'Foreground', 'Background' or 'Orphan'"
            )
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if propagation_policy is not None:
            options["propagationPolicy"] = propagation_policy
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version))
                         if v is not None}  # fmt: skip
        if preconditions:
            options["preconditions"] = preconditions
        call = _Call(
            "delete", "DELETE", resource, self._namespace(resource, namespace, "delete"), name,
            body=_json_body(options), content_type="application/json",
            idempotent=bool(preconditions),
        )  # fmt: skip
        return await self._request(call)

    # ---------------------------------------------------------------------- identity

    async def token_review(
        self, token: str, audiences: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """The API server's verdict on ``token`` (TokenReview ``status``: ``authenticated``,
        ``user``, ``audiences``, ``error``). Without ``audiences`` it checks the API server's
        own; with them, ``status.audiences`` says which matched."""
        spec: dict[str, Any] = {"token": token}
        if audiences is not None:
            spec["audiences"] = list(audiences)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
        call = _Call("create", "POST", TOKEN_REVIEWS, body=_json_body(body),
                     content_type="application/json", idempotent=True,
                     secrets=(token,))  # fmt: skip
        answer = await self._request(call)
        return dict(answer.get("status") or {})

    async def access_review(self, access: Access) -> AccessReview:
        """Whether this client's identity may do ``access`` (a SelfSubjectAccessReview, which
        every authenticated identity may create)."""
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": access.attributes()}  # fmt: skip
        call = _Call("create", "POST", SELF_SUBJECT_ACCESS_REVIEWS, body=_json_body(body),
                     content_type="application/json", idempotent=True)  # fmt: skip
        status = (await self._request(call)).get("status") or {}
        return AccessReview(
            access, allowed=status.get("allowed") is True, denied=status.get("denied") is True,
            reason=str(status.get("reason") or ""),
        )  # fmt: skip

    async def require_access(
        self, needed: Iterable[Access], *, who: str = "this client's identity",
        fix: str = "add the verbs to the Role bound to it",
    ) -> builtins.list[AccessReview]:  # fmt: skip
        """Check every permission in ``needed`` at once; ``MissingPermissions`` naming each
        one missing (``who`` may not `watch` `sandboxclaims` in namespace X; ..., then
        ``fix``). The reviews, when all are allowed."""
        reviews = await asyncio.gather(*(self.access_review(a) for a in needed))
        missing = [r.access for r in reviews if not r.allowed]
        if missing:
            raise MissingPermissions(
                f"{who} may not " + "; may not ".join(str(a) for a in missing) + f": {fix}",
                missing=[(a.verb, str(a.resource or a.path), a.namespace) for a in missing],
            )
        return list(reviews)


def _selectors(label_selector: str | None, field_selector: str | None) -> dict[str, str]:
    params: dict[str, str] = {}
    if label_selector:
        params["labelSelector"] = label_selector
    if field_selector:
        params["fieldSelector"] = field_selector
    return params
