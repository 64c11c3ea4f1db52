"""Where the credential framework's sync and async code meet: one hand-off, one kind of wait.

A :class:`concurrent.futures.Future` is the one meeting point. Work that must leave the caller's
thread runs in :func:`in_thread` and is a future; a cache flight (``_cache``) is a future too.
Sync code waits for one with :func:`result`, asyncio code with :func:`aresult`
(``asyncio.wrap_future``: the loop is woken, no thread is parked), on any thread or event loop.
Each future is marked running before anyone sees it, so a waiter that gives up (a cancelled
task, a time limit) never cancels it for the others.

The hand-offs that remain, and why each must exist:

- a sync fetch that may block, called from async code (a plugin with only the sync hook, a sync
  ``OIDCTokenAuth`` callable, loading the plugins): it runs in a thread so the loop runs on;
- an async-only fetch called from sync code (a plugin with only the async hook, an ``async def``
  callable): :func:`awaited_in_thread` runs it with ``asyncio.run`` in a thread, because the
  caller's thread may itself be running an event loop;
- a third-party plugin's time limit on the sync path: its sync hook runs in a thread so that
  the host can stop waiting (:func:`result` with a limit); on the async path an async hook is
  cancelled (:func:`within`).

The thread is a new daemon thread, not an executor's worker: a call that never ends holds no
pool worker and never delays the interpreter's or an event loop's shutdown; its late answer is
dropped. It runs with the caller's context variables.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import TypeVar

__all__ = ["FetchTimeout", "aresult", "awaited_in_thread", "in_thread", "result", "running"]

T = TypeVar("T")


class FetchTimeout(Exception):
    """A fetch did not finish within its time limit (internal: callers turn it into an answer)."""


def running() -> Future[T]:
    """A new future in the running state: a waiter's ``cancel()`` can no longer cancel it."""
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()
    return future


def in_thread(function: Callable[[], T]) -> Future[T]:
    """Start ``function()`` in a new daemon thread, with the caller's context variables."""
    future: Future[T] = running()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            value = context.run(function)
        except BaseException as exc:  # handed to whoever waits for the future
            future.set_exception(exc)
        else:
            future.set_result(value)

    threading.Thread(target=run, name="agent-sandbox-credential-fetch", daemon=True).start()
    return future


def awaited_in_thread(awaitable: Awaitable[T], limit: float | None = None) -> Future[T]:
    """Run ``awaitable`` to completion with ``asyncio.run`` in a new daemon thread (cancelled on
    its loop after ``limit`` seconds). An awaitable bound to another event loop (a Task or a
    Future) cannot be run this way and fails with the error asyncio gives."""

    async def main() -> T:
        return await within(awaitable, limit)

    return in_thread(lambda: asyncio.run(main()))


def result(future: Future[T], limit: float | None = None) -> T:
    """Wait for ``future`` in sync code: its value, or its exception raised here;
    :class:`FetchTimeout` after ``limit`` seconds (a ``TimeoutError`` of its own passes)."""
    try:
        return future.result(limit)
    except TimeoutError:
        if future.done():
            raise
    raise FetchTimeout


async def aresult(future: Future[T], limit: float | None = None) -> T:
    """Wait for ``future`` in asyncio code, without blocking the loop (see :func:`result`)."""
    return await within(asyncio.wrap_future(future), limit)


async def within(awaitable: Awaitable[T], limit: float | None) -> T:
    """Await ``awaitable`` for at most ``limit`` seconds; then it is cancelled and
    :class:`FetchTimeout` is raised (a ``TimeoutError`` of its own passes unchanged)."""
    if limit is None:
        return await awaitable
    scope = asyncio.timeout(limit)
    try:
        async with scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():
            raise FetchTimeout from None
        raise
