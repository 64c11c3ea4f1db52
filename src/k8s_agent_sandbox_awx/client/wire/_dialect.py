"""The dialect interface: everything one broker protocol decides, behind one object.

A dialect builds the control-plane requests and reads their answers (as :class:`Call`s), maps
error answers to typed errors, says what "already gone" means, and which headers route a
data-plane request to a sandbox. The data plane itself (``_dataplane``) and the exchange
(``_exchange``: auth, retries, timeouts) are shared by every dialect. Implementations:
``_dialect_v1`` (the broker API v1) and ``_dialect_rpc`` (the ``/rpc`` dialect of the brokers
deployed for the original package); the registry is ``_dialects``. What a dialect cannot do is
in its ``features``; asking for it raises :class:`UnsupportedOperationError` naming the
dialect, before anything is sent.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ...errors import BrokerError, UnsupportedOperationError
from ._dataplane import DataTarget
from ._protocol import Call, Reply, RequestSpec, SandboxInfo

__all__ = [
    "CLAMP_LIFETIME",
    "FEATURES",
    "LIFETIME",
    "LIST",
    "REPLAY_CREATE",
    "SANDBOX_ENV",
    "WHOAMI",
    "CreateRequest",
    "Dialect",
    "ErrorFromResponse",
    "Lifetime",
    "default_lifetime_marked",
]

LIST = "list"
"""Feature: list my sandboxes."""
WHOAMI = "whoami"
"""Feature: ask the broker who I am."""
REPLAY_CREATE = "idempotent_create"
"""Feature: a create can be sent again and returns the same sandbox (an idempotency key);
without it a create is never retried and an interrupted one cannot be looked up."""
LIFETIME = "lifetime"
"""Feature: change a sandbox's lifetime (:meth:`Dialect.extend`)."""
SANDBOX_ENV = "sandbox_env"
"""Feature: environment variables for every command of a sandbox, given at create (``env=``)."""
FEATURES = frozenset({LIST, WHOAMI, REPLAY_CREATE, LIFETIME, SANDBOX_ENV})
"""What a dialect may lack: listing my sandboxes, asking who I am, replaying a create,
changing a sandbox's lifetime, a sandbox-wide environment."""


CLAMP_LIFETIME = "clamp-lifetime"
"""The ``Prefer`` preference (RFC 7240) of a create whose lifetime is the SDK's default."""


def default_lifetime_marked(spec: RequestSpec, request: CreateRequest) -> RequestSpec:
    """``spec`` (a create) with ``Prefer: clamp-lifetime`` when ``request``'s lifetime is the
    SDK's default (docs/broker-api.md); unchanged otherwise."""
    if not request.lifetime_is_default or request.lifetime_seconds is None:
        return spec
    return dataclasses.replace(spec, headers={**spec.headers, "Prefer": CLAMP_LIFETIME})


@dataclass(frozen=True)
class CreateRequest:
    """What ``create`` asks for, in the SDK's vocabulary (each dialect spells it its way)."""

    idempotency_key: str
    template: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    lifetime_seconds: int | None = None
    lifetime_is_default: bool = False
    """``lifetime_seconds`` is the SDK's default, not the caller's choice: the request says so
    (``Prefer: clamp-lifetime``), and a broker that knows the preference cuts it at its
    policy's cap instead of refusing it (one that does not answers as it always did)."""
    env: Mapping[str, str] = field(default_factory=dict)
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    scopes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Lifetime:
    """The answer to ``extend``: the new deadline (RFC 3339, as the broker reports it) and
    whether the broker cut it at its policy's cap."""

    expires_at: str | None
    capped: bool = False
    info: SandboxInfo | None = None
    """The sandbox's new state, when the dialect's answer carries it (v1)."""


class ErrorFromResponse(Protocol):
    """How a dialect reads an error answer: the typed error, its message saying what to do."""

    def __call__(
        self,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
        *,
        spec: RequestSpec,
        retried_auth: bool = False,
        secrets: Iterable[str] = (),
    ) -> BrokerError: ...


