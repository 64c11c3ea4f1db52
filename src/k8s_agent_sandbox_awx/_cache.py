"""The one process-wide cache of non-file credentials.

Keyed by ``(source key, audience)``: the source key is a provider name for the discovery chain
(plus an instance key when it reads a custom environment), or an instance key for each explicit
:class:`~k8s_agent_sandbox_awx.OIDCTokenAuth`, so explicit sources never collide.

An entry lives until the deadline computed by :func:`._jwt.cache_deadline` (``exp`` minus a
margin, never past ``exp``). A miss takes a per-key lock and checks again before fetching, so
any number of concurrent callers cause one fetch per key and expiry. File-backed credentials are
never stored. Thread-safe: the cache itself is guarded by one short-held lock.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import NamedTuple

from cachetools import TLRUCache

from ._credential import Credential
from ._jwt import clear_claims_cache

__all__ = [
    "clear_credential_cache",
    "get_cached",
    "get_or_fetch",
    "invalidate",
    "new_instance_key",
    "now",
]

CacheKey = tuple[Hashable, str]

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


class _KeyLock:
    __slots__ = ("__weakref__", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()


_cache: TLRUCache[CacheKey, _Entry] = TLRUCache(maxsize=MAX_ENTRIES, ttu=_ttu, timer=now)
_lock = threading.Lock()
_key_locks: weakref.WeakValueDictionary[CacheKey, _KeyLock] = weakref.WeakValueDictionary()
_instance_keys = itertools.count(1)


def new_instance_key(kind: str) -> tuple[str, int]:
    """A key no other source will ever use (for one explicit source object)."""
    return (kind, next(_instance_keys))


def get_cached(key: CacheKey) -> Credential | None:
    """The cached credential for ``key`` if present and before its deadline."""
    with _lock:
        entry = _cache.get(key)
    return None if entry is None else entry.credential


def _store(key: CacheKey, credential: Credential, deadline: float) -> None:
    with _lock:
        if deadline > now():
            _cache[key] = _Entry(credential, deadline)
        else:
            _cache.pop(key, None)


def get_or_fetch(key: CacheKey, fetch: Callable[[], tuple[Credential, float]]) -> Credential:
    """Return the cached credential for ``key``, or call ``fetch`` once and cache its result.

    ``fetch`` returns ``(credential, deadline)``; it runs under the key's lock, so concurrent
    callers of the same key wait for it instead of fetching again. A file-backed credential or
    one whose deadline has already passed is returned but not stored.
    """
    credential = get_cached(key)
    if credential is not None:
        return credential
    with _lock:
        key_lock = _key_locks.get(key)
        if key_lock is None:
            key_lock = _key_locks[key] = _KeyLock()
    with key_lock.lock:
        credential = get_cached(key)
        if credential is not None:
            return credential
        credential, deadline = fetch()
        if not credential.file_backed:
            _store(key, credential, deadline)
        return credential


def put(key: CacheKey, credential: Credential, deadline: float) -> None:
    """Store an already fetched non-file credential (used right after discovery)."""
    if not credential.file_backed:
        _store(key, credential, deadline)


def invalidate(key: CacheKey) -> None:
    """Drop one key (after a broker 401), so that the next request fetches again."""
    with _lock:
        _cache.pop(key, None)


def clear_credential_cache() -> None:
    """Drop every cached credential and every memoised decoded token of this process."""
    with _lock:
        _cache.clear()
    clear_claims_cache()
