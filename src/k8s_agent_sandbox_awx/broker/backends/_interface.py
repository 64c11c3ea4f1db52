"""What the broker needs from a backend: the sandboxes' claims, their state, and where their data
plane goes. This is the contract a second backend implements.

The broker's parts above the backend (the v1 and ``/rpc`` front-ends, the shared claims logic,
the data-plane forward) talk to it only through :class:`Backend`; what a caller may do (policy,
quotas' values, lifetimes' caps, scopes, attribution) is decided there, and the backend keeps
and enforces the result. Two backends: the local one (:class:`.local._backend.LocalBackend`:
records in memory, runtimes as host processes, expiry timers) and Kubernetes (claims in the API
server, Ready from a watch, stateless replicas).

The rules every backend holds:

- **State lives in the backend.** A :class:`ClaimState` is what the backend knew when it
  answered (a snapshot: read it again with :meth:`Backend.get`); no fact may live only in the
  broker's memory. A backend with several replicas keeps every fact (owner, idempotency key and
  request digest, lifetime, phase) where every replica sees it.
- **Atomic:** :meth:`Backend.create` checks the owner's quota (``ClaimRequest.max_live``) and
  makes the claim as one step: of concurrent creates of one owner who holds ``held`` live
  claims, under any interleaving (across replicas too), exactly ``min(max_live - held,
  creates)`` are admitted and the others raise :class:`QuotaExceeded` saying what the owner
  holds once they are decided, leaving nothing behind (across replicas this needs one
  serialization point every replica writes: the Kubernetes backend's per-owner ledger, written
  with a resourceVersion precondition, ``kubernetes._quota``); a create with an
  :class:`Idempotency` makes at most one claim per owner and key (for example a claim name
  derived from them), and a repeat finds that claim (:meth:`Backend.replay`, or
  ``Created.replayed``).
- **Eventually consistent:** :meth:`Backend.list_owned` and the phase a claim shows may lag
  behind the last change (a watch, an informer cache); :meth:`Backend.get` and
  :meth:`Backend.wait_ready` reflect what the backend knows now, and a get may notice a runtime
  that died (Ready -> Failed ``RuntimeExited``).
- **Live, Terminating, gone.** A claim is live while Pending or Ready (it counts toward the
  quota), Failed once it failed (it no longer counts, and stays until deleted or expired),
  Terminating once deleted or expired until its runtime is stopped, then gone. Lookups
  (:meth:`Backend.get`, :meth:`Backend.find_claim`, :meth:`Backend.list_owned`) answer live,
  Failed and Terminating claims and ``None`` (or leave them out) for gone ones; deleting a gone
  claim is ``None``, not an error ("already gone is gone"). A claim expires at ``expires_at``:
  the backend deletes it then (Terminating, reason ``Expired``).
- **Errors** are the exceptions below (the broker turns them into its API's answers):
  :class:`BackendUnavailable` when the backend cannot answer now (its API server is
  unreachable); anything else is a backend failure. Secrets never appear in a state, a
  route's repr or an error.
- **Where a claim is.** The name-keyed methods take ``namespace``: where the broker expects the
  claim (the caller's policy namespace, a data-plane request's X-Sandbox-Namespace, a state's
  own). A backend that keeps every claim in one place ignores it; one that reads namespaced
  objects (Kubernetes) looks there first and may answer ``None`` for a claim elsewhere.
- Every method runs on the broker's event loop and never blocks it; times are epoch seconds.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import httpx

from ._http11 import Http11Pool

__all__ = [
    "ENV_ANNOTATION",
    "IDEMPOTENCY_SECONDS",
    "RUNTIME_PORT",
    "Backend",
    "BackendUnavailable",
    "ClaimForgotten",
    "ClaimGone",
    "ClaimInvalid",
    "ClaimNameTaken",
    "ClaimRequest",
    "ClaimState",
    "Created",
    "Idempotency",
    "IdempotencyConflict",
    "Owner",
    "QuotaExceeded",
    "Route",
    "Unroutable",
    "WarmPool",
    "rfc3339",
]

RUNTIME_PORT = 8888
"""The port a sandbox's runtime serves (upstream's python runtime), the data plane's default."""
IDEMPOTENCY_SECONDS = 86400
"""How long a backend remembers a create's Idempotency-Key at least."""
ENV_ANNOTATION = "broker.agent-sandbox-awx.io/env"
"""The claim annotation that keeps a sandbox's environment (its create's ``env``, a JSON
object): its commands' environment, which the broker hands the runtime with each command start
(``runtime._env``); never a claim's ``spec.env``, which would be the pod's (both backends write
it so; under the reserved prefix, which only the broker sets)."""

