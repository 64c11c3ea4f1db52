"""What the broker's Kubernetes API client (:mod:`._api`) is given and gives back, apart
from the client itself: a resource type (:class:`Resource`, and the ones the broker uses), the
client's settings (:class:`Timeouts`, :class:`Retry`), a list's page (:class:`ObjectList`) and
a permission to check (:class:`Access`) with the authorizer's answer (:class:`AccessReview`).
Re-exported by :mod:`._api`; imports nothing else of the package but ``_api_errors``."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import httpx

from ._api_errors import KubeUsageError

__all__ = [
    "CONFIG_MAPS",
    "LEASES",
    "NAMESPACES",
    "SANDBOX_CLAIMS",
    "SELF_SUBJECT_ACCESS_REVIEWS",
    "TOKEN_REVIEWS",
    "Access",
    "AccessReview",
    "ObjectList",
    "Resource",
    "Retry",
    "Timeouts",
]

_SEGMENT: Final = re.compile(r"[^/%?#\s\\]+")


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
CONFIG_MAPS: Final = Resource("", "v1", "configmaps", "ConfigMap")
LEASES: Final = Resource("coordination.k8s.io", "v1", "leases", "Lease")
NAMESPACES: Final = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
TOKEN_REVIEWS: Final = Resource(
    "authentication.k8s.io", "v1", "tokenreviews", "TokenReview", namespaced=False
)
SELF_SUBJECT_ACCESS_REVIEWS: Final = Resource(
    "authorization.k8s.io",
    "v1",
    "selfsubjectaccessreviews",
    "SelfSubjectAccessReview",
    namespaced=False,
)


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
            connect=self.connect,
            read=self.read if read is None else read,
            write=self.write,
            pool=self.pool,
        )


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
        what = (
            f"{self.resource.plural}/{self.subresource}"
            if self.subresource
            else (self.resource.plural)
        )
        group = f" ({self.resource.group})" if self.resource.group else ""
        where = (
            ""
            if not self.resource.namespaced
            else f" in namespace {self.namespace}"
            if self.namespace
            else " in every namespace"
        )
        one = f" named {self.name!r}" if self.name else ""
        return f"`{self.verb}` `{what}`{group}{one}{where}"

    def attributes(self) -> dict[str, Any]:
        """The SelfSubjectAccessReview spec for this permission."""
        if self.resource is None:
            return {"nonResourceAttributes": {"verb": self.verb, "path": self.path or "/"}}
        attributes: dict[str, Any] = {
            "verb": self.verb,
            "group": self.resource.group,
            "version": self.resource.version,
            "resource": self.resource.plural,
        }
        for key, value in (
            ("namespace", self.namespace),
            ("name", self.name),
            ("subresource", self.subresource),
        ):
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
