"""The one process-wide cache of non-file credentials, shared by the sync and the async path.

Keyed by ``(source key, audience)``: the source key is a provider name for the discovery chain
(plus an instance key when it reads a custom environment), or an instance key for each explicit
:class:`~k8s_agent_sandbox_awx.OIDCTokenAuth`, so explicit sources never collide.

An entry lives until the deadline computed by :func:`._jwt.cache_deadline` (``exp`` minus a
margin, never past ``exp``). File-backed credentials are never stored.

Single flight: under the cache's one short-held lock, a miss checks the cache again, then starts
or joins the key's *flight*: a :class:`concurrent.futures.Future` (see ``_bridge``). The caller
that starts it (sync or async) is the leader and fetches; every other caller of that key waits
for that future (a thread with ``result()``, a task of any event loop with
``asyncio.wrap_future``: no thread is parked for a task). So any mix of threads and tasks causes
one fetch per key and expiry. The leader stores its result and ends the flight under the lock,
then resolves the future: a credential, a :class:`CredentialError` (its waiters raise it too), or
``None`` when it was cancelled or interrupted (its waiters retry, and one of them leads). A thread
never waits for a flight led by an asyncio task of its own thread (that would deadlock the loop
that must finish it): it fetches by itself instead.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import Future
from types import TracebackType
from typing import NamedTuple

from cachetools import TLRUCache

from ._bridge import aresult, result, running
from ._credential import Credential
from ._credential_errors import CredentialError
from ._jwt import clear_claims_cache

__all__ = [
    "aget_or_fetch",
    "clear_credential_cache",
    "get_cached",
    "get_or_fetch",
    "invalidate",
    "new_instance_key",
    "now",
    "put",
]

CacheKey = tuple[Hashable, str]
Fetched = tuple[Credential, float]

MAX_ENTRIES = 256

_clock: Callable[[], float] = time.time
"""Wall clock used for deadlines and expiry checks (tests replace it)."""


def now() -> float:
    """The current wall-clock time in seconds (the clock token ``exp`` claims are compared to)."""
    return _clock()


class _Entry(NamedTuple):
    credential: Credential
    deadline: float


class _Flight(NamedTuple):
    """One fetch in progress: its outcome (``None``: given up, retry) and who leads it."""

    future: Future[Credential | None]
    thread: int
    is_async: bool


_cache: TLRUCache[CacheKey, _Entry] = TLRUCache(
    maxsize=MAX_ENTRIES, ttu=lambda _key, entry, _now: entry.deadline, timer=now
)
_lock = threading.Lock()
_flights: dict[CacheKey, _Flight] = {}
_instance_keys = itertools.count(1)


def new_instance_key(kind: str) -> tuple[str, int]:
    """A key no other source will ever use (for one explicit source object)."""
    return (kind, next(_instance_keys))


def get_cached(key: CacheKey) -> Credential | None:
    """The cached credential for ``key`` if present and before its deadline."""
    with _lock:
        entry = _cache.get(key)
    return None if entry is None else entry.credential


def _store_locked(key: CacheKey, credential: Credential, deadline: float) -> None:
    if credential.file_backed:
        return
    if deadline > now():
        _cache[key] = _Entry(credential, deadline)
    else:
        _cache.pop(key, None)


def put(key: CacheKey, credential: Credential, deadline: float) -> None:
    """Store an already fetched non-file credential (used during discovery)."""
    with _lock:
        _store_locked(key, credential, deadline)


def _join(key: CacheKey, is_async: bool) -> tuple[Credential | None, _Flight | None]:
    """The cached credential, else the key's flight; ``(None, None)``: this caller leads a new
    flight (registered, found by the others). A sync flight of this very thread is abandoned
    (see :func:`_abandoned`): it is ended, and this caller leads a new one."""
    stale = None
    try:
        with _lock:
            entry = _cache.get(key)
            if entry is not None:
                return entry.credential, None
            flight = _flights.get(key)
            if flight is not None and not _abandoned(flight):
                return None, flight
            stale = flight
            _flights[key] = _Flight(running(), threading.get_ident(), is_async)
            return None, None
    finally:
        if stale is not None:
            stale.future.set_result(None)  # its waiters (other threads) retry


def _abandoned(flight: _Flight) -> bool:
    """Whether ``flight`` can never end: a sync flight led by the calling thread, which is here
    instead of inside its fetch. A ``KeyboardInterrupt`` (Ctrl-C) lands between any two
    bytecodes, so it can leave the leader's flight registered without a ``finally`` to end it
    (after the flight was registered, before the leader's ``with`` took over); the next request
    of that thread (the cleanup after Ctrl-C: a rollback, a kill) would wait for it forever."""
    return not flight.is_async and flight.thread == threading.get_ident()


class _Lead:
    """The leader's side of a flight: ``with _Lead(key, store) as lead: return lead.land(...)``.

    Ends the flight however the block ends: stores and hands over the landed credential, hands
    over a credential error, or lets the waiters retry after any other exception (cancellation,
    interrupt). ``alone``: a thread fetching by itself (see the module docstring): it stores its
    result, but the flight is not its own to end.
    """

    def __init__(self, key: CacheKey, store: bool, *, alone: bool = False) -> None:
        self.key, self.store, self.alone = key, store, alone
        self.landed: Fetched | None = None

    def __enter__(self) -> _Lead:
        return self

    def land(self, credential: Credential, deadline: float) -> Credential:
        self.landed = (credential, deadline)
        return credential

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        landed = self.landed if exc is None else None
        with _lock:
            if landed is not None and self.store:
                _store_locked(self.key, *landed)
            flight = None if self.alone else _flights.pop(self.key)
        if flight is None:
            return
        if isinstance(exc, CredentialError):
            flight.future.set_exception(exc)
        else:
            flight.future.set_result(None if landed is None else landed[0])


def get_or_fetch(key: CacheKey, fetch: Callable[[], Fetched], *, store: bool = True) -> Credential:
    """Return the cached credential for ``key``, or fetch it once for all concurrent callers.

    ``fetch`` returns ``(credential, deadline)``. Concurrent callers of the same key (threads or
    tasks, see the module docstring) wait for one fetch and get its credential. A file-backed
    credential, one whose deadline has passed, or any credential with ``store=False`` (the
    single flight of a discovery) is returned but not stored.
    """
    while True:
        credential, flight = _join(key, is_async=False)
        if credential is not None:
            return credential
        alone = flight is not None and flight.is_async and flight.thread == threading.get_ident()
        if flight is None or alone:
            with _Lead(key, store, alone=alone) as lead:
                return lead.land(*fetch())
        credential = result(flight.future)
        if credential is not None:
            return credential


async def aget_or_fetch(
    key: CacheKey, fetch: Callable[[], Awaitable[Fetched]], *, store: bool = True
) -> Credential:
    """The async :func:`get_or_fetch`: same cache, same flights; waiting never blocks the loop."""
    while True:
        credential, flight = _join(key, is_async=True)
        if credential is not None:
            return credential
        if flight is None:
            with _Lead(key, store) as lead:
                return lead.land(*await fetch())
        credential = await aresult(flight.future)
        if credential is not None:
            return credential


def invalidate(key: CacheKey) -> None:
    """Drop one key (after a broker 401), so that the next request fetches again.

    Synchronous and non-blocking (one short-held lock, no I/O), so async code calls it directly:
    there is no ``ainvalidate``.
    """
    with _lock:
        _cache.pop(key, None)


def clear_credential_cache() -> None:
    """Drop every cached credential and every memoised decoded token of this process."""
    with _lock:
        _cache.clear()
    clear_claims_cache()
