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
errors), ``_api_watch`` (the watch iterator), ``_api_types`` (resource types, settings, answers,
permissions: import them from there) and ``_api_request`` (one request, the bearer token, what a
failure says). They import nothing else of the package but ``_version``.

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
import logging
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final

import httpx

from ...._version import __version__
from ._api_config import KubeConfig
from ._api_errors import (
    KubeError,
    KubeUsageError,
    MissingPermissions,
    Unavailable,
    error_for_status,
)
from ._api_request import (
    BearerAuth,
    Call,
    certificate_failure,
    json_body,
    not_sent,
    retry_after,
    scrub,
    selectors,
    unauthorized_hint,
)
from ._api_types import (
    SELF_SUBJECT_ACCESS_REVIEWS,
    TOKEN_REVIEWS,
    Access,
    AccessReview,
    ObjectList,
    Resource,
    Retry,
    Timeouts,
)
from ._api_watch import Watch, WatchEnd

__all__ = ["USER_AGENT", "KubeClient", "Watch", "WatchEnd"]

USER_AGENT: Final = f"k8s-agent-sandbox-awx/{__version__} (broker)"
DEFAULT_FIELD_MANAGER: Final = "agent-sandbox-awx"
_log = logging.getLogger(__name__)
_NOT_SERVED: Final = ("the server could not find the requested resource", "404 page not found")


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
        self._auth = BearerAuth(config.token) if config.token is not None else None
        self._http = httpx.AsyncClient(
            base_url=config.server,
            verify=config.ssl_context,
            auth=self._auth,
            timeout=self.timeouts.httpx(),
            follow_redirects=False,
            trust_env=False,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            headers={"User-Agent": USER_AGENT, "Accept": "application/json"},
        )

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

    async def _request(self, call: Call) -> dict[str, Any]:
        """Send ``call`` (with the retries it may have); the decoded JSON answer."""
        response = await self._send(call)
        return self._decode(call, response)

    async def _send(
        self, call: Call, *, stream: bool = False, read: float | None = None
    ) -> httpx.Response:
        """Send ``call`` until an answer below 300 comes (returned; when ``stream``, unread),
        retrying what may be retried; else raise its typed error."""
        headers = {"Content-Type": call.content_type} if call.content_type else {}
        attempt = 0
        while True:
            attempt += 1
            request = self._http.build_request(
                call.method,
                call.path,
                params=dict(call.params),
                content=call.body,
                headers=headers,
                timeout=self.timeouts.httpx(read),
            )
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                delay = self._after_transport_error(call, exc, attempt)
            else:
                if response.status_code < 300:
                    return response
                delay = await self._after_status(call, response, attempt)
            await asyncio.sleep(delay)

    def _after_transport_error(self, call: Call, exc: httpx.TransportError, attempt: int) -> float:
        """Seconds before sending ``call`` again, or raise ``Unavailable``."""
        detail = f"{type(exc).__name__}: {scrub(str(exc), self._secrets(call))}"
        if certificate_failure(exc):
            raise Unavailable(
                f"{call.describe()}: the API server's certificate does not verify ({detail}): "
                f"give the cluster's CA in {self.config.source}",
                verb=call.verb,
                resource=str(call.resource),
                namespace=call.namespace,
                name=call.name,
            ) from None
        retryable = not_sent(exc) or call.idempotent
        if retryable and attempt < self.retry.attempts:
            return self._again(call, attempt, type(exc).__name__, self.retry.delay(attempt))
        why = (
            f"after {attempt} attempts"
            if retryable
            else "not sent again: it may have reached the server; read the object to see"
        )
        raise Unavailable(
            f"{call.describe()}: the API server at {self.config.server} did not answer "
            f"({detail}); {why}",
            verb=call.verb,
            resource=str(call.resource),
            namespace=call.namespace,
            name=call.name,
        ) from None

    async def _after_status(self, call: Call, response: httpx.Response, attempt: int) -> float:
        """Seconds before sending ``call`` again after an error answer, or raise its error."""
        await response.aread()
        await response.aclose()
        code = response.status_code
        retryable = code == 429 or (code >= 500 and call.idempotent)
        if retryable and attempt < self.retry.attempts:
            delay = self.retry.delay(attempt, retry_after(response.headers))
            return self._again(call, attempt, f"{code} {response.reason_phrase}", delay)
        raise self._error(call, response, attempts=attempt if retryable else 0)

    def _again(self, call: Call, attempt: int, why: str, delay: float) -> float:
        _log.info(
            "%s: attempt %d of %d failed (%s); again in %.2f s",
            call.describe(),
            attempt,
            self.retry.attempts,
            why,
            delay,
        )
        return delay

    def _secrets(self, call: Call) -> tuple[str, ...]:
        return (*call.secrets, self._auth.last if self._auth is not None else "")

    def _error(self, call: Call, response: httpx.Response, *, attempts: int = 0) -> KubeError:
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
        message = scrub(str(status.get("message") or "").strip(), self._secrets(call))
        text = f"{call.describe()}: {code} {reason}" + (f": {message}" if message else "")
        text += self._hint(call, code, message, response, attempts)
        return cls(
            text,
            status=code,
            reason=reason,
            message=message,
            verb=call.verb,
            resource=str(call.resource),
            namespace=call.namespace,
            name=call.name,
            **extra,
        )

    def _hint(
        self, call: Call, code: int, message: str, response: httpx.Response, attempts: int
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
            return unauthorized_hint(self.config)
        if code == 403:
            where = f" in namespace {call.namespace}" if call.namespace else ""
            return (
                f": grant `{call.verb}` on `{call.resource}`{where} to this identity (a Role "
                "and a RoleBinding)"
            )
        if code == 404 and message in _NOT_SERVED:
            return f": the API server does not serve {call.resource}; is its CRD installed?"
        return ""

    def _decode(self, call: Call, response: httpx.Response) -> dict[str, Any]:
        try:
            value = response.json()
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise KubeError(
                f"{call.describe()}: the API server answered {response.status_code} with "
                "something that is not a JSON object",
                status=response.status_code,
                reason="InvalidResponse",
                verb=call.verb,
                resource=str(call.resource),
                namespace=call.namespace,
                name=call.name,
            )
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
        self,
        resource: Resource,
        name: str,
        *,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """The object ``name``; ``NotFound`` when there is none."""
        call = Call(
            "get",
            "GET",
            resource,
            self._namespace(resource, namespace, "get"),
            name,
            subresource,
            idempotent=True,
        )
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
        params = selectors(label_selector, field_selector)
        if limit is not None:
            if limit < 1:
                raise KubeUsageError(f"list {resource}: limit={limit}: give at least 1")
            params["limit"] = str(limit)
        if continue_token:
            params["continue"] = continue_token
        call = Call(
            "list",
            "GET",
            resource,
            namespace if resource.namespaced else None,
            params=params,
            idempotent=True,
        )
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
                resource,
                namespace=namespace,
                label_selector=label_selector,
                field_selector=field_selector,
                limit=page_size,
                continue_token=token,
            )
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
            raise KubeUsageError(
                f"watch {resource}: timeout_seconds={timeout_seconds}: give "
                "at least 1 (the server then ends the watch)"
            )
        params = selectors(label_selector, field_selector)
        params.update(watch="1", timeoutSeconds=str(timeout_seconds))
        if allow_bookmarks:
            params["allowWatchBookmarks"] = "true"
        if resource_version is not None:
            params["resourceVersion"] = resource_version
        call = Call(
            "watch",
            "GET",
            resource,
            namespace if resource.namespaced else None,
            params=params,
            idempotent=True,
        )
        read = timeout_seconds + self.timeouts.watch_margin
        return Watch(
            lambda: self._send(call, stream=True, read=read),
            what=call.describe(),
            resource=str(resource),
            namespace=call.namespace,
            since=resource_version,
        )

    # ---------------------------------------------------------------------- writing

    async def create(
        self,
        resource: Resource,
        obj: Mapping[str, Any],
        *,
        namespace: str | None = None,
        field_manager: str | None = None,
        server_timeout: float | None = None,
    ) -> dict[str, Any]:
        """Create ``obj`` (``metadata.name`` or ``metadata.generateName``); the created
        object. ``AlreadyExists`` when the name is taken. Sent again only when it cannot have
        reached the server: after an ``Unavailable``, get the object by its name to know.
        ``server_timeout``: the seconds (whole, at least 1) the API server may take for it (its
        ``timeout`` parameter: it gives up then instead of storing the object later)."""
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
        params = {"fieldManager": field_manager or self.field_manager}
        if server_timeout is not None:
            params["timeout"] = f"{max(1, int(server_timeout))}s"
        call = Call(
            "create",
            "POST",
            resource,
            self._namespace(resource, namespace, "create"),
            params=params,
            body=json_body(body),
            content_type="application/json",
        )
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
            resource,
            name,
            body,
            "application/merge-patch+json",
            namespace=namespace,
            subresource=subresource,
            field_manager=field_manager,
        )

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
            ops.insert(
                0, {"op": "replace", "path": "/metadata/resourceVersion", "value": resource_version}
            )
        return await self._patch(
            resource,
            name,
            ops,
            "application/json-patch+json",
            namespace=namespace,
            subresource=subresource,
            field_manager=field_manager,
        )

    async def _patch(
        self,
        resource: Resource,
        name: str,
        body: Any,
        content_type: str,
        *,
        namespace: str | None,
        subresource: str | None,
        field_manager: str | None,
    ) -> dict[str, Any]:
        call = Call(
            "patch",
            "PATCH",
            resource,
            self._namespace(resource, namespace, "patch"),
            name,
            subresource,
            params={"fieldManager": field_manager or self.field_manager},
            body=json_body(body),
            content_type=content_type,
            json_patch=content_type == "application/json-patch+json",
        )
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
        preconditions = {
            k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v is not None
        }
        if preconditions:
            options["preconditions"] = preconditions
        call = Call(
            "delete",
            "DELETE",
            resource,
            self._namespace(resource, namespace, "delete"),
            name,
            body=json_body(options),
            content_type="application/json",
            idempotent=bool(preconditions),
        )
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
        call = Call(
            "create",
            "POST",
            TOKEN_REVIEWS,
            body=json_body(body),
            content_type="application/json",
            idempotent=True,
            secrets=(token,),
        )
        answer = await self._request(call)
        return dict(answer.get("status") or {})

    async def access_review(self, access: Access) -> AccessReview:
        """Whether this client's identity may do ``access`` (a SelfSubjectAccessReview, which
        every authenticated identity may create)."""
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": access.attributes(),
        }
        call = Call(
            "create",
            "POST",
            SELF_SUBJECT_ACCESS_REVIEWS,
            body=json_body(body),
            content_type="application/json",
            idempotent=True,
        )
        status = (await self._request(call)).get("status") or {}
        return AccessReview(
            access,
            allowed=status.get("allowed") is True,
            denied=status.get("denied") is True,
            reason=str(status.get("reason") or ""),
        )

    async def require_access(
        self,
        needed: Iterable[Access],
        *,
        who: str = "this client's identity",
        fix: str = "add the verbs to the Role bound to it",
    ) -> builtins.list[AccessReview]:
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