PENDING, READY, FAILED, TERMINATING = "Pending", "Ready", "Failed", "Terminating"
"""The phases of a claim (see the module docstring)."""


def rfc3339(ts: float) -> str:
    """``ts`` as the Kubernetes API writes times (RFC 3339, UTC, whole seconds)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Owner:
    """The identity that owns a claim, as the broker verified it: ``(issuer, subject)`` is the
    owner; ``provider`` is shown with it."""

    issuer: str
    subject: str
    provider: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.issuer, self.subject)


@dataclass(frozen=True)
class Idempotency:
    """A create's Idempotency-Key and the digest of its request: a repeat with the same key and
    digest is the same create; with another digest it is :class:`IdempotencyConflict`."""

    key: str
    digest: str


@dataclass(frozen=True)
class ClaimRequest:
    """A claim to make, as the broker decided it (the policy applied, the stamps made)."""

    owner: Owner
    namespace: str
    template: str
    """The template (the warm pool, for Kubernetes) the sandbox is made from."""
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    stamps: Mapping[str, str]
    """The broker's attribution stamps (annotations under the reserved prefix): who made it."""
    env: Mapping[str, str]
    created_at: float
    lifetime_seconds: float
    """The claim expires ``lifetime_seconds`` after ``created_at``."""
    scopes: frozenset[str]
    """The data-plane action scopes granted (``required_scope`` of each request's path)."""
    max_live: int
    """The owner's quota: ``create`` raises QuotaExceeded when the owner already holds this many
    live claims."""
    claim_name: str | None = None
    """The name of the claim when the sandbox is named apart from it (an ``/rpc`` claim: its
    data-plane requests must name it); ``None``: the backend names the claim."""
    warm_pool: str | None = None
    """The warm pool the claim refers to (``None``: the template's own)."""
    pod_metadata: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Labels and annotations for the sandbox's pod (``{"labels": ..., "annotations": ...}``)."""
    failure: tuple[str, str] | None = None
    """``(reason, message)``: the claim is made Failed at once, nothing starts (a warm pool the
    backend resolved as missing: :meth:`Backend.resolve_warm_pool`)."""
    idempotency: Idempotency | None = None
    network: bool = True
    """The sandbox may use the network (the policy's ``network``). ``False``: the local
    backend gives it a network namespace of its own (isolated sandboxes) or refuses to start
    it; the Kubernetes backend leaves the network to the cluster (its NetworkPolicies)."""


@dataclass(frozen=True)
class ClaimState:
    """A claim as the backend knows it (a snapshot)."""

    name: str
    """The sandbox's name in the broker's API (v1's name, the data plane's X-Sandbox-ID)."""
    namespace: str
    template: str
    owner: Owner
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    stamps: Mapping[str, str]
    env: Mapping[str, str]
    created_at: float
    expires_at: float
    phase: str
    """Pending, Ready, Failed or Terminating (see the module docstring)."""
    reason: str | None
    message: str | None
    transition_at: float
    """When the phase last changed."""
    started_at: float | None
    """When the sandbox became Ready (``None``: not yet)."""
    bound: bool
    """A runtime is bound to the claim (it has an address; Ready may still come later)."""
    scopes: frozenset[str]
    uid: str
    claim_name: str | None = None
    """See ``ClaimRequest.claim_name``."""
    warm_pool: str | None = None
    pod_metadata: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    deleted: bool = False
    """Gone: deleted and its runtime stopped (only a replay still shows such a claim)."""
    sandbox_name: str | None = None
    """The runtime's own name when it is named apart from the claim (a Kubernetes Sandbox
    adopted from a warm pool keeps its pool's name): what ``/rpc`` status reports as
    ``sandbox_name`` and its data plane sends as X-Sandbox-ID; ``None``: ``name``."""

    @property
    def data_plane_name(self) -> str:
        """The X-Sandbox-ID of the sandbox of an ``/rpc`` claim (``sandbox_name``, else
        ``name``)."""
        return self.sandbox_name or self.name

    @property
    def live(self) -> bool:
        return self.phase in (PENDING, READY)

    @property
    def ending(self) -> bool:
        """Deleted or expired (Terminating), or gone."""
        return self.deleted or self.phase == TERMINATING


