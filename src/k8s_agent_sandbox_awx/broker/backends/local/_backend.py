"""The local backend: the broker's claims in memory, each sandbox's runtime a host process.

:class:`LocalBackend` implements :class:`._interface.Backend` for one broker process (what
``LocalBroker``, ``agent-sandbox-awx dev`` and the tests run): a record per claim
(:class:`SandboxRecord`), an expiry timer per record, and a runtime per sandbox started by a
:class:`._launcher.RuntimeLauncher` (by default :class:`._processes.LocalProcessLauncher`). It is
atomic by construction: every method runs on the broker's event loop and changes its records
without an ``await`` in between. Deleted sandboxes' records are kept for a while (replays,
``LocalBroker.claims(include_deleted=True)``; see :meth:`LocalBackend.prune_deleted`).

NO ISOLATION: local runtimes and the commands they run are ordinary host processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import string
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ...._cookies import NoCookies
from ...runtime._env import runtime_settings
from .._http11 import Http11Pool
from .._interface import (
    ENV_ANNOTATION,
    FAILED,
    IDEMPOTENCY_SECONDS,
    PENDING,
    READY,
    RUNTIME_PORT,
    TERMINATING,
    ClaimForgotten,
    ClaimGone,
    ClaimNameTaken,
    ClaimRequest,
    ClaimState,
    Created,
    Idempotency,
    IdempotencyConflict,
    Owner,
    QuotaExceeded,
    Route,
    Unroutable,
    WarmPool,
    rfc3339,
)
from .._stamps import MANAGED_BY, MANAGED_BY_LABEL
from ._launcher import READY_METHOD, RuntimeHandle, RuntimeLauncher, RuntimeStartError, SandboxSpec

log = logging.getLogger("k8s_agent_sandbox_awx.broker")

DEFAULT_KEEP_DELETED = 1000
"""Deleted sandboxes whose records the backend keeps (the newest; see ``prune_deleted``)."""
DEFAULT_KEEP_DELETED_SECONDS = 3600.0
"""Seconds a deleted sandbox's record is kept at most (see ``prune_deleted``)."""
CLAIM_API_VERSION = "extensions.agents.x-k8s.io/v1beta1"
DATA_PLANE_TIMEOUT = 300.0
"""The read timeout of the router's connections (a request's X-Sandbox-Timeout overrides it)."""
_NAME_ALPHABET = string.ascii_lowercase + string.digits


