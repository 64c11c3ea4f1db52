"""The Kubernetes backend: the broker's sandboxes as SandboxClaims in the API server.

:class:`KubernetesBackend` implements :class:`.._interface.Backend` over one
:class:`._api.KubeClient` (the broker's own identity). Stateless: every fact is in a claim
(:mod:`._claims`), so any replica answers for any claim; what a replica keeps in memory is
derived (the claim cache, :mod:`._informer`) and rebuilt at start. The rules
(docs/broker/kubernetes.md):

- **create**: the claim's name is reserved in the owner's quota ledger first (:mod:`._quota`:
  a Lease written with a resourceVersion precondition, the one serialization point of all
  replicas; ``QuotaExceeded`` when the owner holds the maximum), then the claim is POSTed
  (answered within the reservation's time; a refused POST releases the reservation). A keyed
  create's name is derived from the caller and the key: ``AlreadyExists`` from another
  replica's (or a killed replica's) create is read and replayed when owner and request digest
  match (so the look-up of a key before the create, :meth:`KubernetesBackend.replay`, asks the
  API server only when the claim cache knows that name: a new key's create is the ledger's
  write and the POST, plus a GET of the ledger when this replica's copy is not current, and
  the LIST of the owner's claims only when the ledger is full or missing);
- **ready**: a wait follows the claim cache's events for that claim (its watch resumes after
  a ``410`` or an API server restart without losing the wait), never polls;
- **extend**: a merge patch of ``spec.lifecycle.shutdownTime`` with a resourceVersion
  precondition, again on a conflict; **delete**: with a uid precondition, "already gone" is gone;
- **data plane**: :mod:`._routes`; owner checks from the cache, a GET when it misses.

At start (:meth:`KubernetesBackend.start`) the broker's RBAC is checked with access reviews
and the cache is filled; until both succeed :meth:`KubernetesBackend.readiness` names why not.
With the router data plane the router is asked too (:mod:`._router_probe`): not ready until
it answered once, :meth:`KubernetesBackend.degraded` while it does not answer after that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .._interface import (
    PENDING,
    READY,
    TERMINATING,
    BackendUnavailable,
    ClaimInvalid,
    ClaimNameTaken,
    ClaimRequest,
    ClaimState,
    Created,
    Idempotency,
    IdempotencyConflict,
    Owner,
    Route,
    WarmPool,
    rfc3339,
)
from ._api import KubeClient
from ._api_errors import (
    AlreadyExists,
    Conflict,
    Invalid,
    KubeError,
    MissingPermissions,
    NotFound,
    Unavailable,
)
from ._api_types import LEASES, SANDBOX_CLAIMS, TOKEN_REVIEWS, Access
from ._claims import (
    OWNER_LABEL,
    KubeClaimState,
    claim_object,
    keyed_name,
    owner_hash,
    random_name,
    state_of,
)
from ._informer import ClaimCache
from ._pod_metadata import DEFAULT_LABEL_DOMAINS, check_pod_metadata
from ._quota import LEASE_VERBS, ClaimListed, QuotaLedger, Reservation
from ._router_probe import RouterProbe
from ._routes import Routes, RouteSettings

__all__ = ["CLAIM_VERBS", "KubernetesBackend", "KubernetesSettings", "needed_access"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.kubernetes")

CLAIM_VERBS: Final = ("get", "list", "watch", "create", "delete", "patch")
"""What the broker does with SandboxClaims (docs/broker/kubernetes.md, "RBAC"); with Leases:
:data:`._quota.LEASE_VERBS` (the quota ledgers)."""
EXTEND_ATTEMPTS: Final = 5
NAME_ATTEMPTS: Final = 5
PRUNE_SECONDS: Final = 30.0
"""How often (at most, at a data-plane request) the pods' pools no claim leads to are closed."""


