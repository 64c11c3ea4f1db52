"""The one process-wide cache of non-file credentials, shared by the sync and the async path.

Keyed by ``(source key, audience)``: the source key is a provider name for the discovery chain
(plus an instance key when it reads a custom environment), or an instance key for each explicit
:class:`~k8s_agent_sandbox_awx.OIDCTokenAuth`, so explicit sources never collide.

An entry lives until the deadline computed by :func:`._jwt.cache_deadline` (``exp`` minus a
margin, never past ``exp``). File-backed credentials are never stored.

Single flight: a miss starts (or joins) the key's *flight*, registered under the cache's one
short-held lock after checking the cache again. The caller that starts it (sync or async) is the
leader and fetches; every other caller of that key waits for the leader's result instead of
fetching: a thread waits on the flight's :class:`threading.Event`, an asyncio task awaits a
future of its own event loop (woken with ``call_soon_threadsafe``), so no thread is parked for an
async waiter. Sync and async callers join the same flights and read the same cache, so any mix
of threads and tasks causes one fetch per key and expiry. When the leader fails with a
:class:`CredentialError`, its waiters raise that error too (like the waiters of one shared
:class:`asyncio.Future`); when it is cancelled or interrupted, they retry and one of them leads.
A thread never waits for an async flight led from its own thread (that would deadlock the event
loop it runs on): it fetches by itself instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from types import TracebackType
from typing import NamedTuple

from cachetools import TLRUCache

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


def _ttu(_key: CacheKey, entry: _Entry, _now: float) -> float:
    return entry.deadline


class _Flight:
    """One fetch in progress for one key, and who waits for it."""

    __slots__ = ("credential", "done", "error", "is_async", "thread", "waiters")

    def __init__(self, is_async: bool) -> None:
        self.is_async = is_async
        self.thread = threading.get_ident()
        self.done = threading.Event()
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.credential: Credential | None = None
        self.error: CredentialError | None = None

    def outcome(self) -> Credential | None:
        """The leader's credential; its error raised; ``None`` if it gave up (retry)."""
        if self.error is not None:
            raise self.error
        return self.credential


_cache: TLRUCache[CacheKey, _Entry] = TLRUCache(maxsize=MAX_ENTRIES, ttu=_ttu, timer=now)
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


class _Start(NamedTuple):
    cached: Credential | None
    flight: _Flight | None
    leader: bool
    wakeup: asyncio.Future[None] | None


def _start(key: CacheKey, loop: asyncio.AbstractEventLoop | None) -> _Start:
    """Check the cache again, then lead a new flight for ``key`` or join the current one.

    An async caller (``loop`` given) that joins gets a future of its loop, registered with the
    flight under the lock so that the leader cannot land unseen.
    """
    with _lock:
        entry = _cache.get(key)
        if entry is not None:
            return _Start(entry.credential, None, False, None)
        flight = _flights.get(key)
        if flight is None:
            flight = _flights[key] = _Flight(is_async=loop is not None)
            return _Start(None, flight, True, None)
        wakeup: asyncio.Future[None] | None = None
        if loop is not None:
            wakeup = loop.create_future()
            flight.waiters.append((loop, wakeup))
        return _Start(None, flight, False, wakeup)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Leading:
    """The leader's side of a flight: ``with _Leading(...) as lead: return lead.land(*fetch())``.

    Lands the flight however the block ends: stores a result, records a credential error for
    the waiters, or lets them retry after any other exception (cancellation, interrupt).
    ``flight=None``: a thread fetching by itself, outside the flight that an async task of its
    own thread leads (nothing to land).
    """

    def __init__(self, key: CacheKey, flight: _Flight | None, store: bool) -> None:
        self.key, self.flight, self.store = key, flight, store

    def __enter__(self) -> _Leading:
        return self

    def land(self, credential: Credential, deadline: float) -> Credential:
        if self.flight is not None:
            self.flight.credential = credential
        if self.store:
            with _lock:
                _store_locked(self.key, credential, deadline)
        return credential

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        flight = self.flight
        if flight is None:
            return
        if isinstance(exc, CredentialError):
            flight.error = exc
        with _lock:
            if _flights.get(self.key) is flight:
                del _flights[self.key]
            waiters, flight.waiters = flight.waiters, []
        flight.done.set()
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody left to wake
                loop.call_soon_threadsafe(_wake, future)


def get_or_fetch(key: CacheKey, fetch: Callable[[], Fetched], *, store: bool = True) -> Credential:
    """Return the cached credential for ``key``, or fetch it once for all concurrent callers.

    ``fetch`` returns ``(credential, deadline)``. Concurrent callers of the same key (threads or
    tasks, see the module docstring) wait for one fetch and get its credential. A file-backed
    credential, one whose deadline has passed, or any credential with ``store=False`` (the
    single flight of a discovery) is returned but not stored.
    """
    credential = get_cached(key)
    while True:
        if credential is not None:
            return credential
        start = _start(key, None)
        credential, flight = start.cached, start.flight
        if flight is None:
            continue
        if start.leader or (flight.is_async and flight.thread == threading.get_ident()):
            with _Leading(key, flight if start.leader else None, store) as lead:
                return lead.land(*fetch())
        flight.done.wait()
        credential = flight.outcome()


async def aget_or_fetch(
    key: CacheKey, fetch: Callable[[], Awaitable[Fetched]], *, store: bool = True
) -> Credential:
    """The async :func:`get_or_fetch`: same cache, same flights; waiting never blocks the loop."""
    credential = get_cached(key)
    while True:
        if credential is not None:
            return credential
        start = _start(key, asyncio.get_running_loop())
        credential, flight = start.cached, start.flight
        if flight is None:
            continue
        if start.leader:
            with _Leading(key, flight, store) as lead:
                return lead.land(*await fetch())
        assert start.wakeup is not None
        await start.wakeup
        credential = flight.outcome()


def put(key: CacheKey, credential: Credential, deadline: float) -> None:
    """Store an already fetched non-file credential (used right after discovery)."""
    with _lock:
        _store_locked(key, credential, deadline)


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
