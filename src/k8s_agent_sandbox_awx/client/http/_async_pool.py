"""The connection pools a process shares between its async clients: one per event loop and
:class:`~._pool.PoolKey` (the rules of ``_pool``).

An ``httpx.AsyncClient`` belongs to the loop its connections were made in, so every loop has
its own pools, found by the running loop at each request: a client used from another loop
(one ``asyncio.run`` after another) takes that loop's pool, never the first one's. A pool is
closed :data:`~._pool.LINGER_SECONDS` after its last user went, or when its loop shuts down
(``asyncio.run`` and ``asyncio.Runner`` finalise the loop's async generators before closing it:
the pool's closes it then, inside the loop); a loop closed without that is found closed at the
next request of any loop, and its pools are dropped unused (their sockets go with them).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import httpx

from . import _pool
from ._client_settings import CookielessAsyncClient, client_settings
from ._config import BrokerConnectionConfig

__all__ = ["AsyncLease", "close_idle"]


class _AsyncPool:
    def __init__(self, key: _pool.PoolKey, settings: dict[str, Any]) -> None:
        self.key = key
        limits = _pool._shared_limits(settings)
        self.client = CookielessAsyncClient(**{**settings, "limits": limits})
        self.users = 0
        self.timer: asyncio.TimerHandle | None = None
        self.abandoned = False
        self.finalizer = self._until_loop_ends()
        with contextlib.suppress(StopIteration):  # started: its loop now finalises it
            self.finalizer.asend(None).send(None)

    def __repr__(self) -> str:
        return f"<async pool {self.key.broker_url} users={self.users}>"

    async def _until_loop_ends(self) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            if not self.abandoned:
                _drop(self)
                await self.client.aclose()

    async def close(self) -> None:
        await self.finalizer.aclose()  # its finally: dropped, closed

    def abandon(self) -> None:
        """Its loop was closed without finalising it: nothing can be awaited there any more.
        The generator is ended here (else the loop's finaliser would be asked to, and fail)."""
        self.abandoned = True
        with contextlib.suppress(StopIteration):
            self.finalizer.aclose().send(None)


class _Loops:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pools: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[_pool.PoolKey, _AsyncPool]
        ] = weakref.WeakKeyDictionary()
        self.closing: set[asyncio.Task[None]] = set()


_loops = _Loops()


def _reset_after_fork() -> None:
    global _loops
    _loops = _Loops()


_pool.on_fork(_reset_after_fork)


def _drop(pool: _AsyncPool) -> None:
    with _loops.lock:
        _forget(pool)


def _forget(pool: _AsyncPool) -> None:
    """No client finds ``pool`` any more (the lock held)."""
    for pools in _loops.pools.values():
        if pools.get(pool.key) is pool:
            del pools[pool.key]


def _acquire(
    loop: asyncio.AbstractEventLoop, settings: dict[str, Any], key: _pool.PoolKey
) -> _AsyncPool:
    """One more use of ``loop``'s pool for ``key`` (made if there is none); the pools of loops
    found closed are dropped."""
    with _loops.lock:
        for gone in [other for other in _loops.pools if other.is_closed()]:
            for abandoned in _loops.pools.pop(gone).values():
                abandoned.abandon()
        pools = _loops.pools.setdefault(loop, {})
        pool = pools.get(key)
        if pool is None:
            pool = pools[key] = _AsyncPool(key, settings)
        pool.users += 1
        if pool.timer is not None:
            pool.timer.cancel()
            pool.timer = None
    return pool


def _release(pool: _AsyncPool, loop: asyncio.AbstractEventLoop) -> None:
    """One use fewer; the last one leaves the pool open for ``LINGER_SECONDS`` (from
    ``loop``'s thread: the lease of another loop's thread gives it back there)."""
    with _loops.lock:
        pool.users -= 1
        if pool.users > 0 or loop.is_closed():
            return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        _linger(pool, loop)
    else:
        with contextlib.suppress(RuntimeError):  # closed meanwhile: its shutdown closes it
            loop.call_soon_threadsafe(_linger, pool, loop)


def _linger(pool: _AsyncPool, loop: asyncio.AbstractEventLoop) -> None:
    with _loops.lock:
        if pool.users == 0 and pool.timer is None:
            pool.timer = loop.call_later(_pool.LINGER_SECONDS, _expire, pool, loop)


