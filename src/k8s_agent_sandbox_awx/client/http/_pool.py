"""The connection pools a process shares between its clients (sync), and their keys.

Every client object (``BrokerSandboxClient``, and so every ``Sandbox.create``) of one process
whose connection settings are the same uses one ``httpx.Client``: one pool of kept-alive TLS
connections, one TLS context. What makes two settings differ is in the :class:`PoolKey`: the
broker URL, the TLS trust (the CA bundle, or the default trust store and the variables that
move it) and client certificate (each file's path and identity on disk: a replaced file is a
new pool), the environment's proxies when they are used, the timeout, the idle connections
kept, the extra headers. Never a credential: the token is read fresh for every request and
added to it; the pool never sees it outside the requests it sends.

A client object holds a :class:`Lease`: its own requests and its own limit
(``max_connections``: requests in flight at once, as when each client had its own pool), the
answers it has open (closing the lease closes them, as closing a client's own pool did), and
one use of the pool. A pool whose last user went stays open :data:`LINGER_SECONDS` (httpx's
keep-alive expiry: after it every idle connection would be dropped anyway), so that the
sandboxes of a loop such as ``for ...: with Sandbox.create() as sb: ...`` share one connection,
then it is closed; all are closed at interpreter exit. After ``os.fork`` the child starts with
no pool: a client carried over makes its own connections at its next request, and never uses
the parent's. An ``http_transport`` given to a client is never shared: its client is its own.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import secrets
import threading
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..._cookies import NoCookies
from ._client_settings import CookielessClient, client_settings
from ._config import BrokerConnectionConfig

__all__ = [
    "LINGER_SECONDS",
    "Lease",
    "PoolKey",
    "close_all",
    "close_idle",
    "generation",
    "no_room",
    "pool_key",
    "pool_timeout",
    "prepared_settings",
]

LINGER_SECONDS = 5.0
"""How long a pool whose last user went stays open for the next one (httpx's keep-alive
expiry of an idle connection)."""
_SALT = secrets.token_bytes(16)
"""The key of the settings' digest: a digest of a secret header is no use outside the
process."""
_MAX_PREPARED = 32
CLOSED = (
    "This client's connections were closed (close(), kill() or close_connection()); reattach "
    "with Sandbox.connect(name) or make a new client."
)
_TLS_VARIABLES = ("SSL_CERT_FILE", "SSL_CERT_DIR")
"""Where OpenSSL's default trust store is moved by the environment (no ``ca_cert``)."""


@dataclass(frozen=True, slots=True)
class PoolKey:
    """What makes two clients' connections differ: the broker URL and a keyed digest of the
    rest (never shown: the extra headers or a proxy URL may hold secrets)."""

    broker_url: str
    digest: bytes = field(repr=False)

    def __repr__(self) -> str:
        return f"PoolKey({self.broker_url!r})"


def _identity(path: str | None) -> tuple[Any, ...] | None:
    """A file's path and identity on disk (a rewritten or replaced file has another)."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return (path, None)  # client_settings names the problem
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def pool_key(config: BrokerConnectionConfig) -> PoolKey:
    """The pool ``config``'s connections belong to."""
    trust: tuple[Any, ...] = ()
    if config.broker_url.startswith("https://"):
        ca = _identity(config.ca_cert)
        default = () if ca else tuple(_identity(os.environ.get(v)) for v in _TLS_VARIABLES)
        certs = config.client_cert or (None, None)
        trust = (ca, default, _identity(certs[0]), _identity(certs[1]))
    proxies = sorted(urllib.request.getproxies().items()) if config.use_env_proxies else None
    parts = (
        trust,
        config.use_env_proxies,
        proxies,
        config.request_timeout,
        config.max_keepalive_connections,
        sorted(config.extra_headers.items()),
    )
    digest = hashlib.blake2b(repr(parts).encode(), key=_SALT, digest_size=16).digest()
    return PoolKey(config.broker_url, digest)


# --------------------------------------------------------------------------------------------
# The process's state (reset in a forked child)


