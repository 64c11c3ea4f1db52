"""The dialect interface: everything one broker protocol decides, behind one object.

A dialect builds the control-plane requests and reads their answers (as :class:`Call`s), maps
error answers to typed errors, says what "already gone" means, and which headers route a
data-plane request to a sandbox. The data plane itself (``_dataplane``) and the exchange
(``_exchange``: auth, retries, timeouts) are shared by every dialect. Implementations:
``_dialect_v1`` (the broker API v1); the registry is ``_dialects``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._dataplane import DataTarget
from ._protocol import Call, Reply, RequestSpec, SandboxInfo
from .errors import BrokerError, ConfigurationError

__all__ = ["FEATURES", "CreateRequest", "Dialect"]

FEATURES = frozenset({"list", "whoami", "idempotent_create", "lifetime"})
"""What a dialect may lack: listing my sandboxes, asking who I am, replaying a create,
changing a sandbox's lifetime (:meth:`Dialect.extend`)."""


@dataclass(frozen=True)
class CreateRequest:
    """What ``create`` asks for, in the SDK's vocabulary (each dialect spells it its way)."""

    idempotency_key: str
    template: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    lifetime_seconds: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)


class Dialect(ABC):
    """One broker control-plane protocol. Stateless: one instance serves every client."""

    name: ClassVar[str]
    features: ClassVar[frozenset[str]] = FEATURES
    """The optional operations (:data:`FEATURES`) this dialect has."""

    def require(self, feature: str, what: str) -> None:
        """Refuse ``what`` before anything is sent if this dialect lacks ``feature``."""
        if feature not in self.features:
            raise ConfigurationError(
                f"Cannot {what}: the broker speaks the {self.name!r} dialect, which has no "
                f"{feature.replace('_', ' ')} operation."
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

    @abstractmethod
    def created_name(self, body: bytes) -> str | None:
        """The sandbox a create answer names even if it is otherwise unusable (to delete it)."""

    @abstractmethod
    def get(self, name: str) -> Call[SandboxInfo]:
        """The current state of one sandbox."""

    @abstractmethod
    def wait_ready(self, name: str, remaining: float, request_timeout: float) -> Call[SandboxInfo]:
        """One wait for Ready of at most ``remaining`` seconds (a long-poll or a status poll)."""

    @abstractmethod
    def list_sandboxes(
        self, label_selector: Mapping[str, str] | str | None
    ) -> Call[list[SandboxInfo]]:
        """My sandboxes, newest first."""

    @abstractmethod
    def delete(self, name: str) -> Call[bool]:
        """Delete one sandbox; the answer is ``False`` if it was already gone."""

    def extend(self, name: str, seconds: int) -> Call[SandboxInfo]:
        """Set sandbox ``name``'s deadline to now + ``seconds`` (later or earlier); the answer
        is its new state. Retryable (idempotent in effect). A dialect without the ``lifetime``
        feature refuses it (:meth:`require`)."""
        self.require("lifetime", "change a sandbox's lifetime")
        raise NotImplementedError(
            f"The {self.name!r} broker dialect cannot change a sandbox's lifetime; set the "
            "lifetime at create (timeout=) instead."
        )

    # -- errors and the data plane ---------------------------------------------------------

    @abstractmethod
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

    @abstractmethod
    def token_rejected(self, status: int, headers: Mapping[str, str], body: bytes) -> bool:
        """Whether an answer is the broker itself rejecting the token (then, and only then, the
        credential is re-read and the request sent once more; any other 401 comes from behind
        the broker and is never a reason to replay). Decide from what only the broker can
        set: a forwarded answer's body and headers are the runtime's to choose."""

    def data_target(self, info: SandboxInfo) -> DataTarget:
        """Where the data plane of sandbox ``info`` goes (the routing headers)."""
        return info.router
