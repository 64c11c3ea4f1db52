"""Per-call cost of ``commands.run`` on every path, side by side in one run, sync and async.

    python bench/bench_paths.py [--n 300] [--rounds 6] [--warmup 30] [--no-async]

Paths (the same bundled runtime process behind all of them, one local broker, one identity):

  A  upstream client -> runtime        k8s_agent_sandbox ``Sandbox`` over a
                                       ``SandboxDirectConnectionConfig`` aimed at the runtime's
                                       plain-HTTP address (no TLS, no auth): the baseline;
                                       ``commands.run("true")`` (``POST /execute``)
  B  upstream client -> broker         the same client aimed at the local broker (HTTPS,
                                       ``ca_cert``, ``Authorization: Bearer`` in
                                       ``extra_headers``, router headers from the sandbox
                                       id/namespace and ``server_port``)
  C  our client -> broker              ``k8s_agent_sandbox_awx.Sandbox`` (credential chain reading
                                       the projected token file, audience pinning, retries);
                                       ``commands.run(["true"])`` (the streamed start)
  D  our client -> runtime             our transport aimed at the runtime's plain-HTTP address
                                       (``allow_insecure_http``, a token whose audience is that
                                       address; the runtime ignores the bearer and router headers)

and the same with the async clients (``aA`` ... ``aD``: upstream's ``AsyncSandbox``, our
``AsyncSandbox`` and our async transport aimed at the runtime; one event loop on this thread,
``run_until_complete`` per call) unless ``--no-async`` (upstream's async client needs its
``[async]`` extra: ``pip install "k8s-agent-sandbox[async]"``).

The calls are interleaved: ``--rounds`` rounds, each running ``n / rounds`` calls on every path in
turn, so a noisy neighbour slows all paths alike. Wall ratios are against path A of the same run.
Also printed: the broker hop (B - A, C - D), and per call the CPU time of the calling thread (the
client's own work: ``time.thread_time``, which counts the thread's system time too) and of the
broker's event-loop thread (the hop's work): CPU time is far less disturbed by a busy machine
than wall time. The last lines are issue 29's goal 2: our client's CPU per call against
upstream's on the same path (C / B, D / A, sync and async). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import platform
import statistics
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from _upstream import upstream_async_sandbox, upstream_paths

from k8s_agent_sandbox_awx import (
    AsyncBrokerSandboxClient,
    AsyncSandbox,
    BrokerSandboxClient,
    Sandbox,
)
from k8s_agent_sandbox_awx.client._async_commands import AsyncCommands
from k8s_agent_sandbox_awx.client._commands import Commands
from k8s_agent_sandbox_awx.testing import LocalBroker

Path = tuple[str, str, Callable[[], Any]]


def _on(
    loop: asyncio.AbstractEventLoop, call: Callable[[], Coroutine[Any, Any, Any]]
) -> Callable[[], Any]:
    """``call``'s coroutine run to its end on ``loop``, a new one each time."""
    return lambda: loop.run_until_complete(call())


def _broker_cpu(broker: LocalBroker) -> float:
    """CPU seconds the broker's event-loop thread has used so far (read on that thread)."""
    loop = broker._loop
    assert loop is not None
    future = asyncio.run_coroutine_threadsafe(_thread_time(), loop)
    return future.result(10)


async def _thread_time() -> float:
    return time.thread_time()