class _State:
    def __init__(self, generation: int = 0) -> None:
        self.lock = threading.Lock()
        self.rebinding = threading.Lock()
        """Held while a lease made before a fork binds to the child's pool."""
        self.pools: dict[PoolKey, _Pool] = {}
        self.prepared: OrderedDict[PoolKey, dict[str, Any]] = OrderedDict()
        self.generation = generation
        """Counts the forks this process is a child of: a lease of another generation was
        made in a parent."""


_state = _State()
_forked: list[Callable[[], None]] = []
"""What else a forked child resets (the async pools)."""


def generation() -> int:
    return _state.generation


def on_fork(reset: Callable[[], None]) -> None:
    """Call ``reset`` in a forked child, after this module's own reset."""
    _forked.append(reset)


def _after_fork_in_child() -> None:
    """The parent's pools are left alone (closing them could wait on a lock another thread
    of the parent held at the fork); the child makes its own."""
    global _state
    _state = _State(_state.generation + 1)
    for reset in _forked:
        reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


def prepared_settings(key: PoolKey, config: BrokerConnectionConfig) -> dict[str, Any]:
    """The keyword arguments of a pool's HTTP client for ``key`` (``client_settings``: the TLS
    context loaded once per key; a configuration problem raised here, as a typed error)."""
    state = _state
    with state.lock:
        settings = state.prepared.get(key)
        if settings is not None:
            state.prepared.move_to_end(key)
    if settings is None:
        settings = client_settings(config)
        with state.lock:
            state.prepared[key] = settings
            while len(state.prepared) > _MAX_PREPARED:
                state.prepared.popitem(last=False)
    return {**settings, "cookies": NoCookies()}


# --------------------------------------------------------------------------------------------
# The sync pools


class _Pool:
    def __init__(self, key: PoolKey, settings: dict[str, Any]) -> None:
        self.key = key
        self.client = CookielessClient(**{**settings, "limits": _shared_limits(settings)})
        self.users = 0
        self.timer: threading.Timer | None = None

    def __repr__(self) -> str:
        return f"<pool {self.key.broker_url} users={self.users}>"


def _shared_limits(settings: dict[str, Any]) -> httpx.Limits:
    """A shared pool has no connection limit of its own: each lease keeps its client's."""
    limits: httpx.Limits = settings["limits"]
    return httpx.Limits(
        max_connections=None, max_keepalive_connections=limits.max_keepalive_connections
    )


def _acquire(config: BrokerConnectionConfig) -> tuple[_Pool, int]:
    """One more use of the pool for ``config`` (made if there is none); its generation."""
    key = pool_key(config)
    state = _state
    with state.lock:
        pool = state.pools.get(key)
    if pool is None:
        made = _Pool(key, prepared_settings(key, config))
        with state.lock:
            pool = state.pools.setdefault(key, made)
        if pool is not made:
            made.client.close()  # another thread made it meanwhile
    with state.lock:
        if state.pools.get(key) is not pool:  # closed meanwhile (its linger ended)
            return _acquire(config)
        pool.users += 1
        if pool.timer is not None:
            pool.timer.cancel()
            pool.timer = None
    return pool, state.generation


def _release(pool: _Pool, generation: int) -> None:
    """One use fewer; the last one leaves the pool open for :data:`LINGER_SECONDS`."""
    state = _state
    if generation != state.generation:
        return  # a parent's pool, in a forked child: never touched
    with state.lock:
        pool.users -= 1
        if pool.users > 0 or state.pools.get(pool.key) is not pool:
            return
        timer = threading.Timer(LINGER_SECONDS, _expire, (pool, state))
        timer.daemon = True
        pool.timer = timer
    timer.start()


def _expire(pool: _Pool, state: _State) -> None:
    with state.lock:
        if pool.users > 0 or state.pools.get(pool.key) is not pool:
            return
        del state.pools[pool.key]
    pool.client.close()


def close_idle() -> int:
    """Close every pool no client uses now (their lingering ends at once); how many."""
    state = _state
    with state.lock:
        idle = [p for p in state.pools.values() if p.users == 0]
        for pool in idle:
            del state.pools[pool.key]
            if pool.timer is not None:
                pool.timer.cancel()
    for pool in idle:
        pool.client.close()
    return len(idle)


