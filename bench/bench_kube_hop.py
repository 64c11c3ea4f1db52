"""The broker's data-plane hop on the Kubernetes backend against the local backend, same run.

Run (the API server's binaries from ``.ci/kube-tools``; the test helpers are imported):
``PYTHONPATH=src:. python bench/bench_kube_hop.py [--n 300] [--rounds 6] [--breakdown 300]``.
Prints numbers and ratios against baselines measured in the same run; asserts nothing
(docs/performance.md, "The Kubernetes hop").

Two ``broker serve`` processes with the same configuration but the backend (one identity: the
API server's ServiceAccount tokens; one policy; HTTPS with a CA made for the run): one over the
Kubernetes backend (pod data plane, the stand-in controller's pods: the built-in runtime,
``python -m k8s_agent_sandbox_awx.broker.runtime --host 127.x.y.z --port P``), one over the
local backend with host processes running that same command line (its template). One sandbox
on each, and on each backend four paths of ``commands.run``: upstream's of ``"true"`` (its
runtime's ``/execute`` splits it and runs it without a shell), ours of ``["true"]`` (the same
argv without a shell: ours runs a string through bash, two more execs, about 1.2 ms):

  A  upstream's client -> the runtime directly (``SandboxDirectConnectionConfig``, plain HTTP)
  B  upstream's client -> the broker (HTTPS, ``Authorization: Bearer``) -> the runtime
  C  our client (``Sandbox.commands.run``) -> the broker -> the runtime
  D  our client's transport -> the runtime directly (``allow_insecure_http``)
  F  upstream's client -> a relay that does nothing (bench/_floor_proxy.py: HTTPS, the same
     certificate, no checks) -> the runtime: the floor of any process in the middle on this
     machine, so that B / F is what the broker's own work adds above it
  G  our client's transport -> that relay -> the runtime (C's floor: C / G)

The paths are interleaved (``--rounds`` rounds, each ``n / rounds`` calls per path, the
order rotating). Per call: wall time, the calling thread's CPU time (the client's own work:
``time.thread_time``; the client is synchronous, its work is on that thread) and, per batch,
the CPU time of the process in the middle (the broker's, the relay's) over its calls (all its
threads' ``schedstat`` run time, ns).
Goals (issue 29): the Kubernetes hop (B - A) <= the local hop + 10 %; B / A <= 1.3 on both;
our client's CPU per call <= upstream's (C vs B, D vs A).

Then ``--breakdown`` calls of upstream's client (path B) through two more ``broker serve``
processes of the same configurations with a per-phase clock (bench/_timed_hop.py), interleaved:
per phase the median wall and broker-thread CPU time, Kubernetes against local.

``--async``: on each backend four more paths, ``aA`` to ``aD``, the same with the async clients
(upstream's ``AsyncSandbox``, its ``[async]`` extra; our ``AsyncSandbox`` and async transport),
one event loop on the calling thread, ``run_until_complete`` per call: the broker is another
process here, so the client thread's CPU is the client's alone (bench/bench_paths.py runs its
broker on a thread of its own process, where a system call of the client's may hand the GIL to
the broker's thread).

``--baseline-src ../main/src``: two more brokers (and two more timed ones) run that tree's
package, their paths interleaved with these: the same figures for both, and this broker's CPU
per request against the baseline's, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from _upstream import upstream_async_sandbox, upstream_paths
from bench_kubernetes import Cluster

from k8s_agent_sandbox_awx import (
    AsyncBrokerSandboxClient,
    AsyncSandbox,
    BrokerSandboxClient,
    Sandbox,
)
from k8s_agent_sandbox_awx.client._async_commands import AsyncCommands
from k8s_agent_sandbox_awx.client._commands import Commands
from tests._support.broker_server import CLI, Served
from tests._support.kube import free_ports
from tests._support.kube_broker import write_config

TIMED_HOP = Path(__file__).with_name("_timed_hop.py")
FLOOR_PROXY = Path(__file__).with_name("_floor_proxy.py")
LOCAL_RUNTIME = (
    "{python} -m k8s_agent_sandbox_awx.broker.runtime --host {host} --port {port} "
    "--base-dir {base_dir}"
)
"""The stand-in pods' command line (tests/_support/_kubelet.py ``runtime_argv``)."""