@dataclass(frozen=True)
class Created:
    """What :meth:`Backend.create` made, or found (``replayed``: a repeat of an idempotent
    create that raced with the first and lost)."""

    state: ClaimState
    replayed: bool = False


@dataclass(frozen=True)
class WarmPool:
    """What a warm pool named in a create resolves to: its template, or why a claim on it fails
    (``(reason, message)``, e.g. ``WarmPoolNotFound``)."""

    template: str
    failure: tuple[str, str] | None = None


@dataclass(frozen=True)
class Route:
    """Where one data-plane request to a Ready sandbox goes: ``http(s)://host:port`` plus the
    request's own target, over ``client`` (the backend's connections: it closes them when they
    lead nowhere any more; a plain-HTTP runtime's are the broker's own,
    :class:`._http11.Http11Pool`, any other route's an httpx client), with ``headers`` added (a
    router's: the sandbox's name, its namespace, the broker's own credential; never the
    caller's token)."""

    host: str
    port: int
    client: httpx.AsyncClient | Http11Pool = field(repr=False)
    scheme: str = "http"
    headers: Sequence[tuple[bytes, bytes]] = field(default=(), repr=False)
    count_command: Callable[[int], None] | None = field(default=None, repr=False)
    """Called with ``1`` before a command-running request (``POST /execute``, ``POST
    /commands``, ``POST /code/execute``) is sent, and with ``-1`` when it provably never reached
    the sandbox (the connection failed): the local backend counts them per sandbox; ``None``:
    not counted."""
    tls: ssl.SSLContext | None = field(default=None, repr=False)
    """For an ``https`` route: the TLS context ``client`` verifies the server with (the
    Kubernetes router's ``router_ca_file``); the broker's own connections that do not go
    through ``client`` (a WebSocket's, relayed by the broker) use it too. ``None``: the default
    trust store."""
    via_router: bool = False
    """The route goes through a router (Kubernetes: ``backend.kubernetes.router_url``): a
    connection that fails is the router's, not the sandbox port's (see
    ``broker.dataplane._unreachable``)."""
    methods: frozenset[str] | None = None
    """The request methods the route can carry (a router's: upstream's Python router proxies
    only GET, POST, PUT, DELETE and PATCH); ``None``: any. The broker refuses another method
    before sending (``405 method_not_routed``)."""


class QuotaExceeded(Exception):
    """The owner already holds ``held`` live claims, the maximum (``ClaimRequest.max_live``);
    ``pending`` of them are still being created (admitted, their claims not made yet)."""

    def __init__(self, held: int, maximum: int, *, pending: int = 0) -> None:
        super().__init__(f"{held} live claims held, the maximum is {maximum}")
        self.held = held
        self.maximum = maximum
        self.pending = pending


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used by the owner with another request (another digest)."""


class ClaimForgotten(Exception):
    """The Idempotency-Key made claim ``name``, which was deleted and is no longer remembered."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class ClaimNameTaken(Exception):
    """``ClaimRequest.claim_name`` names a claim that exists (or existed): choose another."""


class ClaimGone(Exception):
    """The claim was deleted since it was looked up (a data-plane route to it is no more)."""