class Dialect(ABC):
    """One broker control-plane protocol. Stateless: one instance serves every client."""

    name: ClassVar[str]
    features: ClassVar[frozenset[str]] = FEATURES
    """The optional operations (:data:`FEATURES`) this dialect has."""
    created_name_field: ClassVar[str] = "name"
    """The field of a create answer that names the sandbox (:meth:`created_name`)."""

    def require(self, feature: str, what: str) -> None:
        """Refuse ``what`` before anything is sent if this dialect lacks ``feature``."""
        if feature not in self.features:
            raise UnsupportedOperationError(
                f"Cannot {what}: the broker speaks the {self.name!r} dialect, which has no "
                f"{feature.replace('_', ' ')} operation.",
                dialect=self.name,
                operation=feature,
            )

    def unsupported(self, operation: str, fix: str) -> UnsupportedOperationError:
        """The error for an operation this dialect lacks: names the dialect and the fix."""
        return UnsupportedOperationError(
            f"{operation} is not supported by the broker's {self.name!r} dialect. {fix}",
            dialect=self.name,
            operation=operation,
        )

    # -- control plane: requests and their answers -----------------------------------------

    @abstractmethod
    def healthz(self) -> Call[Reply]:
        """The unauthenticated health check (its answer carries the broker's ``Date``)."""

    @abstractmethod
    def whoami(self) -> Call[dict[str, Any]]:
        """The identity the broker verified for the current token."""

    @abstractmethod
    def create(self, request: CreateRequest) -> RequestSpec:
        """The create request (checked before anything is sent)."""

    @abstractmethod
    def parse_created(self, reply: Reply, spec: RequestSpec) -> SandboxInfo:
        """The sandbox a create answer describes."""

    def created_name(self, body: bytes) -> str | None:
        """The sandbox a create answer names even if it is otherwise unusable (to delete it):
        the non-empty string under :attr:`created_name_field` of a JSON object, if any."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        name = obj.get(self.created_name_field) if isinstance(obj, dict) else None
        return name if isinstance(name, str) and name else None

    @abstractmethod
    def get(self, name: str) -> Call[SandboxInfo]:
        """The current state of one sandbox."""

    @abstractmethod
    def wait_ready(
        self,
        name: str,
        remaining: float,
        request_timeout: float,
        *,
        poll: int = 0,
        poll_interval: float = 2.0,
    ) -> Call[SandboxInfo]:
        """One wait for Ready of at most ``remaining`` seconds (a long-poll or a status poll);
        ``poll`` counts the waits so far, ``poll_interval`` is the longest pause between two
        status polls."""

    @abstractmethod
    def list_sandboxes(
        self, label_selector: Mapping[str, str] | str | None
    ) -> Call[list[SandboxInfo]]:
        """My sandboxes, newest first."""

    @abstractmethod
    def delete(self, name: str, *, purpose: str | None = None) -> Call[bool]:
        """Delete one sandbox; the answer is ``False`` if it was already gone (a dialect that
        cannot tell answers ``True``). ``purpose``: why, for the broker's logs (e.g.
        ``"create_cleanup"``)."""

    @abstractmethod
    def extend(self, name: str, seconds: int) -> Call[Lifetime]:
        """Set sandbox ``name``'s deadline to now + ``seconds`` (later or earlier). Retryable
        (idempotent in effect). A dialect without the ``lifetime`` feature refuses it."""

    # -- errors and the data plane ---------------------------------------------------------

    error_from_response: ClassVar[ErrorFromResponse]
    """The dialect's reading of an error answer (its module's ``error_from_response``, set as
    a ``staticmethod``), which :meth:`error` calls."""

    def error(
        self,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
        *,
        spec: RequestSpec,
        retried_auth: bool = False,
        secrets: Iterable[str] = (),
    ) -> BrokerError:
        """The typed error for an error answer (its message says what to do); everything taken
        from the answer is redacted, ``secrets`` (the token sent) included."""
        return self.error_from_response(
            status, headers, body, spec=spec, retried_auth=retried_auth, secrets=secrets
        )

    @abstractmethod
    def token_rejected(
        self,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
        spec: RequestSpec | None = None,
    ) -> bool:
        """Whether an answer is the broker itself rejecting the token (then, and only then, the
        credential is re-read and the request sent once more; any other 401 comes from behind
        the broker and is never a reason to replay). Decide from what only the broker can
        set: a forwarded answer's body and headers are the runtime's to choose."""

    def data_target(self, info: SandboxInfo) -> DataTarget:
        """Where the data plane of sandbox ``info`` goes (the routing headers)."""
        return info.router