def close_all() -> None:
    """Close every pool (at interpreter exit); a client still used makes a new one."""
    state = _state
    with state.lock:
        pools = list(state.pools.values())
        state.pools.clear()
        for pool in pools:
            if pool.timer is not None:
                pool.timer.cancel()
    for pool in pools:
        pool.client.close()


atexit.register(close_all)


# --------------------------------------------------------------------------------------------
# One client object's use of a pool


def pool_timeout(request: httpx.Request) -> float | None:
    """How long ``request`` may wait for a connection (its ``pool`` timeout)."""
    timeout: float | None = request.extensions.get("timeout", {}).get("pool")
    return timeout


def no_room(request: httpx.Request, config: BrokerConnectionConfig) -> httpx.PoolTimeout:
    """The error of a request that found none of its client's ``max_connections`` free."""
    return httpx.PoolTimeout(
        f"no free connection within {pool_timeout(request)}s: this client has "
        f"max_connections={config.max_connections} requests in flight; raise max_connections "
        "or close the answers (streams) it holds",
        request=request,
    )


class _Releasing(httpx.SyncByteStream):
    """An open answer's body; closing it gives its connection back to the lease's limit."""

    def __init__(self, stream: Any, done: Callable[[], None]) -> None:
        self._stream = stream
        self._done = done

    def __iter__(self) -> Any:
        yield from self._stream

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            self._done()


class Lease:
    """One client object's connections: a use of the shared pool for its settings (or, with
    ``http_transport``, an ``httpx.Client`` of its own), its own ``max_connections`` limit and
    the answers it has open. Thread-safe."""

    def __init__(
        self, config: BrokerConnectionConfig, http_transport: httpx.BaseTransport | None = None
    ) -> None:
        self._config = config
        self._own: httpx.Client | None = None
        self._pool: _Pool | None = None
        self._generation = -1
        self.closed = False
        if http_transport is not None:
            self._own = CookielessClient(transport=http_transport, **client_settings(config))
        else:
            self._bind()

    def _bind(self) -> None:
        """A use of this process's pool, a limit and a record of open answers of its own."""
        self._lock = threading.Lock()
        self._open: set[httpx.Response] = set()
        limit = self._config.max_connections
        self._room = None if limit is None else threading.BoundedSemaphore(limit)
        self._pool, self._generation = _acquire(self._config)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<lease of {self._pool or 'its own client'} ({state})>"

    @property
    def client(self) -> httpx.Client:
        """The HTTP client the requests go through (and are built by)."""
        if self._own is not None:
            return self._own
        state = _state
        if self._generation != state.generation and not self.closed:
            with state.rebinding:  # made before a fork: the child's own connections
                if self._generation != state.generation:
                    self._bind()
        assert self._pool is not None
        return self._pool.client

    def send(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; the answer with its body not read yet (close it)."""
        if self.closed:
            raise RuntimeError(CLOSED)
        client = self.client
        if self._own is not None:
            return client.send(request, stream=True)
        self._wait_for_room(request)
        try:
            response = client.send(request, stream=True)
        except BaseException:
            self._give_back()
            raise
        self._track(response)
        return response

    def _wait_for_room(self, request: httpx.Request) -> None:
        """Wait for one of the client's ``max_connections`` (up to the pool timeout)."""
        if self._room is None:
            return
        if not self._room.acquire(timeout=pool_timeout(request)):
            raise no_room(request, self._config)

    def _give_back(self) -> None:
        if self._room is not None:
            self._room.release()

    def _track(self, response: httpx.Response) -> None:
        ended = threading.Event()  # released once, however often the body is closed

        def done() -> None:
            with self._lock:
                if ended.is_set():
                    return
                ended.set()
                self._open.discard(response)
            self._give_back()

        response.stream = _Releasing(response.stream, done)
        with self._lock:
            self._open.add(response)

    def close(self) -> None:
        """Close the answers still open (a read waiting on one ends) and stop using the pool
        (other clients go on with it). Idempotent."""
        if self._own is not None:
            self.closed = True
            self._own.close()
            return
        with self._lock:
            if self.closed:
                return
            self.closed = True
            still_open = list(self._open)
        for response in still_open:
            response.close()
        if self._pool is not None:
            _release(self._pool, self._generation)