def _stats(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    p90 = ordered[max(0, int(len(ordered) * 0.9) - 1)]
    return statistics.median(ordered), p90


def _sync_paths(
    broker: LocalBroker, env: dict[str, str], ours: Sandbox, runtime: str, token: str
) -> list[Path]:
    name, namespace = ours.name, ours.info.router.namespace
    up_direct, up_broker = upstream_paths(
        name, namespace, runtime, broker.url, token, broker.ca_bundle
    )
    # our transport straight to the runtime: the audience is pinned to the URL it talks to, so
    # it gets a token for that URL (the runtime never looks at it)
    direct_client = BrokerSandboxClient(
        broker_url=runtime, allow_insecure_http=True, environ=_env(broker, runtime)
    )
    direct = Commands(direct_client._transport, ours.info.router)
    return [
        ("A", "upstream client -> runtime (HTTP)", lambda: up_direct.commands.run("true")),
        (
            "B",
            "upstream client -> broker (HTTPS, JWT) -> runtime",
            lambda: up_broker.commands.run("true"),
        ),
        ("C", "our client -> broker (HTTPS, JWT) -> runtime", lambda: ours.commands.run(["true"])),
        ("D", "our client -> runtime (HTTP)", lambda: direct.run(["true"])),
    ]


def _env(broker: LocalBroker, runtime: str) -> dict[str, str]:
    return {
        "AGENT_SANDBOX_TOKEN": broker.issue_kubernetes_token(
            "default", "default", audience=runtime
        ),
        "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
    }


async def _async_paths(
    broker: LocalBroker, env: dict[str, str], name: str, runtime: str, token: str
) -> tuple[list[tuple[str, str, Callable[[], Coroutine[Any, Any, Any]]]], list[Any]]:
    """The async paths (their coroutine functions) and what to close at the end."""
    ours = await AsyncSandbox.connect(name, environ=env)
    namespace = ours.info.router.namespace
    up_direct, up_broker = upstream_paths(
        name, namespace, runtime, broker.url, token, broker.ca_bundle, upstream_async_sandbox
    )
    direct_client = AsyncBrokerSandboxClient(
        broker_url=runtime, allow_insecure_http=True, environ=_env(broker, runtime)
    )
    direct = AsyncCommands(direct_client._transport, ours.info.router)
    paths = [
        ("aA", "async upstream client -> runtime (HTTP)", lambda: up_direct.commands.run("true")),
        (
            "aB",
            "async upstream client -> broker -> runtime",
            lambda: up_broker.commands.run("true"),
        ),
        ("aC", "async our client -> broker -> runtime", lambda: ours.commands.run(["true"])),
        ("aD", "async our client -> runtime (HTTP)", lambda: direct.run(["true"])),
    ]
    return paths, [
        up_direct.close_connection,
        up_broker.close_connection,
        direct_client.close,
        ours.close_connection,
    ]


def _measure(broker: LocalBroker, paths: list[Path], args: argparse.Namespace) -> dict[str, Any]:
    """Warm up every path, then run them interleaved: wall and thread CPU per call, and the
    broker thread's CPU per path."""
    for _, label, call in paths:
        result = call()
        assert result.exit_code == 0, (label, result)
        for _ in range(args.warmup):
            call()
    wall: dict[str, list[float]] = {key: [] for key, _, _ in paths}
    cpu: dict[str, list[float]] = {key: [] for key, _, _ in paths}
    hop = dict.fromkeys(wall, 0.0)
    per_round = max(1, args.n // args.rounds)
    for round_ in range(args.rounds):
        turn = paths[round_ % len(paths) :] + paths[: round_ % len(paths)]  # the order rotates
        for key, _, call in turn:
            times, cpus = wall[key], cpu[key]
            broker_before = _broker_cpu(broker)
            for _ in range(per_round):
                c = time.thread_time()
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
                cpus.append(time.thread_time() - c)
            hop[key] += _broker_cpu(broker) - broker_before
    return {"wall": wall, "cpu": cpu, "hop": hop}


def _report(paths: list[Path], figures: dict[str, Any], base: str) -> dict[str, float]:
    wall, cpu, hop = figures["wall"], figures["cpu"], figures["hop"]
    med = {key: _stats(values)[0] for key, values in wall.items()}
    print(f"| path | | median | p90 | vs {base} | client CPU | broker CPU |")
    print("|---|---|---:|---:|---:|---:|---:|")
    cpu_med = {}
    for key, label, _ in paths:
        median, p90 = _stats(wall[key])
        cpu_med[key] = statistics.median(cpu[key]) * 1e6
        per_hop = hop[key] / len(wall[key]) * 1e6
        print(
            f"| {key} | {label} | {median * 1e3:.2f} ms | {p90 * 1e3:.2f} ms | "
            f"{median / med[base]:.2f}x | {cpu_med[key]:.0f} µs | "
            f"{f'{per_hop:.0f} µs' if per_hop > 0 else '-'} |"
        )
    print()
    return cpu_med


def _goal(cpu: dict[str, float], prefix: str = "") -> None:
    a, b, c, d = (cpu[prefix + key] for key in "ABCD")
    print(
        f"{prefix or 'sync'}: our client's CPU per call / upstream's: through the broker "
        f"(C / B) {c / b:.2f}x ({c - b:+.0f} µs), straight to the runtime (D / A) "
        f"{d / a:.2f}x ({d - a:+.0f} µs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="calls per path (default 300)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaving rounds (default 6)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls per path first")
    parser.add_argument("--no-async", action="store_true", help="only the sync paths")
    args = parser.parse_args()
    if not args.no_async and importlib.util.find_spec("kubernetes_asyncio") is None:
        print("upstream's async client needs its [async] extra (kubernetes_asyncio): sync only")
        args.no_async = True
    os.environ["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"

    # host processes: the paths straight to the runtime need its address on this host (under
    # bubblewrap the runtime listens inside the sandbox, behind the broker only)
    with LocalBroker(warn=False, isolation="none") as broker:
        env = broker.environ("kubernetes")
        env["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        with open(env["AGENT_SANDBOX_TOKEN_FILE"]) as fh:
            token = fh.read().strip()
        with Sandbox.create(environ=env) as ours:
            record = broker._require_store().sandboxes[ours.name]
            assert record.handle is not None
            runtime = f"http://{record.handle.host}:{record.handle.port}"
            paths = _sync_paths(broker, env, ours, runtime, token)
            sync = _measure(broker, paths, args)
            if not args.no_async:
                loop = asyncio.new_event_loop()
                made, closers = loop.run_until_complete(
                    _async_paths(broker, env, ours.name, runtime, token)
                )
                apaths = [(key, label, _on(loop, fn)) for key, label, fn in made]
                asynchronous = _measure(broker, apaths, args)
                for close in closers:
                    loop.run_until_complete(close())
                loop.close()

    n = len(sync["wall"]["A"])
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"commands.run, {n} calls per path in {args.rounds} interleaved rounds; {when}; "
        f"{os.cpu_count()} cores (load average {load}), Python {platform.python_version()}"
    )
    print()
    cpu = _report(paths, sync, "A")
    if not args.no_async:
        cpu |= _report(apaths, asynchronous, "aA")
    print(
        "client CPU: median CPU time of the calling thread per call; broker CPU: CPU time of "
        "the broker's event-loop thread per call (TLS, token check, proxy)"
    )
    med = {key: _stats(values)[0] for key, values in sync["wall"].items()}
    print(f"broker hop, upstream client (B - A): {(med['B'] - med['A']) * 1e3:.2f} ms")
    print(f"broker hop, our client      (C - D): {(med['C'] - med['D']) * 1e3:.2f} ms")
    _goal(cpu)
    if not args.no_async:
        _goal(cpu, "a")


if __name__ == "__main__":
    main()
