"""Per-call cost of ``commands.run("true")`` on every path, side by side in one run.

    python bench/bench_paths.py [--n 300] [--rounds 6] [--warmup 30]

Paths (the same bundled runtime process behind all of them, one local broker, one identity):

  A  upstream client -> runtime        k8s_agent_sandbox ``Sandbox`` over a
                                       ``SandboxDirectConnectionConfig`` aimed at the runtime's
                                       plain-HTTP address (no TLS, no auth): the baseline
  B  upstream client -> broker         the same client aimed at the local broker (HTTPS,
                                       ``ca_cert``, ``Authorization: Bearer`` in
                                       ``extra_headers``, router headers from the sandbox
                                       id/namespace and ``server_port``)
  C  our client -> broker              ``k8s_agent_sandbox_awx.Sandbox`` (credential chain reading
                                       the projected token file, audience pinning, retries)
  D  our client -> runtime             our transport aimed at the runtime's plain-HTTP address
                                       (``allow_insecure_http``, a token whose audience is that
                                       address; the runtime ignores the bearer and router headers)

The calls are interleaved: ``--rounds`` rounds, each running ``n / rounds`` calls on every path in
turn, so a noisy neighbour slows all paths alike. Ratios are against path A of the same run.
Also printed: the broker hop (B - A, C - D) and the client overhead (C - B, D - A), and per call
the CPU time of the calling thread (the client's own work) and of the broker's event-loop thread
(the hop's work): CPU time is far less disturbed by a busy machine than wall time. Prints
numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from k8s_agent_sandbox.models import SandboxDirectConnectionConfig
from k8s_agent_sandbox.sandbox import Sandbox as UpstreamSandbox

from k8s_agent_sandbox_awx import BrokerSandboxClient, Sandbox
from k8s_agent_sandbox_awx.client._commands import Commands
from k8s_agent_sandbox_awx.testing import LocalBroker


class _NoKubernetes:
    """Stands in for upstream's ``K8sHelper`` (which would load a kubeconfig): no cluster here,
    so no pod IP and no ``X-Sandbox-Pod-IP`` header."""

    injected_api_client = None

    def get_sandbox(self, name: str, namespace: str) -> dict[str, Any]:
        return {}


def _upstream(name: str, namespace: str, config: SandboxDirectConnectionConfig) -> Any:
    return UpstreamSandbox(
        claim_name=name,
        sandbox_id=name,
        namespace=namespace,
        connection_config=config,
        k8s_helper=_NoKubernetes(),  # type: ignore[arg-type]
    )


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="calls per path (default 300)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaving rounds (default 6)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls per path first")
    args = parser.parse_args()
    os.environ["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"

    # host processes: the paths straight to the runtime need its address on this host (under
    # bubblewrap the runtime listens inside the sandbox, behind the broker only)
    with LocalBroker(warn=False, isolation="none") as broker:
        env = broker.environ("kubernetes")
        env["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        with open(env["AGENT_SANDBOX_TOKEN_FILE"]) as fh:
            token = fh.read().strip()
        with Sandbox.create(environ=env) as ours:
            name, namespace = ours.name, ours.info.router.namespace
            record = broker._require_store().sandboxes[name]
            assert record.handle is not None
            runtime = f"http://{record.handle.host}:{record.handle.port}"

            up_direct = _upstream(name, namespace, SandboxDirectConnectionConfig(api_url=runtime))
            up_broker = _upstream(
                name,
                namespace,
                SandboxDirectConnectionConfig(
                    api_url=broker.url,
                    extra_headers={"Authorization": f"Bearer {token}"},
                    ca_cert=broker.ca_bundle,
                ),
            )
            # our transport straight to the runtime: the audience is pinned to the URL it talks
            # to, so it gets a token for that URL (the runtime never looks at it)
            direct_client = BrokerSandboxClient(
                broker_url=runtime,
                allow_insecure_http=True,
                environ={
                    "AGENT_SANDBOX_TOKEN": broker.issue_kubernetes_token(
                        "default", "default", audience=runtime
                    ),
                    "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
                },
            )
            ours_direct = Commands(direct_client._transport, ours.info.router)

            paths: list[tuple[str, str, Callable[[], Any]]] = [
                ("A", "upstream client -> runtime (HTTP)", lambda: up_direct.commands.run("true")),
                (
                    "B",
                    "upstream client -> broker (HTTPS, JWT) -> runtime",
                    lambda: up_broker.commands.run("true"),
                ),
                (
                    "C",
                    "our client -> broker (HTTPS, JWT) -> runtime",
                    lambda: ours.commands.run("true"),
                ),
                ("D", "our client -> runtime (HTTP)", lambda: ours_direct.run("true")),
            ]
            for _, label, call in paths:
                result = call()
                assert result.exit_code == 0, (label, result)
                for _ in range(args.warmup):
                    call()
            samples: dict[str, list[float]] = {key: [] for key, _, _ in paths}
            client_cpu: dict[str, list[float]] = {key: [] for key, _, _ in paths}
            broker_cpu = dict.fromkeys(samples, 0.0)
            per_round = max(1, args.n // args.rounds)
            for _ in range(args.rounds):
                for key, _, call in paths:
                    times, cpu = samples[key], client_cpu[key]
                    broker_before = _broker_cpu(broker)
                    for _ in range(per_round):
                        c = time.thread_time()
                        t = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - t)
                        cpu.append(time.thread_time() - c)
                    broker_cpu[key] += _broker_cpu(broker) - broker_before
            direct_client.close()
            up_direct.close_connection()
            up_broker.close_connection()

    med = {key: _stats(values)[0] for key, values in samples.items()}
    n = len(samples["A"])
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"commands.run('true'), {n} calls per path in {args.rounds} interleaved rounds; {when}; "
        f"{os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print()
    print("| path | | median | p90 | vs A | client CPU | broker CPU |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for key, label, _ in paths:
        median, p90 = _stats(samples[key])
        cpu_us = statistics.median(client_cpu[key]) * 1e6
        hop = broker_cpu[key] / len(samples[key]) * 1e6
        print(
            f"| {key} | {label} | {median * 1e3:.2f} ms | {p90 * 1e3:.2f} ms | "
            f"{median / med['A']:.2f}x | {cpu_us:.0f} µs | {f'{hop:.0f} µs' if hop > 0 else '-'} |"
        )
    print()
    print(
        "client CPU: median CPU time of the calling thread per call; broker CPU: CPU time of "
        "the broker's event-loop thread per call (TLS, token check, proxy)"
    )
    print(f"broker hop, upstream client (B - A): {(med['B'] - med['A']) * 1e3:.2f} ms")
    print(f"broker hop, our client      (C - D): {(med['C'] - med['D']) * 1e3:.2f} ms")
    print(
        f"our client vs upstream's, through the broker (C / B): {med['C'] / med['B']:.2f}x "
        f"({(med['C'] - med['B']) * 1e3:+.2f} ms)"
    )
    print(
        f"our client vs upstream's, straight to the runtime (D / A): {med['D'] / med['A']:.2f}x "
        f"({(med['D'] - med['A']) * 1e3:+.2f} ms)"
    )


if __name__ == "__main__":
    main()