class BackendUnavailable(Exception):
    """The backend cannot answer now (``detail`` says why and names no secret, e.g. "the
    Kubernetes API server did not answer"): the broker answers ``503 backend_unavailable``
    and the caller may retry."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ClaimInvalid(Exception):
    """The backend refused the claim as the request made it (``detail``: which field and why,
    e.g. the API server's validation): the broker answers ``400 invalid_request``."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Unroutable(Exception):
    """The data plane cannot reach the sandbox as asked (``detail`` says why, e.g. a port it
    does not serve)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Backend(Protocol):
    """Where the broker's sandboxes live (see the module docstring for the rules)."""

    async def templates(self) -> Sequence[str]:
        """The templates a v1 create may name (a template not among them is ``404``)."""
        ...

    async def resolve_warm_pool(self, pool: str) -> WarmPool:
        """The template of the warm pool an ``/rpc`` create names, or the failure of a claim
        on it (the claim is still made, Failed: ``ClaimRequest.failure``)."""
        ...

    async def replay(
        self, owner: Owner, idempotency: Idempotency, *, namespace: str | None = None
    ) -> ClaimState | None:
        """The claim an earlier create of ``owner`` with this key made (``None``: the key is
        new, or older than :data:`IDEMPOTENCY_SECONDS`); IdempotencyConflict for another
        digest; ClaimForgotten when that claim is gone and no longer known (a backend that
        keeps nothing of a deleted claim answers ``None``: the key is new again)."""
        ...

    async def create(self, request: ClaimRequest) -> Created:
        """Make the claim (Pending; its sandbox starts) or, with ``request.failure``, a Failed
        one (nothing starts); QuotaExceeded, ClaimNameTaken, ClaimInvalid. Atomic (see the
        module docstring); with ``request.idempotency`` a create that finds the key taken by a
        create that won a race answers that claim (``replayed``) or raises
        IdempotencyConflict."""
        ...

    async def get(
        self, name: str, *, namespace: str | None = None, cached: bool = False
    ) -> ClaimState | None:
        """The claim ``name`` (``ClaimState.name``) unless it is gone; its phase as known now
        (a dead runtime: Failed). ``cached``: a data-plane lookup, which may be answered from
        a cache that lags behind (an informer) when it shows the claim Ready; ``name`` may then
        also be the ``sandbox_name`` of an ``/rpc`` claim."""
        ...

    async def find_claim(
        self, claim_name: str, *, namespace: str | None = None
    ) -> ClaimState | None:
        """The claim whose ``claim_name`` is ``claim_name`` (an ``/rpc`` claim) unless it is
        gone, as :meth:`get`."""
        ...

    async def list_owned(self, owner: Owner, *, namespace: str | None = None) -> list[ClaimState]:
        """The owner's claims that are not gone, in any order (may lag: see the docstring)."""
        ...

    async def delete(
        self, name: str, *, namespace: str | None = None, uid: str | None = None
    ) -> ClaimState | None:
        """Begin deleting claim ``name``: it is Terminating (reason ``Deleted``) until its
        runtime is stopped, then gone; the state as Terminating, or ``None`` when it is gone
        already. The broker checked the owner before, on the claim whose ``uid`` it gives: a
        claim of that name with another uid (made since) is not that one, and is not deleted."""
        ...

    async def set_expiry(
        self, name: str, expires_at: float, *, namespace: str | None = None
    ) -> ClaimState | None:
        """Move claim ``name``'s expiry to ``expires_at`` (the broker checked the cap); the new
        state, or ``None`` when it is gone."""
        ...

    async def wait_ready(
        self, name: str, within: float, *, namespace: str | None = None
    ) -> ClaimState | None:
        """Wait until claim ``name`` is no longer Pending, at most ``within`` seconds (without
        polling where the backend can watch); its state then (``None``: gone and no longer
        known)."""
        ...

    def active_by_namespace(self) -> Mapping[str, int]:
        """How many live claims (Pending or Ready) each namespace holds now, all owners: the
        ``agent_sandbox_broker_active_sandboxes`` gauge, read at every metrics scrape. From
        what the backend holds in memory (the local records, the Kubernetes informer cache):
        never I/O, never blocking (may lag like :meth:`list_owned`)."""
        ...

    async def route(self, state: ClaimState, port: int) -> Route:
        """Where a data-plane request to the Ready sandbox of ``state`` on ``port`` goes;
        ClaimGone when it was deleted meanwhile, Unroutable when it cannot be reached so."""
        ...

    async def close(self) -> None:
        """Stop: what the broker owns locally ends (the local backend deletes its sandboxes and
        stops their runtimes; a cluster's claims stay)."""
        ...