@dataclass
class SandboxRecord:
    """One claim and what the local backend knows of it."""

    name: str
    namespace: str
    template: str
    owner: Owner
    labels: dict[str, str]
    annotations: dict[str, str]
    stamps: dict[str, str]
    env: dict[str, str]
    created_at: float
    expires_at: float
    scopes: frozenset[str]
    claim_name: str | None = None
    warm_pool: str | None = None
    pod_metadata: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    network: bool = True
    """The sandbox may use the network (its policy's ``network``)."""
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    phase: str = PENDING
    reason: str | None = None
    message: str | None = None
    transition_at: float = field(default_factory=time.time)
    handle: RuntimeHandle | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    executions: int = 0
    """Command-running requests forwarded to the runtime (``LocalBroker.execution_count``)."""
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    started_at: float | None = None
    deleted: bool = False
    deleted_at: float | None = None
    router_http: Http11Pool | None = None
    """The router's connections to this sandbox's runtime: closed with the sandbox, so that no
    keep-alive connection to an exited runtime is left behind (CLOSE_WAIT)."""
    ports_http: httpx.AsyncClient | None = None
    """The router's connections to the sandbox's other ports (port requests), closed with it."""
    ending: asyncio.Future[None] | None = None
    """The sandbox's one termination, once begun (``LocalBackend._terminate``)."""

    def set_phase(self, phase: str, reason: str | None = None, message: str | None = None) -> None:
        self.phase, self.reason, self.message = phase, reason, message
        self.transition_at = time.time()
        if phase != PENDING:
            self.settled.set()

    def count_execution(self, delta: int) -> None:
        self.executions += delta

    def state(self) -> ClaimState:
        return ClaimState(
            name=self.name,
            namespace=self.namespace,
            template=self.template,
            owner=self.owner,
            labels=self.labels,
            annotations=self.annotations,
            stamps=self.stamps,
            env=self.env,
            created_at=self.created_at,
            expires_at=self.expires_at,
            phase=self.phase,
            reason=self.reason,
            message=self.message,
            transition_at=self.transition_at,
            started_at=self.started_at,
            bound=self.handle is not None,
            scopes=self.scopes,
            uid=self.uid,
            claim_name=self.claim_name,
            warm_pool=self.warm_pool,
            pod_metadata=self.pod_metadata,
            deleted=self.deleted,
        )

    def manifest(self) -> dict[str, Any]:
        """The SandboxClaim this record stands for (``LocalBroker.claims``)."""
        ready = self.phase == READY
        metadata: dict[str, Any] = {
            "name": self.claim_name or self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "creationTimestamp": rfc3339(self.created_at),
            "labels": {**self.labels, MANAGED_BY_LABEL: MANAGED_BY},
            "annotations": {**self.annotations, **self.stamps, **_env_annotation(self.env)},
        }
        if self.deleted or self.phase == TERMINATING:
            metadata["deletionTimestamp"] = rfc3339(self.transition_at)
        spec: dict[str, Any] = {
            "warmPoolRef": {"name": self.warm_pool or self.template},
            "lifecycle": {"shutdownTime": rfc3339(self.expires_at), "shutdownPolicy": "Delete"},
        }
        if self.pod_metadata:
            spec["additionalPodMetadata"] = self.pod_metadata
        condition = {
            "type": "Ready",
            "status": "True" if ready else "False",
            "reason": self.reason or ("SandboxReady" if ready else self.phase),
            "message": self.message or "",
            "lastTransitionTime": rfc3339(self.transition_at),
        }
        return {
            "apiVersion": CLAIM_API_VERSION,
            "kind": "SandboxClaim",
            "metadata": metadata,
            "spec": spec,
            "status": {"sandbox": {"name": self.name}, "conditions": [condition]},
        }


def _env_annotation(env: Mapping[str, str]) -> dict[str, str]:
    """The claim annotation of a sandbox's environment, as the Kubernetes backend writes it."""
    return {ENV_ANNOTATION: json.dumps(dict(env), separators=(",", ":"))} if env else {}


