"""Async client benchmarks against the local broker (loopback HTTPS). Prints numbers; asserts
nothing.

    python bench/bench_async.py [--counts 10,100,500] [--runs 300]

1. N concurrent create -> commands.run -> kill cycles from one event loop (N = 10, 100, 500):
   wall time and the client process's peak RSS, once with one ``AsyncSandbox.create()`` (and so
   one HTTP client) per sandbox and once with one shared ``AsyncBrokerSandboxClient``
   (``max_connections=max(100, N)``: each pending long-poll holds a connection); plus the
   number of credential fetches (one cached ``OIDCTokenAuth`` over an async callable).
2. Per-call overhead: ``commands.run("true")`` through the broker, sync client vs async client
   (sequential calls on one sandbox), medians and their ratio.

The broker runs in this process; each measurement runs the client in a fresh child process, so
that the RSS is the client's alone. Both share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any


def _raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _status_mib(field: str) -> float:
    """``VmHWM`` (peak RSS) or ``VmRSS`` of this process, from /proc (``ru_maxrss`` would
    include the parent's RSS at fork time: Linux keeps it across exec)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mib() -> float:
    return _status_mib("VmHWM")


# ------------------------------------------------------------------------------ child side


async def _cycles(count: int, shared: bool) -> dict[str, Any]:
    from k8s_agent_sandbox_awx import AsyncBrokerSandboxClient, AsyncSandbox, OIDCTokenAuth

    url, ca, token = (os.environ[k] for k in ("BENCH_URL", "BENCH_CA", "BENCH_TOKEN"))
    fetches = 0

    async def fetch() -> str:
        nonlocal fetches
        fetches += 1
        return token

    auth = OIDCTokenAuth(fetch)
    rss_before = _status_mib("VmRSS")
    failures: list[str] = []

    async def one(sandbox: Any) -> None:
        result = await sandbox.commands.run("true")
        assert result.exit_code == 0

    started = time.perf_counter()
    if shared:
        async with AsyncBrokerSandboxClient(
            broker_url=url, ca_cert=ca, auth=auth, max_connections=max(100, count)
        ) as client:

            async def cycle_shared(i: int) -> None:
                sandbox = await client.create_sandbox()
                try:
                    await one(sandbox)
                finally:
                    await sandbox.kill()

            outcomes = await asyncio.gather(
                *(cycle_shared(i) for i in range(count)), return_exceptions=True
            )
    else:

        async def cycle(i: int) -> None:
            async with await AsyncSandbox.create(auth=auth, broker_url=url, ca_cert=ca) as sb:
                await one(sb)

        outcomes = await asyncio.gather(*(cycle(i) for i in range(count)), return_exceptions=True)
    wall = time.perf_counter() - started
    failures = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
    return {
        "count": count,
        "shared": shared,
        "wall_s": wall,
        "peak_rss_mib": _peak_rss_mib(),
        "rss_before_mib": rss_before,
        "fetches": fetches,
        "failures": len(failures),
        "first_failure": failures[0][:300] if failures else None,
    }


def _overhead(runs: int) -> dict[str, Any]:
    from k8s_agent_sandbox_awx import AsyncSandbox, OIDCTokenAuth, Sandbox

    url, ca, token = (os.environ[k] for k in ("BENCH_URL", "BENCH_CA", "BENCH_TOKEN"))
    auth = OIDCTokenAuth(token)
    sync_times: list[float] = []
    with Sandbox.create(auth=auth, broker_url=url, ca_cert=ca) as sandbox:
        for _ in range(20):
            sandbox.commands.run("true")
        for _ in range(runs):
            t = time.perf_counter()
            sandbox.commands.run("true")
            sync_times.append(time.perf_counter() - t)

    async def run_async() -> list[float]:
        times: list[float] = []
        async with await AsyncSandbox.create(auth=auth, broker_url=url, ca_cert=ca) as sandbox:
            for _ in range(20):
                await sandbox.commands.run("true")
            for _ in range(runs):
                t = time.perf_counter()
                await sandbox.commands.run("true")
                times.append(time.perf_counter() - t)
        return times

    async_times = asyncio.run(run_async())
    return {"sync": sync_times, "async": async_times}


def _child(argv: list[str]) -> None:
    fd_limit = _raise_fd_limit()
    if argv[0] == "cycles":
        result = asyncio.run(_cycles(int(argv[1]), argv[2] == "shared"))
        result["fd_limit"] = fd_limit
    else:
        result = _overhead(int(argv[1]))
    print(json.dumps(result))


# ------------------------------------------------------------------------------ parent side


def _spawn(broker: Any, token: str, *args: str, timeout: float = 900) -> dict[str, Any]:
    env = {
        **os.environ,
        "BENCH_URL": broker.url,
        "BENCH_CA": broker.ca_bundle,
        "BENCH_TOKEN": token,
        "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", default="10,100,500")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return

    from k8s_agent_sandbox_awx.testing import LocalBroker, Policy

    fd_limit = _raise_fd_limit()
    counts = [int(c) for c in args.counts.split(",")]
    policy = Policy(templates=("python",), namespace="gitlab-ci", max_sandboxes=max(counts) + 10)
    print(f"machine: {os.cpu_count()} cores; RLIMIT_NOFILE soft limit {fd_limit}")
    with LocalBroker(gitlab_policy=policy, warn=False) as broker:
        token = broker.issue_gitlab_token("group/project", ttl=3600)
        _spawn(broker, token, "cycles", "2", "own")  # warm-up: fork server, issuer keys
        print("concurrent create -> commands.run('true') -> kill cycles, one event loop")
        print(
            f"{'N':>5} {'clients':>8} {'wall s':>8} {'cycles/s':>9} {'peak RSS MiB':>13} "
            f"{'(start MiB)':>11} {'fetches':>8} {'failed':>7}"
        )
        for count in counts:
            for mode in ("own", "shared"):
                r = _spawn(broker, token, "cycles", str(count), mode)
                label = "1/sbx" if mode == "own" else "shared"
                print(
                    f"{count:>5} {label:>8} {r['wall_s']:8.2f} {count / r['wall_s']:9.1f} "
                    f"{r['peak_rss_mib']:13.1f} {r['rss_before_mib']:11.1f} {r['fetches']:>8} "
                    f"{r['failures']:>7}"
                )
                if r["first_failure"]:
                    print(f"      first failure: {r['first_failure']}")
                left = [c for c in broker.claims()]
                if left:
                    print(f"      {len(left)} claims left after the run")
        r = _spawn(broker, token, "overhead", str(args.runs))
        sync_median = statistics.median(r["sync"])
        async_median = statistics.median(r["async"])
        print(f"per-call overhead: commands.run('true') x{args.runs}, sequential, one sandbox")
        print(f"  sync client  median {sync_median * 1e3:7.2f} ms")
        print(f"  async client median {async_median * 1e3:7.2f} ms")
        print(f"  async / sync ratio of medians: {async_median / sync_median:.2f}x")


if __name__ == "__main__":
    main()