def process_cpu(pid: int) -> float:
    """Seconds of CPU all threads of ``pid`` have run (``schedstat``: nanoseconds, not ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total / 1e9


def serve(
    cluster: Cluster,
    name: str,
    backend: str,
    timings: Path | None = None,
    src: str | None = None,
) -> Served:
    """A ``broker serve`` process of the run's configuration over ``backend`` (``src``: the
    package's source folder it runs, first on its ``PYTHONPATH``; else this one's)."""
    [port] = free_ports(1)
    conf = write_config(
        cluster.folder / f"{name}.toml", cluster.identity, cluster.pki, port, max_sandboxes=1000
    )
    if backend == "local":
        text = conf.read_text()
        conf.write_text(
            text[: text.index("[backend]")] + '[backend]\nkind = "local"\n\n'
            f"[backend.local.templates]\npython = {LOCAL_RUNTIME!r}\n"
        )
    cli = CLI if timings is None else [sys.executable, str(TIMED_HOP), str(timings)]
    env = {"AGENT_SANDBOX_LOCAL_ISOLATION": "none"}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    # its output (an access line per request) to files: read by a thread here, it competed
    # with the timed calls for this process's GIL (paths B and C only)
    argv = [*cli, "broker", "serve", "--config", str(conf)]
    served = Served.start(argv, env=env, logs=cluster.folder / f"{name}-output")
    cluster.stack.callback(served.stop)
    served.url = served.wait_started(60)
    deadline = time.monotonic() + 30
    with httpx.Client(verify=ssl.create_default_context(cafile=cluster.ca)) as c:
        while c.get(served.url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, served.output()
            time.sleep(0.05)
    return served


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def local_runtime_url(broker: Served, name: str) -> str:
    """The runtime of the local sandbox ``name`` (its command line names its directory)."""
    for pid in _descendants(broker.process.pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--port" in argv and any(name.encode() in a for a in argv):
                host = argv[argv.index(b"--host") + 1].decode()
                return f"http://{host}:{argv[argv.index(b'--port') + 1].decode()}"
    raise AssertionError(f"no runtime process of sandbox {name!r} under the local broker")


def _direct_env(cluster: Cluster, runtime: str) -> dict[str, str]:
    """Our transport's environment straight to ``runtime``: a token whose audience is that
    address (the runtime ignores it), no plugins."""
    return {
        "AGENT_SANDBOX_TOKEN": cluster.kube.token_request(cluster.ns, "agent", runtime),
        "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
    }


def floor_proxy(
    cluster: Cluster, stack: contextlib.ExitStack, runtime: str
) -> tuple[str, subprocess.Popen[str]]:
    """A relay that does nothing (bench/_floor_proxy.py) in its own process, HTTPS with the
    brokers' certificate, in front of the ``runtime`` URL: its URL and its process."""
    host, port = runtime.removeprefix("http://").rsplit(":", 1)
    [listen] = free_ports(1)
    argv = [sys.executable, str(FLOOR_PROXY), str(cluster.pki.cert_file)]
    argv += [str(cluster.pki.key_file), str(listen), host, port]
    proxy = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    stack.callback(proxy.wait, 30)
    stack.callback(proxy.terminate)
    assert proxy.stdout is not None and proxy.stdout.readline().strip() == "ready"
    return f"https://127.0.0.1:{listen}", proxy


