"""The broker's cache of its claims: a list, then a watch, of the claims it made, per namespace
(or in every namespace), kept on the broker's event loop.

Derived state only (rebuilt at every start and after every ``410 Gone``): the data plane's owner
checks read it instead of asking the API server on every request, and a wait for Ready waits for
its next event of that claim (:meth:`ClaimCache.changed`) instead of polling or holding one watch
per waiting request. A watch that ends (its timeout, a dropped connection, an API server
restart) is resumed from the last resourceVersion seen; one the server answers ``410`` is listed
again; failures are retried with a backoff and shown by :attr:`ClaimCache.problem` (readiness).

What it keeps of a claim is what the broker reads: the object without ``metadata.managedFields``
(the API server's field ownership, several KiB per claim that no decision reads), and its
:func:`._claims.state_of` parsed once per version of the claim (:meth:`ClaimCache.state`), not
once per data-plane request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final

from .._stamps import RPC_CLAIM
from ._api import KubeClient
from ._api_errors import KubeError, WatchExpired
from ._api_types import SANDBOX_CLAIMS
from ._claims import MANAGED_BY_SELECTOR, RESERVATION, KubeClaimState, state_of

__all__ = ["ClaimCache"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.kubernetes")

Key = tuple[str, str]
"""(namespace, name) of a claim."""

WATCH_SECONDS: Final = 300
"""A watch's timeoutSeconds: the server ends it then, and it is resumed."""
GONE_MEMORY: Final = 4096
"""How many claims gone the cache remembers (:meth:`ClaimCache.made`)."""
BACKOFF_FIRST: Final = 0.2
BACKOFF_MAX: Final = 5.0