@dataclass(frozen=True)
class KubernetesSettings:
    """The backend's settings (``[backend.kubernetes]`` and what the policies imply)."""

    namespaces: tuple[str, ...] | None
    """Where the policies put claims (``None``: a policy puts them in the caller's own, so
    every namespace)."""
    templates: tuple[str, ...]
    """The warm pools the policies allow (the v1 ``template``s)."""
    routes: RouteSettings = dataclasses.field(default_factory=RouteSettings)
    ready_timeout_seconds: float = 180.0
    """The longest one wait for Ready holds a request."""
    tokenreview: bool = False
    """An issuer verifies by TokenReview: the broker also needs ``create tokenreviews``."""
    identity: str = "the broker's ServiceAccount"
    """Who the broker is in messages about its RBAC."""
    pod_label_domains: tuple[str, ...] = DEFAULT_LABEL_DOMAINS
    """The controller's allowed pod label domains (a create's pod labels are checked against
    them before the claim is made: ``_pod_metadata``)."""


def needed_access(settings: KubernetesSettings) -> list[Access]:
    """The permissions the broker needs (each checked at start)."""
    scopes: Sequence[str | None] = settings.namespaces or (None,)
    needed = [Access(v, SANDBOX_CLAIMS, namespace=ns) for ns in scopes for v in CLAIM_VERBS]
    needed += [Access(v, LEASES, namespace=ns) for ns in scopes for v in LEASE_VERBS]
    if settings.tokenreview:
        needed.append(Access("create", TOKEN_REVIEWS))
    return needed


def _unavailable(what: str, exc: KubeError) -> BackendUnavailable:
    return BackendUnavailable(f"the Kubernetes API server did not {what}: {exc}")


