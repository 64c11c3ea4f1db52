"""The errors of the Kubernetes API client (``_api``): one small typed hierarchy.

``KubeError`` is the root: ``status`` (the HTTP status, 0 when there was none), ``reason``
(the Status object's ``reason``, or ours), ``message`` (the server's own message), and what the
request was about (``verb``, ``resource``, ``namespace``, ``name``). ``str()`` of an error says
what failed, why, and where it helps, what to do. No error ever holds a token, an
``Authorization`` header or a request body: messages come from the server's Status object and
from the request's verb and path, and the client scrubs the credential it sent (and a token
under review) out of anything the server echoes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AlreadyExists",
    "BadRequest",
    "Cause",
    "Conflict",
    "Forbidden",
    "Gone",
    "Invalid",
    "KubeConfigError",
    "KubeError",
    "KubeUsageError",
    "MissingPermissions",
    "NotFound",
    "PatchTestFailed",
    "Unauthorized",
    "Unavailable",
    "WatchExpired",
    "error_for_status",
]


class KubeError(Exception):
    """A request to the Kubernetes API failed (or could not be made)."""

    def __init__(
        self,
        text: str,
        *,
        status: int = 0,
        reason: str = "",
        message: str = "",
        verb: str = "",
        resource: str = "",
        namespace: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(text)
        self.status = status
        self.reason = reason
        self.message = message
        self.verb = verb
        self.resource = resource
        self.namespace = namespace
        self.name = name


class KubeConfigError(KubeError):
    """The connection settings (in-cluster files, a kubeconfig, a token file) are unusable.

    ``source`` names the file or variable, ``key`` the setting inside it (``""`` for the file
    itself); the message says the rule broken and the fix."""

    def __init__(self, text: str, *, source: str, key: str = "") -> None:
        super().__init__(text, reason="InvalidConfiguration")
        self.source = source
        self.key = key


class KubeUsageError(KubeError, ValueError):
    """A call the client refuses before sending anything (a missing namespace, a name that
    cannot be a path segment, an object without a name): a bug in the caller."""


class BadRequest(KubeError):
    """400: the API server could not decode or accept the request (an invalid continue
    token, an object without ``kind``)."""


class Unauthorized(KubeError):
    """401: the API server did not accept the credential (an expired or revoked token, a
    certificate it does not trust)."""


class Forbidden(KubeError):
    """403: the identity may not do ``verb`` on ``resource`` in ``namespace`` (RBAC)."""


class MissingPermissions(Forbidden):
    """The access check found verbs the identity lacks; ``missing`` lists each of them as
    ``(verb, resource, namespace)``."""

    def __init__(self, text: str, *, missing: Sequence[tuple[str, str, str | None]]) -> None:
        verb, resource, namespace = missing[0] if missing else ("", "", None)
        super().__init__(
            text,
            status=403,
            reason="Forbidden",
            verb=verb,
            resource=resource,
            namespace=namespace,
        )
        self.missing = tuple(missing)


class NotFound(KubeError):
    """404: no such object (for a delete: it is already gone) or no such resource type."""


class AlreadyExists(KubeError):
    """409 ``AlreadyExists``: a create found an object of that name (a retry of one that
    succeeded, or another writer's): get it and decide."""


class Conflict(KubeError):
    """409: a precondition did not hold (``resourceVersion`` or ``uid``): the object changed
    since it was read; read it again and retry the change if it still applies."""


class PatchTestFailed(Conflict):
    """422 answering a JSON patch: one of its ``test`` operations did not hold (or a path it
    names does not exist), so nothing was changed. A ``Conflict``: the object is not what the
    caller expected."""


class Gone(KubeError):
    """410: what the request refers to is too old (an expired ``continue`` token, a watch's
    ``resourceVersion`` the server no longer has): list again."""


class WatchExpired(Gone):
    """A watch's ``resourceVersion`` is too old (HTTP 410 before the stream, or the ERROR
    event with code 410 ``Expired`` that 1.20 sends after an HTTP 200): list again and watch
    from the list's ``resourceVersion``."""


@dataclass(frozen=True)
class Cause:
    """One field the API server refused (``details.causes[]`` of a 422 Status)."""

    field: str
    reason: str
    message: str


class Invalid(KubeError):
    """422: the object breaks the schema or a validation rule; ``causes`` names each field."""

    def __init__(self, text: str, *, causes: Sequence[Cause] = (), **kwargs: Any) -> None:
        super().__init__(text, **kwargs)
        self.causes = tuple(causes)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(cause.field for cause in self.causes)


class Unavailable(KubeError):
    """The API server could not be reached or did not answer usefully: a transport error, a
    timeout, 429 or 5xx (after the retries an idempotent request gets), a redirect (never
    followed). ``status`` is 0 when no answer came."""


_BY_STATUS: Mapping[int, type[KubeError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    422: Invalid,
}


def _causes(status: Mapping[str, Any]) -> list[Cause]:
    details = status.get("details")
    raw = details.get("causes") if isinstance(details, Mapping) else None
    if not isinstance(raw, list):
        return []
    return [
        Cause(str(c.get("field", "")), str(c.get("reason", "")), str(c.get("message", "")))
        for c in raw
        if isinstance(c, Mapping)
    ]


def error_for_status(
    code: int, status: Mapping[str, Any], *, json_patch: bool = False
) -> tuple[type[KubeError], dict[str, Any]]:
    """The error class for an answer with ``code`` and its decoded Status object, and the
    keywords (beyond the request's own) to build it with."""
    reason = str(status.get("reason") or "")
    extra: dict[str, Any] = {}
    cls: type[KubeError]
    if code == 409 and reason == "AlreadyExists":
        cls = AlreadyExists
    elif code == 422 and json_patch and not _causes(status):
        cls = PatchTestFailed
    elif code == 422:
        cls, extra = Invalid, {"causes": _causes(status)}
    elif code == 429 or code >= 500 or 300 <= code < 400:
        cls = Unavailable
    else:
        cls = _BY_STATUS.get(code, KubeError)
    return cls, extra