class Paths:
    """The paths (A-D, F, G) of one backend, on one sandbox of ``broker``."""

    def __init__(
        self,
        cluster: Cluster,
        stack: contextlib.ExitStack,
        label: str,
        broker: Served,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.label, self.broker = label, broker
        env = cluster.environ(broker.url)
        env["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        token = Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text().strip()
        ours = stack.enter_context(Sandbox.create(environ=env))
        router = ours.info.router
        runtime = (
            cluster.controller.pod_url(cluster.ns, ours.sandbox_id)
            if label.startswith("kube")
            else local_runtime_url(broker, ours.sandbox_id)
        )
        up_direct, up_broker = upstream_paths(
            router.sandbox_id, router.namespace, runtime, broker.url, token, cluster.ca
        )
        relay_url, relay = floor_proxy(cluster, stack, runtime)
        _, up_floor = upstream_paths(
            router.sandbox_id,
            router.namespace,
            runtime,
            relay_url,
            token,
            cluster.ca,
        )
        direct_client = BrokerSandboxClient(
            broker_url=runtime,
            allow_insecure_http=True,
            environ=_direct_env(cluster, runtime),
        )
        relay_client = BrokerSandboxClient(
            broker_url=relay_url,
            environ=_direct_env(cluster, relay_url) | {"AGENT_SANDBOX_CA_BUNDLE": cluster.ca},
        )
        stack.callback(direct_client.close)
        stack.callback(relay_client.close)
        stack.callback(up_direct.close_connection)
        stack.callback(up_broker.close_connection)
        stack.callback(up_floor.close_connection)
        ours_direct = Commands(direct_client._transport, router)
        ours_relayed = Commands(relay_client._transport, router)
        # per path: what it is, the call, the process in the middle whose CPU is counted
        self.runs: dict[str, tuple[str, Callable[[], Any], int | None]] = {
            "A": (
                "upstream client -> runtime (HTTP)",
                lambda: up_direct.commands.run("true"),
                None,
            ),
            "B": (
                "upstream client -> broker (HTTPS) -> runtime",
                lambda: up_broker.commands.run("true"),
                broker.process.pid,
            ),
            "C": (
                "our client -> broker (HTTPS) -> runtime",
                lambda: ours.commands.run(["true"]),
                broker.process.pid,
            ),
            "D": ("our client -> runtime (HTTP)", lambda: ours_direct.run(["true"]), None),
            "F": (
                "upstream client -> a relay that does nothing (HTTPS) -> runtime",
                lambda: up_floor.commands.run("true"),
                relay.pid,
            ),
            "G": (
                "our client -> a relay that does nothing (HTTPS) -> runtime",
                lambda: ours_relayed.run(["true"]),
                relay.pid,
            ),
        }
        self.upstream_via_broker = self.runs["B"][1]
        if loop is not None:
            self._add_async(cluster, stack, loop, env, token, runtime, ours.sandbox_id)

    def _add_async(
        self,
        cluster: Cluster,
        stack: contextlib.ExitStack,
        loop: asyncio.AbstractEventLoop,
        env: dict[str, str],
        token: str,
        runtime: str,
        name: str,
    ) -> None:
        """Paths aA-aD: the async clients on ``loop``, the same sandbox."""
        ours = loop.run_until_complete(AsyncSandbox.connect(name, environ=env))
        router = ours.info.router
        up_direct, up_broker = upstream_paths(
            router.sandbox_id,
            router.namespace,
            runtime,
            self.broker.url,
            token,
            cluster.ca,
            upstream_async_sandbox,
        )
        direct_client = AsyncBrokerSandboxClient(
            broker_url=runtime,
            allow_insecure_http=True,
            environ=_direct_env(cluster, runtime),
        )
        closes: list[Callable[[], Coroutine[Any, Any, Any]]] = [
            ours.close_connection,
            up_direct.close_connection,
            up_broker.close_connection,
            direct_client.close,
        ]
        for close in closes:
            stack.callback(loop.run_until_complete, close())
        ours_direct = AsyncCommands(direct_client._transport, router)

        def on_loop(call: Callable[[], Coroutine[Any, Any, Any]]) -> Callable[[], Any]:
            return lambda: loop.run_until_complete(call())

        self.runs |= {
            "aA": (
                "async upstream client -> runtime (HTTP)",
                on_loop(lambda: up_direct.commands.run("true")),
                None,
            ),
            "aB": (
                "async upstream client -> broker -> runtime",
                on_loop(lambda: up_broker.commands.run("true")),
                self.broker.process.pid,
            ),
            "aC": (
                "async our client -> broker -> runtime",
                on_loop(lambda: ours.commands.run(["true"])),
                self.broker.process.pid,
            ),
            "aD": (
                "async our client -> runtime (HTTP)",
                on_loop(lambda: ours_direct.run(["true"])),
                None,
            ),
        }


def _interleave(paths: list[Paths], n: int, rounds: int, warmup: int) -> dict[str, Any]:
    keys = [(p, key) for p in paths for key in p.runs]
    for p, key in keys:
        result = p.runs[key][1]()
        assert result.exit_code == 0, (p.label, key, result)
        for _ in range(warmup):
            p.runs[key][1]()
    wall: dict[str, list[float]] = {f"{p.label} {k}": [] for p, k in keys}
    cpu: dict[str, list[float]] = {name: [] for name in wall}
    broker_cpu = dict.fromkeys(wall, 0.0)
    per_round = max(1, n // rounds)
    for r in range(rounds):
        for p, key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            name, call = f"{p.label} {key}", p.runs[key][1]
            middle = p.runs[key][2]
            before = process_cpu(middle) if middle else 0.0
            for _ in range(per_round):
                c, t = time.thread_time(), time.perf_counter()
                call()
                wall[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - c)
            if middle:
                broker_cpu[name] += process_cpu(middle) - before
    return {"wall": wall, "cpu": cpu, "broker": broker_cpu}


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _report(paths: list[Paths], got: dict[str, Any]) -> None:
    wall, cpu, broker = got["wall"], got["cpu"], got["broker"]
    med = {k: statistics.median(v) for k, v in wall.items()}
    ccpu = {k: statistics.median(v) for k, v in cpu.items()}
    print("| backend | path | | p25 | median | p75 | p90 | vs A | client CPU | middle's CPU |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in paths:
        for key, (label, _, middle) in p.runs.items():
            name = f"{p.label} {key}"
            b = f"{broker[name] / len(wall[name]) * 1e6:.0f} µs" if middle else "-"
            base = f"{p.label} {key[:-1]}A"  # aB's baseline: aA
            print(
                f"| {p.label} | {key} | {label} | {_p(wall[name], 0.25) * 1e3:.2f} ms | "
                f"{med[name] * 1e3:.2f} ms | {_p(wall[name], 0.75) * 1e3:.2f} ms | "
                f"{_p(wall[name], 0.9) * 1e3:.2f} ms | {med[name] / med[base]:.2f}x | "
                f"{ccpu[name] * 1e6:.0f} µs | {b} |"
            )
    print()
    hop = {}
    for p in paths:
        k = p.label
        hop[k] = (med[f"{k} B"] - med[f"{k} A"], med[f"{k} C"] - med[f"{k} D"])
        print(
            f"{k}: hop (B - A) {hop[k][0] * 1e3:.2f} ms, (C - D) {hop[k][1] * 1e3:.2f} ms; "
            f"via the broker / direct: B / A {med[f'{k} B'] / med[f'{k} A']:.2f}x, "
            f"C / D {med[f'{k} C'] / med[f'{k} D']:.2f}x (goal <= 1.3x); broker CPU per "
            f"request {broker[f'{k} B'] / len(wall[f'{k} B']) * 1e6:.0f} µs (B), "
            f"{broker[f'{k} C'] / len(wall[f'{k} C']) * 1e6:.0f} µs (C)"
        )
        for via, relayed, direct in (("B", "F", "A"), ("C", "G", "D")):
            v, r, d = (f"{k} {x}" for x in (via, relayed, direct))
            print(
                f"{k}: a relay that does nothing / direct: {relayed} / {direct} "
                f"{med[r] / med[d]:.2f}x; the broker / that relay: {via} / {relayed} "
                f"{med[v] / med[r]:.2f}x ({(med[v] - med[r]) * 1e3:+.2f} ms); the relay's CPU "
                f"per request {broker[r] / len(wall[r]) * 1e6:.0f} µs"
            )
        for a in ("", "a") if f"{k} aA" in ccpu else ("",):
            print(
                f"{k}: {'async: ' if a else ''}our client's CPU / upstream's: via the broker "
                f"{a}C / {a}B {ccpu[f'{k} {a}C'] / ccpu[f'{k} {a}B']:.2f}x "
                f"({(ccpu[f'{k} {a}C'] - ccpu[f'{k} {a}B']) * 1e6:+.0f} µs), direct {a}D / {a}A "
                f"{ccpu[f'{k} {a}D'] / ccpu[f'{k} {a}A']:.2f}x "
                f"({(ccpu[f'{k} {a}D'] - ccpu[f'{k} {a}A']) * 1e6:+.0f} µs) (goal <= 1.0x)"
            )
    for p in paths:
        base = p.label.removesuffix("-before")
        if base == p.label or not any(q.label == base for q in paths):
            continue
        per = {k: broker[k] / len(wall[k]) for k in broker}
        print(
            f"{base}: this broker / the baseline's (--baseline-src), broker CPU per request: "
            f"B {per[f'{base} B'] / per[f'{p.label} B']:.2f}x "
            f"({per[f'{base} B'] * 1e6:.0f} / {per[f'{p.label} B'] * 1e6:.0f} µs), "
            f"C {per[f'{base} C'] / per[f'{p.label} C']:.2f}x "
            f"({per[f'{base} C'] * 1e6:.0f} / {per[f'{p.label} C'] * 1e6:.0f} µs); wall B / A "
            f"{med[f'{base} B'] / med[f'{base} A']:.2f}x against "
            f"{med[f'{p.label} B'] / med[f'{p.label} A']:.2f}x"
        )
    if "kube" in hop and "local" in hop:
        for i, what in enumerate(("upstream's client (B - A)", "our client (C - D)")):
            k, loc = hop["kube"][i], hop["local"][i]
            print(
                f"Kubernetes hop / local hop, {what}: {k * 1e3:.2f} / {loc * 1e3:.2f} ms = "
                f"{k / loc:.2f}x (goal <= 1.10x)"
            )


def breakdown(paths: list[Paths], timed: dict[str, Path], n: int) -> None:
    """Path B through the timed brokers, interleaved; the per-phase medians side by side."""
    import json

    for _ in range(30):
        for p in paths:
            p.upstream_via_broker()
    for path in timed.values():
        path.write_text("")  # the warm-up's lines dropped
    for _ in range(n):
        for p in paths:
            p.upstream_via_broker()
    time.sleep(0.2)
    lines = {k: [json.loads(x) for x in f.read_text().splitlines() if x] for k, f in timed.items()}
    labels = list(lines)
    print(
        f"\nper phase of one forwarded request (upstream's client, path B, n={n} each; "
        "medians, wall / broker-thread CPU, µs):"
    )
    print("| phase | " + " | ".join(labels) + " | difference |")
    print("|---|" + "---:|" * (len(labels) + 1))
    for phase in lines[labels[0]][0]:
        cells = []
        for k in labels:
            w = statistics.median(x[phase][0] for x in lines[k]) * 1e6
            c = statistics.median(x[phase][1] for x in lines[k]) * 1e6
            cells.append((w, c))
        diff = (cells[0][0] - cells[1][0], cells[0][1] - cells[1][1])  # kube - local
        print(
            f"| {phase} | "
            + " | ".join(f"{w:.0f} / {c:.0f}" for w, c in cells)
            + f" | {diff[0]:+.0f} / {diff[1]:+.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="calls per path")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--breakdown", type=int, default=300, help="timed calls per backend")
    parser.add_argument(
        "--baseline-src",
        help="another tree's src folder (main's): two more brokers run it, interleaved with "
        "these (labels kube-before, local-before), and the ratios of the two are printed",
    )
    parser.add_argument(
        "--async",
        dest="with_async",
        action="store_true",
        help="the async clients' paths too (aA-aD; upstream's needs k8s-agent-sandbox[async])",
    )
    args = parser.parse_args()
    os.environ["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    with contextlib.ExitStack() as stack:
        cluster = Cluster(stack, Path(stack.enter_context(tempfile.TemporaryDirectory())))
        brokers = {
            "kube": serve(cluster, "kube", "kubernetes"),
            "local": serve(cluster, "local", "local"),
        }
        base = args.baseline_src
        if base:
            brokers["kube-before"] = serve(cluster, "kube-before", "kubernetes", src=base)
            brokers["local-before"] = serve(cluster, "local-before", "local", src=base)
        loop = None
        if args.with_async:
            loop = asyncio.new_event_loop()
            stack.callback(loop.close)  # after the clients' closes (registered later)
        paths = [Paths(cluster, stack, label, b, loop) for label, b in brokers.items()]
        load = os.getloadavg()
        when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        got = _interleave(paths, args.n, args.rounds, args.warmup)
        load_after = os.getloadavg()
        print(
            f"commands.run('true' / ['true']), {len(got['wall']['kube A'])} calls per path, "
            f"{args.rounds} interleaved rounds; {when}; {os.cpu_count()} cores; load average "
            f"{load[0]:.1f} before, {load_after[0]:.1f} after\n"
        )
        _report(paths, got)
        if args.breakdown:
            timed = {k: cluster.folder / f"hop-{k}.jsonl" for k in brokers}
            tb = {
                k: serve(
                    cluster,
                    f"{k}-timed",
                    "local" if k.startswith("local") else "kubernetes",
                    timed[k],
                    src=base if k.endswith("-before") else None,
                )
                for k in brokers
            }
            with contextlib.ExitStack() as sandboxes:  # deleted before their brokers stop
                tpaths = [Paths(cluster, sandboxes, label, b) for label, b in tb.items()]
                breakdown(tpaths, timed, args.breakdown)
            for served in tb.values():  # SIGTERM: a BENCH_PROFILE is written at exit
                served.terminate()
                served.wait(60)


if __name__ == "__main__":
    main()