class KubernetesBackend:
    """Claims in the API server ``client`` reaches (see the module docstring). The backend
    owns ``client`` and closes it."""

    def __init__(self, client: KubeClient, settings: KubernetesSettings) -> None:
        self.client = client
        self.settings = settings
        self.cache = ClaimCache(client, settings.namespaces)
        self.quota = QuotaLedger(client, self._liveness, self.cache)
        self.routes = Routes(settings.routes)
        self.router = (
            RouterProbe(settings.routes, self.routes.http)
            if settings.routes.data_plane == "router"
            else None
        )
        self._problem: str | None = "the broker's RBAC has not been checked yet"
        self._starting: asyncio.Task[None] | None = None
        self._prune_at = time.monotonic() + PRUNE_SECONDS

    def __repr__(self) -> str:
        return f"KubernetesBackend({self.client!r}, namespaces={self.settings.namespaces!r})"

    # ---------------------------------------------------------------------- start, readiness

    def start(self) -> None:
        """Begin: check the RBAC (again until it passes), then fill the claim cache."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        if self.router is not None:
            self.router.start()

    async def _start(self) -> None:
        delay = 0.5
        needed = needed_access(self.settings)
        fix = "add the verbs to its Role (deploy/broker/rbac.yaml) and bind it there"
        while True:
            try:
                await self.client.require_access(needed, who=self.settings.identity, fix=fix)
                break
            except MissingPermissions as exc:
                problem = str(exc)
            except KubeError as exc:
                problem = f"the Kubernetes API server did not answer the access check: {exc}"
            if problem != self._problem:
                log.error("not ready: %s", problem)
            self._problem = problem
            await asyncio.sleep(delay)
            delay = min(delay * 2, 15.0)
        self._problem = None
        log.info("the broker's RBAC allows all it needs; listing its claims")
        self.cache.start()

    def readiness(self) -> dict[str, str]:
        """What is not ready (``{}``: the API server answered, the RBAC holds, the claims
        are listed and watched)."""
        problem = self._problem or self.cache.problem
        not_ready = {"kubernetes": problem} if problem else {}
        router = self.router
        if router is not None and not router.answered_once and router.problem:
            not_ready["router"] = router.problem
        return not_ready

    def degraded(self) -> dict[str, str]:
        """What does not serve now without making the replica unready: the router, after it
        answered once (every replica sees it: :mod:`._router_probe`)."""
        router = self.router
        if router is not None and router.answered_once and router.problem:
            return {"router": router.problem}
        return {}

    def upstream_ready(self) -> dict[str, bool]:
        """By upstream (``kubernetes``, ``router``): whether it serves now (the metrics)."""
        ready = {"kubernetes": not (self._problem or self.cache.problem)}
        if self.router is not None:
            ready["router"] = self.router.problem is None
        return ready

    async def close(self) -> None:
        """Stop watching and close the connections; the claims stay in the cluster."""
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        await self.cache.close()
        if self.router is not None:
            await self.router.close()
        await self.routes.close()
        await self.client.aclose()

    # ---------------------------------------------------------------------- templates

    async def templates(self) -> Sequence[str]:
        return list(self.settings.templates)

    async def resolve_warm_pool(self, pool: str) -> WarmPool:
        """A pool's template is the pool (v1 names pools as templates); whether it exists is
        the controller's to say (``WarmPoolNotFound`` on the claim)."""
        return WarmPool(pool)

    # ---------------------------------------------------------------------- reading

    def _where(self, name: str, namespace: str | None) -> str | None:
        """The namespace to look for claim ``name`` in."""
        if namespace is not None:
            return namespace
        found = self.cache.named(name)
        if len(found) == 1:
            return str(found[0]["metadata"]["namespace"])
        scopes = self.settings.namespaces
        return scopes[0] if scopes is not None and len(scopes) == 1 else None

    async def _read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The claim as the API server has it now (``None``: there is none)."""
        try:
            return await self.client.get(SANDBOX_CLAIMS, name, namespace=namespace)
        except NotFound:
            return None
        except KubeError as exc:
            raise _unavailable(f"answer a read of claim {namespace}/{name}", exc) from None

    async def _fresh(self, name: str, namespace: str | None) -> KubeClaimState | None:
        where = self._where(name, namespace)
        obj = None if where is None else await self._read(where, name)
        return None if obj is None else state_of(obj)

    async def get(
        self, name: str, *, namespace: str | None = None, cached: bool = False
    ) -> ClaimState | None:
        if cached:
            state = self._cached(name, namespace)
            if state is not None:
                return state
        return await self._fresh(name, namespace)

    def _cached(self, name: str, namespace: str | None) -> KubeClaimState | None:
        """A Ready claim from the cache (by its name, or an /rpc claim by its Sandbox's);
        anything else is read fresh."""
        where = self._where(name, namespace)
        if where is None:
            return None
        obj = self.cache.get(where, name) or self.cache.by_sandbox(where, name)
        state = None if obj is None else self.cache.state(obj)  # parsed once per version
        return state if state is not None and state.phase == READY and state.bound else None

    async def find_claim(
        self, claim_name: str, *, namespace: str | None = None
    ) -> ClaimState | None:
        state = await self._fresh(claim_name, namespace)
        return state if state is not None and state.claim_name is not None else None

    async def list_owned(self, owner: Owner, *, namespace: str | None = None) -> list[ClaimState]:
        if namespace is None:  # no policy namespace: what the cache holds
            objects = [o for o in self.cache.objects() if _owned_by(o, owner)]
        else:
            objects = await self._owned_objects(owner, namespace)
        return [state_of(o) for o in objects]

    async def _owned_objects(self, owner: Owner, namespace: str) -> list[dict[str, Any]]:
        """The owner's claims in ``namespace``, listed now (a consistent read)."""
        try:
            listing = await self.client.list_all(
                SANDBOX_CLAIMS,
                namespace=namespace,
                label_selector=f"{OWNER_LABEL}={owner_hash(owner)}",
            )
        except KubeError as exc:
            raise _unavailable(f"list the caller's claims in {namespace}", exc) from None
        return [o for o in listing.items if _owned_by(o, owner)]

    # ---------------------------------------------------------------------- create

    async def replay(
        self, owner: Owner, idempotency: Idempotency, *, namespace: str | None = None
    ) -> ClaimState | None:
        """The claim named after the owner and the key, if it exists (a deleted claim leaves
        nothing behind: its key is new again).

        Read fresh only when the claim cache has a claim of that name: a new key (every SDK
        create) then costs no API round trip before its POST. A claim the cache has not seen
        yet (another replica's, made an instant ago) is not lost: the keyed create's POST is
        answered ``AlreadyExists`` and replays it (:meth:`_create_keyed`)."""
        name = keyed_name(owner, idempotency.key)
        where = self._where(name, namespace)
        if where is None or self.cache.get(where, name) is None:
            return None
        state = await self._fresh(name, where)
        if state is None:
            return None
        return _replayed(state, owner, idempotency)

    async def create(self, request: ClaimRequest) -> Created:
        check_pod_metadata(request.pod_metadata, self.settings.pod_label_domains)
        if request.idempotency is not None:
            name = keyed_name(request.owner, request.idempotency.key)
            return await self._create_keyed(request, name, request.idempotency)
        if request.claim_name is not None:
            return Created(await self._create_named(request, request.claim_name))
        return Created(await self._create_random(request))

    async def _made(self, request: ClaimRequest, name: str) -> KubeClaimState:
        """Reserve ``name`` in the owner's quota ledger (QuotaExceeded), then POST the claim.
        A POST the API server refused releases the reservation (but ``AlreadyExists`` of a
        keyed name: that claim is the key's); one whose outcome is unknown (``Unavailable``,
        a cancelled request) keeps it: it lapses, or is found made."""
        reservation = await self.quota.reserve(
            request.owner, request.namespace, name, request.max_live
        )
        try:
            return await self._post(request, name, reservation)
        except Unavailable:
            raise
        except AlreadyExists:
            if request.idempotency is None:
                await self.quota.release(reservation)
            raise
        except (ClaimInvalid, KubeError):
            await self.quota.release(reservation)
            raise

    async def _post(
        self, request: ClaimRequest, name: str, reservation: Reservation
    ) -> KubeClaimState:
        """POST the claim, answered within its reservation's time (``AlreadyExists`` and
        ``Unavailable`` to the caller; no answer in time is ``Unavailable``)."""
        obj = claim_object(request, name, reservation.until)
        seconds = reservation.post_timeout()
        post = self.client.create(
            SANDBOX_CLAIMS, obj, namespace=request.namespace, server_timeout=seconds
        )
        try:
            created = await asyncio.wait_for(post, seconds)
        except TimeoutError:
            raise Unavailable(
                f"create claim {request.namespace}/{name}: no answer within {seconds:.0f} s",
                verb="create",
                resource=str(SANDBOX_CLAIMS),
                namespace=request.namespace,
                name=name,
            ) from None
        except Invalid as exc:
            raise ClaimInvalid(f"the API server refused the claim: {exc.message or exc}") from None
        return state_of(created)

    async def _create_keyed(
        self, request: ClaimRequest, name: str, idempotency: Idempotency
    ) -> Created:
        """The keyed claim, made now or (made before by any replica) replayed, also when the
        owner is full (ClaimListed: that claim takes no new slot)."""
        full: ClaimListed | None = None
        try:
            return Created(await self._made(request, name))
        except ClaimListed as exc:
            full = exc
        except AlreadyExists:
            pass
        except Unavailable as exc:  # it may have been made: its name tells
            log.warning(
                "create of claim %s/%s unanswered (%s); reading it", request.namespace, name, exc
            )
        except KubeError as exc:
            raise _unavailable(f"create claim {request.namespace}/{name}", exc) from None
        found = await self._read(request.namespace, name)
        if found is None and full is not None:
            raise full  # gone since it was listed: the owner is full
        if found is None:
            raise BackendUnavailable(
                f"the Kubernetes API server did not create claim {request.namespace}/{name}; "
                "retry the create with the same Idempotency-Key"
            )
        return Created(_replayed(state_of(found), request.owner, idempotency), replayed=True)

    async def _create_named(self, request: ClaimRequest, name: str) -> KubeClaimState:
        try:
            return await self._made(request, name)
        except AlreadyExists:
            raise ClaimNameTaken(name) from None
        except KubeError as exc:
            raise _unavailable(f"create claim {request.namespace}/{name}", exc) from None

    async def _create_random(self, request: ClaimRequest) -> KubeClaimState:
        for _ in range(NAME_ATTEMPTS):
            name = random_name()
            try:
                return await self._made(request, name)
            except AlreadyExists:
                continue
            except KubeError as exc:
                raise _unavailable(f"create claim {request.namespace}/{name}", exc) from None
        raise BackendUnavailable(f"{NAME_ATTEMPTS} random claim names were all taken")

    async def _liveness(self, owner: Owner, namespace: str) -> dict[str, bool]:
        """The owner's claims in ``namespace``, listed now: whether each is live (the quota
        ledger's reconcile)."""
        return {s.name: s.live for s in map(state_of, await self._owned_objects(owner, namespace))}

    # ---------------------------------------------------------------------- changes

    async def delete(
        self, name: str, *, namespace: str | None = None, uid: str | None = None
    ) -> ClaimState | None:
        state = await self._fresh(name, namespace)
        if state is None or (uid is not None and state.uid != uid):
            return None  # gone, or another claim of that name: not the one the broker checked
        try:
            answer = await self.client.delete(
                SANDBOX_CLAIMS, name, namespace=state.namespace, uid=state.uid
            )
        except (NotFound, Conflict):  # gone (a Conflict: the uid is another claim's now)
            return None
        except KubeError as exc:
            raise _unavailable(f"delete claim {state.namespace}/{name}", exc) from None
        if answer.get("kind") == "SandboxClaim":  # held by finalizers: Terminating
            return state_of(answer)
        return dataclasses.replace(
            state, phase=TERMINATING, reason="Deleted", message="the sandbox is being deleted"
        )

    async def set_expiry(
        self, name: str, expires_at: float, *, namespace: str | None = None
    ) -> ClaimState | None:
        patch = {"spec": {"lifecycle": {"shutdownTime": rfc3339(expires_at)}}}
        for _ in range(EXTEND_ATTEMPTS):
            state = await self._fresh(name, namespace)
            if state is None or state.ending:
                return None
            try:
                patched = await self.client.merge_patch(
                    SANDBOX_CLAIMS,
                    name,
                    patch,
                    namespace=state.namespace,
                    resource_version=state.resource_version,
                )
            except Conflict:
                continue  # changed since it was read (the controller's status): again
            except NotFound:
                return None
            except KubeError as exc:
                raise _unavailable(f"patch claim {state.namespace}/{name}", exc) from None
            return state_of(patched)
        raise BackendUnavailable(
            f"claim {name}'s lifetime could not be changed: it changed {EXTEND_ATTEMPTS} times "
            "while it was patched; retry"
        )

    # ---------------------------------------------------------------------- ready

    async def wait_ready(
        self, name: str, within: float, *, namespace: str | None = None
    ) -> ClaimState | None:
        """Until the claim is no longer Pending: the cache's events of it (no polling, one
        watch for all waits); the API server is asked once, if the cache has not seen it."""
        where = self._where(name, namespace)
        if where is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(within, self.settings.ready_timeout_seconds))
        state: KubeClaimState | None = None
        while True:
            change = self.cache.changed(where, name)
            obj = self.cache.get(where, name)
            if obj is None and state is None:
                obj = await self._read(where, name)
                if obj is None:
                    change.cancel()
                    return None
            state = state_of(obj) if obj is not None else state
            assert state is not None
            if state.phase != PENDING or loop.time() >= deadline:
                change.cancel()
                return state
            try:
                if await asyncio.wait_for(change, deadline - loop.time()) is None:
                    return None  # deleted meanwhile
            except TimeoutError:
                latest = self.cache.get(where, name)
                return state_of(latest) if latest is not None else state

    def active_by_namespace(self) -> Mapping[str, int]:
        """Live claims per namespace, from the claim cache (no I/O; lags like the cache)."""
        live = (s.namespace for s in map(self.cache.state, self.cache.objects()) if s.live)
        return dict(Counter(live))

    # ---------------------------------------------------------------------- data plane

    async def route(self, state: ClaimState, port: int) -> Route:
        if not isinstance(state, KubeClaimState):
            raise TypeError(f"not a claim of this backend: {state!r}")
        if time.monotonic() >= self._prune_at:  # the pools of deleted sandboxes' pods
            self._prune_at = time.monotonic() + PRUNE_SECONDS
            self.routes.prune(s.pod_ips for s in map(self.cache.state, self.cache.objects()))
        return self.routes.route(state, port)


def _owned_by(obj: dict[str, Any], owner: Owner) -> bool:
    """The claim's stamps name ``owner`` (the label is a hash: its stamps decide)."""
    state = state_of(obj)
    return state.owner.key == owner.key


def _replayed(state: ClaimState, owner: Owner, idempotency: Idempotency) -> ClaimState:
    """``state``, the claim an earlier create with ``idempotency``'s key made, if it is the
    same create (its owner and request digest); else IdempotencyConflict."""
    digest = state.request_digest if isinstance(state, KubeClaimState) else None
    if state.owner.key != owner.key or digest != idempotency.digest:
        raise IdempotencyConflict(idempotency.key)
    return state