def _expire(pool: _AsyncPool, loop: asyncio.AbstractEventLoop) -> None:
    with _loops.lock:
        pool.timer = None
        if pool.users > 0:
            return
        _forget(pool)  # from now on the next client makes a new one
    task = loop.create_task(pool.close())
    _loops.closing.add(task)
    task.add_done_callback(_loops.closing.discard)


async def close_idle() -> int:
    """Close the running loop's pools that no client uses now; how many."""
    loop = asyncio.get_running_loop()
    with _loops.lock:
        idle = [p for p in _loops.pools.get(loop, {}).values() if p.users == 0]
        for pool in idle:
            _forget(pool)
            if pool.timer is not None:
                pool.timer.cancel()
                pool.timer = None
    for pool in idle:
        await pool.close()
    return len(idle)


class _Releasing(httpx.AsyncByteStream):
    """An open answer's body; closing it gives its connection back to the lease's limit."""

    def __init__(self, stream: Any, done: Callable[[], None]) -> None:
        self._stream = stream
        self._done = done

    def __aiter__(self) -> AsyncIterator[bytes]:
        chunks: AsyncIterator[bytes] = aiter(self._stream)  # no generator in between
        return chunks

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._done()


class AsyncLease:
    """One async client object's connections: a use of the running loop's pool for its
    settings (or, with ``http_transport``, an ``httpx.AsyncClient`` of its own), its own
    ``max_connections`` limit and the answers it has open."""

    def __init__(
        self, config: BrokerConnectionConfig, http_transport: httpx.AsyncBaseTransport | None
    ) -> None:
        self._config = config
        self._own: CookielessAsyncClient | None = None
        self._pool: _AsyncPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generation = -1
        self._open: set[httpx.Response] = set()
        self._room: asyncio.Semaphore | None = None
        self.closed = False
        if http_transport is not None:
            self._own = CookielessAsyncClient(transport=http_transport, **client_settings(config))
        else:
            self._key = _pool.pool_key(config)
            self._settings = _pool.prepared_settings(self._key, config)  # its errors: now

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<async lease of {self._pool or 'its own client'} ({state})>"

    @property
    def client(self) -> CookielessAsyncClient:
        """The HTTP client of the running loop the requests go through (and are built by)."""
        if self._own is not None:
            return self._own
        loop = asyncio.get_running_loop()
        pool = self._pool
        if pool is None or self._loop is not loop or self._generation != _pool.generation():
            pool = self._bind(loop)
        return pool.client

    def _bind(self, loop: asyncio.AbstractEventLoop) -> _AsyncPool:
        """A use of ``loop``'s pool (the previous loop's given back), and a limit for it."""
        self._give_pool_back()
        self._open = set()
        limit = self._config.max_connections
        self._room = None if limit is None else asyncio.Semaphore(limit)
        self._pool, self._loop = _acquire(loop, self._settings, self._key), loop
        self._generation = _pool.generation()
        return self._pool

    async def send(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; the answer with its body not read yet (close it)."""
        if self.closed:
            raise RuntimeError(_pool.CLOSED)
        client = self.client
        if self._own is not None:
            return await client.send_streamed(request)
        await self._wait_for_room(request)
        try:
            response = await client.send_streamed(request)
        except BaseException:
            self._give_back(self._room)
            raise
        self._track(response, self._room)
        return response

    async def _wait_for_room(self, request: httpx.Request) -> None:
        """Wait for one of the client's ``max_connections`` (up to the pool timeout)."""
        room = self._room
        if room is None:
            return
        if not room.locked():
            await room.acquire()  # free: no wait
            return
        try:
            await asyncio.wait_for(room.acquire(), _pool.pool_timeout(request))
        except TimeoutError:
            raise _pool.no_room(request, self._config) from None

    @staticmethod
    def _give_back(room: asyncio.Semaphore | None) -> None:
        if room is not None:
            room.release()

    def _track(self, response: httpx.Response, room: asyncio.Semaphore | None) -> None:
        ended = False
        opened = self._open

        def done() -> None:
            nonlocal ended
            if not ended:
                ended = True
                opened.discard(response)
                self._give_back(room)

        response.stream = _Releasing(response.stream, done)
        opened.add(response)

    async def close(self) -> None:
        """Close the answers still open and stop using the pool (other clients go on with
        it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._own is not None:
            await self._own.aclose()
            return
        for response in list(self._open):
            await response.aclose()
        self._give_pool_back()

    def _give_pool_back(self) -> None:
        """One use fewer of the pool bound (never a parent's, in a forked child)."""
        pool, loop = self._pool, self._loop
        if pool is not None and loop is not None and self._generation == _pool.generation():
            _release(pool, loop)