class LocalBackend:
    """The claims of one local broker, in memory; runtimes started by ``runtimes``. Every
    claim is in one place: the methods' ``namespace`` is not needed (and ignored).

    ``templates``: template name -> runtime command line (``None``: the runtimes' default);
    ``warm_pools``: ``/rpc`` warm pool -> template. ``keep_deleted`` / ``keep_deleted_seconds``:
    the retention of deleted sandboxes' records (see :meth:`prune_deleted`). ``lock`` guards
    the records for readers on other threads (``LocalBroker``)."""

    def __init__(
        self,
        runtimes: RuntimeLauncher,
        *,
        templates: Mapping[str, str | Sequence[str] | None],
        warm_pools: Mapping[str, str],
        keep_deleted: int = DEFAULT_KEEP_DELETED,
        keep_deleted_seconds: float = DEFAULT_KEEP_DELETED_SECONDS,
    ) -> None:
        self.runtimes = runtimes
        self.commands = dict(templates)
        self.warm_pools = dict(warm_pools)
        self.keep_deleted = keep_deleted
        self.keep_deleted_seconds = keep_deleted_seconds
        self.lock = threading.Lock()
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.history: list[SandboxRecord] = []
        """Every live record and the deleted ones not pruned yet, oldest first."""
        self._deleted: deque[SandboxRecord] = deque()  # in the order they were deleted
        self.idempotency: dict[tuple[str, str, str], tuple[str, str, float]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._endings: set[asyncio.Future[None]] = set()  # the terminations under way

    # -- templates -----------------------------------------------------------------------------
    async def templates(self) -> Sequence[str]:
        return list(self.commands)

    async def resolve_warm_pool(self, pool: str) -> WarmPool:
        if pool not in self.warm_pools:
            known = sorted(self.warm_pools)
            return WarmPool(
                pool, ("WarmPoolNotFound", f"warm pool {pool!r} does not exist; known: {known}")
            )
        template = self.warm_pools[pool]
        if template not in self.commands:  # checked first, as under /v1
            return WarmPool(
                template,
                (
                    "TemplateNotFound",
                    f"warm pool {pool!r} refers to template {template!r}, which does not exist",
                ),
            )
        return WarmPool(template)

    # -- create --------------------------------------------------------------------------------
    async def replay(
        self, owner: Owner, idempotency: Idempotency, *, namespace: str | None = None
    ) -> ClaimState | None:
        remembered = self.idempotency.get((*owner.key, idempotency.key))
        if remembered is None or time.time() - remembered[2] >= IDEMPOTENCY_SECONDS:
            return None
        if remembered[0] != idempotency.digest:
            raise IdempotencyConflict(idempotency.key)
        with self.lock:
            record = self.sandboxes.get(remembered[1]) or next(
                (r for r in self.history if r.name == remembered[1]), None
            )
        if record is None:  # deleted, and its record pruned since (see prune_deleted)
            raise ClaimForgotten(remembered[1])
        return record.state()

    async def create(self, request: ClaimRequest) -> Created:
        """No await in here: concurrent creates cannot interleave."""
        with self.lock:
            record = self._admit(request)
        self.schedule_expiry(record)
        if request.failure is None:
            self._spawn(self._provision(record))
        if request.idempotency is not None:
            self._forget_old_keys()
            key = (*request.owner.key, request.idempotency.key)
            self.idempotency[key] = (request.idempotency.digest, record.name, record.created_at)
        return Created(record.state())

    def _admit(self, request: ClaimRequest) -> SandboxRecord:
        """The record of ``request`` after its checks (the caller holds the lock)."""
        if request.claim_name is not None and any(
            r.claim_name == request.claim_name for r in self.history
        ):
            raise ClaimNameTaken(request.claim_name)
        live = [
            r
            for r in self.sandboxes.values()
            if r.owner.key == request.owner.key and r.phase in (PENDING, READY)
        ]
        if len(live) >= request.max_live:
            raise QuotaExceeded(len(live), request.max_live)
        record = SandboxRecord(
            name=self._new_name(),
            namespace=request.namespace,
            template=request.template,
            owner=request.owner,
            labels=dict(request.labels),
            annotations=dict(request.annotations),
            stamps=dict(request.stamps),
            env=dict(request.env),
            created_at=request.created_at,
            expires_at=request.created_at + request.lifetime_seconds,
            scopes=request.scopes,
            claim_name=request.claim_name,
            warm_pool=request.warm_pool,
            pod_metadata=request.pod_metadata,
            network=request.network,
        )
        if request.failure is not None:
            record.set_phase(FAILED, *request.failure)
        self.sandboxes[record.name] = record
        self.history.append(record)
        self.prune_deleted()
        return record

    def _new_name(self) -> str:
        while True:
            name = "sbx-" + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(8))
            if name not in self.sandboxes:
                return name

    def _forget_old_keys(self) -> None:
        """Forget Idempotency-Keys older than :data:`IDEMPOTENCY_SECONDS` (at each keyed
        create, on the event loop: the only place that reads or writes them)."""
        now = time.time()
        stale = [k for k, v in self.idempotency.items() if now - v[2] >= IDEMPOTENCY_SECONDS]
        for key in stale:
            del self.idempotency[key]

    # -- the sandbox's life --------------------------------------------------------------------
    async def _provision(self, record: SandboxRecord) -> None:
        spec = SandboxSpec(
            name=record.name,
            namespace=record.namespace,
            template=record.template,
            env=runtime_settings(record.env),  # the rest: the commands' (X-Sandbox-Env)
            command=self.commands.get(record.template),
            network=record.network,
        )
        try:
            record.handle = await self.runtimes.start(spec)
            ready = getattr(self.runtimes, READY_METHOD, None)
            if ready is not None:  # bound, not Ready yet
                await ready(record.handle)
        except RuntimeStartError as exc:
            if record.phase == PENDING:
                record.set_phase(FAILED, exc.reason, exc.message)
            return
        except Exception as exc:  # a backend bug must still fail the sandbox visibly
            log.exception("backend failed to start %s", record.name)
            if record.phase == PENDING:
                record.set_phase(FAILED, "BackendError", f"{type(exc).__name__}: {exc}")
            return
        if record.phase != PENDING:  # deleted or expired while starting
            await self.runtimes.stop(record.handle)
            return
        record.started_at = time.time()
        record.set_phase(READY, "SandboxReady", "the sandbox runtime is ready")

    def schedule_expiry(self, record: SandboxRecord) -> None:
        """(Re)arm ``record``'s expiry timer for its ``expires_at``."""
        for timer in record.timers:
            timer.cancel()
        record.timers.clear()
        delay = max(0.0, record.expires_at - time.time())
        record.timers.append(
            asyncio.get_running_loop().call_later(
                delay, lambda: self._spawn(self._terminate(record, "Expired"))
            )
        )

    async def _terminate(self, record: SandboxRecord, reason: str) -> None:
        """End the sandbox: its runtime stopped, its record deleted. One termination per
        sandbox: a second caller (an expiry during a delete, ``delete_all`` during either)
        waits for the first one's end. Two at once each stopped the runtime: the second found
        the exit the first had already forgotten, sent SIGKILL to the group that had exited
        and waited 3 s for an exit report that never came."""
        if record.ending is None:
            record.ending = asyncio.ensure_future(self._end(record, reason))
            self._endings.add(record.ending)
            record.ending.add_done_callback(self._endings.discard)
        await asyncio.shield(record.ending)

    async def _end(self, record: SandboxRecord, reason: str) -> None:
        if record.deleted:
            return
        if record.phase != TERMINATING:
            record.set_phase(TERMINATING, reason, f"the sandbox is being deleted ({reason})")
        for timer in record.timers:
            timer.cancel()
        handle = record.handle
        if handle is not None:
            try:
                await self.runtimes.stop(handle)
            except Exception:
                log.exception("backend failed to stop %s", record.name)
        with self.lock:
            self.sandboxes.pop(record.name, None)
            record.deleted = True
            record.deleted_at = time.time()
            record.timers.clear()
            self._deleted.append(record)
            self.prune_deleted()
        if record.router_http is not None:
            await record.router_http.aclose()
        if record.ports_http is not None:
            await record.ports_http.aclose()

    def _check_alive(self, record: SandboxRecord) -> None:
        """A Ready sandbox whose runtime exited is Failed (``RuntimeExited``)."""
        handle = record.handle
        if record.phase == READY and handle is not None and not self.runtimes.is_alive(handle):
            record.set_phase(FAILED, "RuntimeExited", "the sandbox runtime process exited")
            if record.router_http is not None:  # its connections lead nowhere now
                self._spawn(record.router_http.aclose())

    def prune_deleted(self) -> None:
        """Forget deleted sandboxes past the retention: beyond the newest ``keep_deleted``, or
        deleted more than ``keep_deleted_seconds`` ago (live records are kept). The caller
        holds ``self.lock``; it runs at every create and delete and before ``LocalBroker``
        reads the records."""
        now = time.time()
        pruned: set[int] = set()
        while self._deleted and (
            len(self._deleted) > self.keep_deleted
            or now - (self._deleted[0].deleted_at or now) >= self.keep_deleted_seconds
        ):
            pruned.add(id(self._deleted.popleft()))
        if pruned:
            self.history = [r for r in self.history if id(r) not in pruned]

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- lookups and changes -------------------------------------------------------------------
    def _live(self, name: str) -> SandboxRecord | None:
        with self.lock:
            return self.sandboxes.get(name)

    async def get(
        self, name: str, *, namespace: str | None = None, cached: bool = False
    ) -> ClaimState | None:
        record = self._live(name)
        if record is None:
            return None
        self._check_alive(record)
        return record.state()

    async def find_claim(
        self, claim_name: str, *, namespace: str | None = None
    ) -> ClaimState | None:
        with self.lock:
            record = next((r for r in self.sandboxes.values() if r.claim_name == claim_name), None)
        if record is None:
            return None
        self._check_alive(record)
        return record.state()

    async def list_owned(self, owner: Owner, *, namespace: str | None = None) -> list[ClaimState]:
        with self.lock:
            mine = [r for r in self.sandboxes.values() if r.owner.key == owner.key]
        return [r.state() for r in mine]

    async def delete(
        self, name: str, *, namespace: str | None = None, uid: str | None = None
    ) -> ClaimState | None:
        record = self._live(name)
        if record is None or (uid is not None and record.state().uid != uid):
            return None
        if record.phase != TERMINATING:
            record.set_phase(TERMINATING, "Deleted", "the sandbox is being deleted")
            self._spawn(self._terminate(record, "Deleted"))
        return record.state()

    async def set_expiry(
        self, name: str, expires_at: float, *, namespace: str | None = None
    ) -> ClaimState | None:
        record = self._live(name)
        if record is None:
            return None
        record.expires_at = expires_at
        self.schedule_expiry(record)
        return record.state()

    async def wait_ready(
        self, name: str, within: float, *, namespace: str | None = None
    ) -> ClaimState | None:
        record = self._live(name)
        if record is None:
            return None
        if record.phase == PENDING and within > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.settled.wait(), within)
        self._check_alive(record)
        return record.state()  # deleted meanwhile: shown Terminating

    def active_by_namespace(self) -> Mapping[str, int]:
        with self.lock:
            live = [r.namespace for r in self.sandboxes.values() if r.phase in (PENDING, READY)]
        return dict(Counter(live))

    # -- the data plane ------------------------------------------------------------------------
    async def route(self, state: ClaimState, port: int) -> Route:
        record = self._live(state.name)
        if record is None or record.deleted or record.handle is None:
            raise ClaimGone(state.name)
        if port != RUNTIME_PORT:
            return self._port_route(record, port)
        handle = record.handle
        client = self._router_client(record)
        return Route(handle.host, handle.port, client, count_command=record.count_execution)

    def _port_route(self, record: SandboxRecord, port: int) -> Route:
        """A port request's route: a local sandbox shares the host's network, so its port
        ``port`` is ``127.0.0.1:port`` (never another sandbox's runtime: Unroutable)."""
        if not record.network:  # isolated, with a network of its own
            raise Unroutable(
                f"sandbox {record.name!r} has a network of its own (its policy's network is "
                f"off), which the broker cannot reach: port {port} is not reachable through "
                "the broker; use a policy with network on to reach its ports"
            )
        with self.lock:
            runtimes = {r.handle.port for r in self.sandboxes.values() if r.handle is not None}
        if port in runtimes:
            raise Unroutable(
                f"port {port} is a sandbox runtime's on this host, not a port of sandbox "
                f"{record.name!r}; its own servers use other ports"
            )
        if record.ports_http is None:
            record.ports_http = httpx.AsyncClient(
                follow_redirects=False,
                trust_env=False,
                timeout=httpx.Timeout(connect=5.0, read=DATA_PLANE_TIMEOUT, write=300.0, pool=10.0),
                # a connection per request: a user's server is not ours to keep connections
                # to (restarted, it would fail the next request), and one that answers in
                # several writes without TCP_NODELAY (python -m http.server) stalls 40 ms per
                # request on a kept-alive connection (Nagle against delayed ACKs)
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
                cookies=NoCookies(),
            )
        return Route("127.0.0.1", port, record.ports_http)

    def _router_client(self, record: SandboxRecord) -> Http11Pool:
        """The router's connections to ``record``'s runtime (one pool per sandbox, see
        ``router_http``): plain HTTP, over TCP or, for an isolated sandbox, the runtime's Unix
        socket (docs/local-broker.md); stateless, like upstream's router (no cookies)."""
        if record.router_http is None:
            handle = record.handle
            assert handle is not None  # a Ready sandbox's (route checked it)
            record.router_http = Http11Pool(
                handle.host, handle.port, uds=handle.uds, keep=20, idle_seconds=5.0
            )
        return record.router_http

    # -- the end -------------------------------------------------------------------------------
    async def delete_all(self) -> None:
        """Delete every sandbox now (all owners) and wait until their runtimes are gone."""
        with self.lock:
            records = list(self.sandboxes.values())
        await asyncio.gather(*(self._terminate(r, "Deleted") for r in records))

    async def close(self) -> None:
        await self.delete_all()
        await asyncio.gather(*self._endings, return_exceptions=True)  # ones begun before
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.runtimes.close()