class ClaimCache:
    """The claims the broker made (label ``app.kubernetes.io/managed-by``), in ``namespaces``
    (``None``: every namespace), by (namespace, name); ``start()`` begins, ``close()`` ends."""

    def __init__(
        self,
        client: KubeClient,
        namespaces: Sequence[str] | None,
        *,
        watch_seconds: int = WATCH_SECONDS,
    ) -> None:
        self._client = client
        self._scopes: tuple[str | None, ...] = (None,) if namespaces is None else tuple(namespaces)
        self._watch_seconds = watch_seconds
        self._objects: dict[Key, dict[str, Any]] = {}
        self._states: dict[Key, KubeClaimState] = {}  # state_of of the object held, memoized
        self._by_sandbox: dict[Key, str] = {}  # (namespace, Sandbox name) -> /rpc claim name
        self._gone: OrderedDict[Key, str | None] = OrderedDict()  # -> its reservation
        self._waiters: dict[Key, list[asyncio.Future[dict[str, Any] | None]]] = {}
        self._synced: set[str | None] = set()
        self._problems: dict[str | None, str] = {}
        self._resume_from: dict[str | None, str] = {}
        self._watches: dict[str | None, Any] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.relists = 0
        """Lists made (the first of each scope, and one after each ``410``)."""

    def __repr__(self) -> str:
        return f"ClaimCache(scopes={self._scopes!r}, claims={len(self._objects)})"

    # ---------------------------------------------------------------------- reading

    @property
    def synced(self) -> bool:
        """Every scope has been listed at least once."""
        return len(self._synced) == len(self._scopes)

    @property
    def problem(self) -> str | None:
        """Why the cache is not up to date now (a scope not listed yet, a watch failing)."""
        for scope in self._scopes:
            if scope in self._problems:
                return self._problems[scope]
            if scope not in self._synced:
                where = f"namespace {scope}" if scope else "every namespace"
                return f"the broker's claims in {where} are not listed yet"
        return None

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._objects.get((namespace, name))

    def state(self, obj: dict[str, Any]) -> KubeClaimState:
        """:func:`._claims.state_of` of ``obj``: of an object the cache holds, the state parsed
        when it was first asked for (the cache replaces the object at every change of the
        claim, which drops it), until the claim's expiry, past which it is parsed again as of
        now (Terminating); of any other object, parsed now."""
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        if self._objects.get(key) is not obj:
            return state_of(obj)
        now = time.time()
        state = self._states.get(key)
        if state is None or now >= state.expires_at:
            state = state_of(obj, now)
            if now < state.expires_at:
                self._states[key] = state
        return state

    def objects(self) -> list[dict[str, Any]]:
        """Every claim the cache holds."""
        return list(self._objects.values())

    def named(self, name: str) -> list[dict[str, Any]]:
        """The claims called ``name``, in any namespace."""
        return [obj for (_, n), obj in self._objects.items() if n == name]

    def by_sandbox(self, namespace: str, sandbox: str) -> dict[str, Any] | None:
        """The ``/rpc`` claim bound to the Sandbox ``sandbox`` (a warm-adopted one keeps its
        pool's name)."""
        claim = self._by_sandbox.get((namespace, sandbox))
        return None if claim is None else self._objects.get((namespace, claim))

    def made(self, namespace: str, name: str, reservation: str) -> bool:
        """The cache holds a claim made under that quota reservation (its ``reservation``
        annotation): the reservation became that claim (``._quota``)."""
        obj = self._objects.get((namespace, name))
        return obj is not None and _reservation(obj) == reservation

    def gone(self, namespace: str, name: str, reservation: str) -> bool:
        """The cache saw a claim made under that quota reservation go (deleted, or missing
        from a fresh list; the last :data:`GONE_MEMORY` claims gone) and holds none of that
        name since: that reservation's claim was made and is gone (``._quota``)."""
        key = (namespace, name)
        return key not in self._objects and self._gone.get(key) == reservation

    def changed(self, namespace: str, name: str) -> asyncio.Future[dict[str, Any] | None]:
        """A future resolved at the next change of the claim: its object, or ``None`` once it
        is gone. Cancel it when no longer waiting."""
        future: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault((namespace, name), []).append(future)
        future.add_done_callback(lambda f: self._forget_waiter((namespace, name), f))
        return future

    def _forget_waiter(self, key: Key, future: asyncio.Future[Any]) -> None:
        waiting = self._waiters.get(key)
        if waiting is not None:
            with contextlib.suppress(ValueError):
                waiting.remove(future)
            if not waiting:
                del self._waiters[key]

    # ---------------------------------------------------------------------- changes

    def _put(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        meta.pop("managedFields", None)  # the API server's field ownership: never read here
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        self._unindex(key)
        self._states.pop(key, None)
        self._objects[key] = obj
        self._gone.pop(key, None)
        sandbox = ((obj.get("status") or {}).get("sandbox") or {}).get("name")
        if sandbox and RPC_CLAIM in (meta.get("annotations") or {}):
            self._by_sandbox[(key[0], str(sandbox))] = key[1]
        self._notify(key, obj)

    def _remove(self, key: Key) -> None:
        self._unindex(key)
        self._states.pop(key, None)
        old = self._objects.pop(key, None)
        if old is not None:
            self._gone[key] = _reservation(old)
            while len(self._gone) > GONE_MEMORY:
                self._gone.popitem(last=False)
            self._notify(key, None)

    def _unindex(self, key: Key) -> None:
        old = self._objects.get(key)
        sandbox = ((old or {}).get("status") or {}).get("sandbox") or {}
        if sandbox.get("name") and self._by_sandbox.get((key[0], sandbox["name"])) == key[1]:
            del self._by_sandbox[(key[0], sandbox["name"])]

    def _notify(self, key: Key, obj: dict[str, Any] | None) -> None:
        for future in list(self._waiters.get(key, ())):
            if not future.done():
                future.set_result(obj)

    def _replace(self, scope: str | None, items: Sequence[dict[str, Any]]) -> None:
        """A fresh list of ``scope``: what it lacks is gone."""
        listed = {
            (str(o["metadata"].get("namespace", "")), str(o["metadata"].get("name", "")))
            for o in items
        }
        for key in [k for k in self._objects if (scope is None or k[0] == scope)]:
            if key not in listed:
                self._remove(key)
        for obj in items:
            self._put(obj)

    # ---------------------------------------------------------------------- running

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._run(scope)) for scope in self._scopes]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for waiting in list(self._waiters.values()):
            for future in waiting:
                future.cancel()

    def expire(self) -> None:
        """Make every watch resume from resourceVersion 1, which the API server answers
        ``410 Gone`` (as after a long disconnection): the cache lists again. For tests of the
        resumption; harmless otherwise."""
        for scope in self._scopes:
            self._resume_from[scope] = "1"
            watch = self._watches.get(scope)
            if watch is not None:
                asyncio.get_running_loop().create_task(watch.aclose())

    async def _run(self, scope: str | None) -> None:
        version: str | None = None
        delay = BACKOFF_FIRST
        while True:
            try:
                if version is None:
                    version = await self._list(scope)
                began = asyncio.get_running_loop().time()
                version = await self._watch(scope, self._resume_from.pop(scope, version))
                if asyncio.get_running_loop().time() - began > 1.0:
                    delay = BACKOFF_FIRST
                else:  # a watch that ends at once (a restarting server): not in a tight loop
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, BACKOFF_MAX)
            except WatchExpired:
                log.info("the claims' watch in %s expired (410): listing again", scope or "*")
                version = None
            except KubeError as exc:
                self._problems[scope] = f"the broker's claims cannot be watched: {exc}"
                log.warning("%s; again in %.1f s", self._problems[scope], delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)

    async def _list(self, scope: str | None) -> str:
        listing = await self._client.list_all(
            SANDBOX_CLAIMS, namespace=scope, label_selector=MANAGED_BY_SELECTOR
        )
        self.relists += 1
        self._replace(scope, listing.items)
        self._synced.add(scope)
        return listing.resource_version

    async def _watch(self, scope: str | None, version: str) -> str:
        """One watch from ``version``; the version to resume from when it ends."""
        watch = self._client.watch(
            SANDBOX_CLAIMS,
            namespace=scope,
            resource_version=version,
            label_selector=MANAGED_BY_SELECTOR,
            timeout_seconds=self._watch_seconds,
        )
        self._watches[scope] = watch
        try:
            async with watch as events:
                self._problems.pop(scope, None)
                async for kind, obj in events:
                    if kind in ("ADDED", "MODIFIED"):
                        self._put(obj)
                    elif kind == "DELETED":
                        meta = obj.get("metadata") or {}
                        self._remove((str(meta.get("namespace", "")), str(meta.get("name", ""))))
        finally:
            self._watches.pop(scope, None)
        return watch.resource_version or version


def _reservation(obj: dict[str, Any]) -> str | None:
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(RESERVATION)
    return value if isinstance(value, str) else None
