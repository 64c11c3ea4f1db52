"""Connection reuse across sandboxes, against the local broker (loopback HTTPS). Prints numbers;
asserts nothing.

    python bench/bench_reuse.py [--sandboxes 30] [--warmup 3] [--only sync|async]

N sandboxes are created one after the other in one process (each killed before the next is
created, the usual ``with Sandbox.create() as sb:`` loop), sync and async, and three times are
taken for each: ``Sandbox.create`` until it returns (create -> ready), its first
``commands.run("true")``, and ``Sandbox.connect`` to a running sandbox with one
``commands.run("true")`` (the client's part of a create without the sandbox's start). Two
ways, interleaved sandbox by sandbox so that the machine's load hits both alike:

- **new**: every create starts without a connection pool (the idle pools are closed and the
  loaded TLS contexts forgotten first: ``_pool.close_idle``), as every create did before pools
  were shared: a new HTTP client, TLS context and TLS connection per sandbox;
- **reused**: the process's pool for these settings is kept: the create uses the connection
  the previous sandbox used.

On a checkout without shared pools (no ``client/http/_pool.py``) both ways are the old code.
The baseline, measured in the same run between the sandboxes: ``commands.run("true")`` on a
sandbox that already has its connection (in a pool of its own: another ``request_timeout``).
Every figure is also printed as a ratio to it.
The broker runs in this process (its thread shares the cores and the GIL with the client).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox
from k8s_agent_sandbox_awx.testing import LocalBroker, Policy


def _pools() -> tuple[Any, Any]:
    """The sync and async pool modules, or ``None``s before shared pools existed."""
    try:
        sync = importlib.import_module("k8s_agent_sandbox_awx.client.http._pool")
        async_ = importlib.import_module("k8s_agent_sandbox_awx.client.http._async_pool")
    except ImportError:
        return None, None
    return sync, async_


SYNC_POOLS, ASYNC_POOLS = _pools()
Row = tuple[float, float, float, float]
"""create -> ready, the first command, connect + a command, the baseline (seconds)."""


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _p90_ms(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(len(ordered) * 0.9) - 1)] * 1e3


def _forget_sync() -> None:
    if SYNC_POOLS is not None:
        SYNC_POOLS.close_idle()
        SYNC_POOLS._state.prepared.clear()


async def _forget_async() -> None:
    if ASYNC_POOLS is not None:
        await ASYNC_POOLS.close_idle()
        SYNC_POOLS._state.prepared.clear()


def _sync_round(env: dict[str, str], new: bool, warm: Sandbox) -> Row:
    if new:
        _forget_sync()
    started = time.perf_counter()
    sandbox = Sandbox.create(environ=env)
    created = time.perf_counter()
    sandbox.commands.run("true")
    first = time.perf_counter()
    sandbox.kill()
    if new:
        _forget_sync()
    t = time.perf_counter()
    again = Sandbox.connect(warm.name, environ=env)
    again.commands.run("true")
    attached = time.perf_counter() - t
    again.close_connection()
    t = time.perf_counter()
    warm.commands.run("true")
    baseline = time.perf_counter() - t
    return created - started, first - created, attached, baseline


async def _async_round(env: dict[str, str], new: bool, warm: AsyncSandbox) -> Row:
    if new:
        await _forget_async()
    started = time.perf_counter()
    sandbox = await AsyncSandbox.create(environ=env)
    created = time.perf_counter()
    await sandbox.commands.run("true")
    first = time.perf_counter()
    await sandbox.kill()
    if new:
        await _forget_async()
    t = time.perf_counter()
    again = await AsyncSandbox.connect(warm.name, environ=env)
    await again.commands.run("true")
    attached = time.perf_counter() - t
    await again.close_connection()
    t = time.perf_counter()
    await warm.commands.run("true")
    baseline = time.perf_counter() - t
    return created - started, first - created, attached, baseline


WARM_TIMEOUT = 31.0
"""The warm sandbox's ``request_timeout``: another setting, so another pool (it would keep the
measured one in use: "new" could not close it)."""
FIGURES = ("create -> ready", "first command", "connect + command")


def _report(title: str, rows: dict[str, list[Row]]) -> None:
    base = _median_ms([r[3] for rs in rows.values() for r in rs])
    print(f"\n{title}: n={len(rows['new'])} per way; baseline (warm commands.run) {base:.2f} ms")
    medians: dict[str, list[float]] = {}
    for way, rs in rows.items():
        medians[way] = []
        for i, figure in enumerate(FIGURES):
            values = [r[i] for r in rs]
            medians[way].append(_median_ms(values))
            print(
                f"  {way:7} {figure:18} median {medians[way][i]:7.2f} ms "
                f"(p90 {_p90_ms(values):7.2f})  = {medians[way][i] / base:5.2f}x baseline"
            )
    for i, figure in enumerate(FIGURES):
        new, reused = medians["new"][i], medians["reused"][i]
        print(f"  reused / new, {figure:18} {reused / new:.2f}x ({new - reused:+.2f} ms)")


def _run_sync(env: dict[str, str], count: int, warmup: int) -> None:
    rows: dict[str, list[Row]] = {"new": [], "reused": []}
    with Sandbox.create(environ=env, request_timeout=WARM_TIMEOUT) as warm:
        for i in range(warmup + count):
            for way in ("new", "reused") if i % 2 else ("reused", "new"):
                result = _sync_round(env, way == "new", warm)
                if i >= warmup:
                    rows[way].append(result)
    _report("sync Sandbox", rows)


def _run_async(env: dict[str, str], count: int, warmup: int) -> None:
    async def main() -> dict[str, list[Row]]:
        rows: dict[str, list[Row]] = {"new": [], "reused": []}
        async with await AsyncSandbox.create(environ=env, request_timeout=WARM_TIMEOUT) as warm:
            for i in range(warmup + count):
                for way in ("new", "reused") if i % 2 else ("reused", "new"):
                    result = await _async_round(env, way == "new", warm)
                    if i >= warmup:
                        rows[way].append(result)
        return rows

    _report("async AsyncSandbox (one event loop)", asyncio.run(main()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandboxes", type=int, default=30, help="per way and client")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", choices=("sync", "async"), default=None)
    args = parser.parse_args()
    os.environ.setdefault("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    shared = "shared pools" if SYNC_POOLS is not None else "no shared pools (the old code)"
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {shared}")
    policy = Policy(templates=("python",), namespace="gitlab-ci", max_sandboxes=10)
    runs: dict[str, Callable[[dict[str, str], int, int], None]] = {
        "sync": _run_sync,
        "async": _run_async,
    }
    with LocalBroker(gitlab_policy=policy, warn=False) as broker:
        env = broker.environ("gitlab")
        for name, run in runs.items():
            if args.only in (None, name):
                run(env, args.sandboxes, args.warmup)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
