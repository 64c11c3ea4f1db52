"""Many sandboxes on one Kubernetes replica, measured: concurrency and scale (issue 29, 3 and 5).

Run (the API server's binaries from ``.ci/kube-tools``; the test helpers are imported):
``PYTHONPATH=src:. python bench/bench_kube_scale.py [--sandboxes 500] [--callers 100]
[--calls 20]``. Prints numbers and ratios against baselines measured in the same run; asserts
nothing (docs/performance.md, "Many sandboxes on one replica").

One ``broker serve`` (Kubernetes backend, pod data plane) whose policy puts the claims in a
namespace no controller watches. The sandboxes are made through the broker (``POST
/v1/sandboxes``: its claims, stamps and quota ledger), then each claim is made Ready by a
status write naming a pod IP of ``bench/_pod_farm.py``: one lightweight process listening on
every one of those loopback addresses (500 runtime processes do not fit a small machine; the
farm answers in tens of microseconds, so what is measured through the broker is the broker's).

- **Scale** (goal 5), at ``--small`` and then at ``--sandboxes`` sandboxes: the broker's RSS
  (idle; with the claims in its cache; after one data-plane request to every sandbox), the
  growth per sandbox between the two counts (the slope, so the process's fixed costs drop
  out), its CPU time per data-plane request over a round of every sandbox, and the time a
  restarted replica takes until ``/readyz`` and until a data-plane request answers, against
  the same restart with no claims (its first start).
- **Concurrency** (goal 3): ``--callers`` callers at once, each on its own sandbox, each
  sending ``--calls`` ``POST /execute`` one after the other (the request upstream's client
  sends for ``commands.run``), as threads (one ``httpx.Client`` each) and as asyncio tasks
  (one ``httpx.AsyncClient`` each): throughput and p50/p99 through the broker against the same
  load straight to the pods (the farm), same run. Goal: p99 through the broker <= 1.5x direct.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import os
import random
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from bench_kube_hop import process_cpu
from bench_kubernetes import Cluster

from tests._support._api import CLAIM, path
from tests._support.broker_server import CLI, Served
from tests._support.kube import free_ports
from tests._support.kube_broker import write_config

FARM = Path(__file__).with_name("_pod_farm.py")
FARM_PORT = 8888


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Farm:
    """bench/_pod_farm.py on ``count`` addresses of a random ``127.x.y`` block."""

    def __init__(self, stack: contextlib.ExitStack, count: int) -> None:
        self.prefix = f"127.{random.randrange(100, 250)}.{random.randrange(0, 200)}"
        self.process = subprocess.Popen(
            [sys.executable, str(FARM), self.prefix, str(count), str(FARM_PORT)],
            stdout=subprocess.PIPE,
            text=True,
        )
        stack.callback(self.process.kill)
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready", "the pod farm did not start"

    def ip(self, i: int) -> str:
        from _pod_farm import address

        return address(self.prefix, i + 1)


class Replica:
    """One ``broker serve`` of the scale configuration (restartable)."""

    def __init__(self, cluster: Cluster, namespace: str, name: str = "scale") -> None:
        [port] = free_ports(1)
        self.cluster = cluster
        self.config = write_config(
            cluster.folder / f"{name}.toml",
            cluster.identity,
            cluster.pki,
            port,
            max_sandboxes=100000,
            namespace=namespace,
        )
        self.served: Served | None = None
        self.url = ""

    def start(self, probe: dict[str, str] | None = None) -> tuple[float, float]:
        """Start it; seconds until ``/readyz`` answers 200, and until a data-plane request with
        the headers ``probe`` answers 200 (0 without ``probe``)."""
        t0 = time.perf_counter()
        served = Served.start([*CLI, "broker", "serve", "--config", str(self.config)])
        self.cluster.stack.callback(served.stop)
        self.served, self.url = served, served.wait_started(120)
        ready = first = 0.0
        with httpx.Client(verify=ssl.create_default_context(cafile=self.cluster.ca)) as c:
            deadline = time.monotonic() + 120
            while c.get(self.url + "/readyz").status_code != 200:
                assert time.monotonic() < deadline, served.output()
                time.sleep(0.01)
            ready = time.perf_counter() - t0
            while probe is not None and c.get(self.url + "/", headers=probe).status_code != 200:
                time.sleep(0.01)
            first = time.perf_counter() - t0 if probe is not None else 0.0
        return ready, first

    def stop(self) -> None:
        assert self.served is not None
        self.served.stop()

    @property
    def pid(self) -> int:
        assert self.served is not None
        return self.served.process.pid


def _headers(name: str, namespace: str, token: str) -> dict[str, str]:
    return {
        "X-Sandbox-ID": name,
        "X-Sandbox-Namespace": namespace,
        "Authorization": f"Bearer {token}",
    }


def make_sandboxes(
    cluster: Cluster,
    replica: Replica,
    farm: Farm,
    names: list[str],
    count: int,
    token: str,
    namespace: str,
) -> None:
    """Sandboxes through the broker until there are ``count``, each made Ready on the farm."""
    context = ssl.create_default_context(cafile=cluster.ca)
    with httpx.Client(verify=context, timeout=60) as c:

        def one(_: int) -> str:
            r = c.post(
                replica.url + "/v1/sandboxes",
                json={"template": "python"},
                headers={"Authorization": f"Bearer {token}"},
            )
            r.raise_for_status()
            return str(r.json()["name"])

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            made = list(pool.map(one, range(count - len(names))))
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

        def ready(item: tuple[int, str]) -> None:
            i, name = item
            cluster.kube.merge_patch(
                path(CLAIM, namespace, name) + "/status",
                {
                    "status": {
                        "conditions": [
                            {
                                "type": "Ready",
                                "status": "True",
                                "reason": "SandboxReady",
                                "message": "",
                                "lastTransitionTime": now,
                                "observedGeneration": 1,
                            }
                        ],
                        "sandbox": {"name": name, "podIPs": [farm.ip(i)]},
                    }
                },
            )

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(ready, enumerate(made, start=len(names))))
        names.extend(made)
        last = _headers(names[-1], namespace, token)
        while c.get(replica.url + "/", headers=last).status_code != 200:  # the cache has them
            time.sleep(0.05)


def use_all(
    cluster: Cluster, replica: Replica, names: list[str], token: str, namespace: str
) -> tuple[float, float]:
    """One ``GET /`` of every sandbox, 32 at a time: (seconds, broker CPU per request)."""
    context = ssl.create_default_context(cafile=cluster.ca)
    limits = httpx.Limits(max_connections=32)
    with httpx.Client(verify=context, limits=limits, timeout=60) as c:

        def one(name: str) -> None:
            c.get(replica.url + "/", headers=_headers(name, namespace, token)).raise_for_status()

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            list(pool.map(one, names[:32]))  # the connections made
            cpu, t = process_cpu(replica.pid), time.perf_counter()
            list(pool.map(one, names))
            return time.perf_counter() - t, (process_cpu(replica.pid) - cpu) / len(names)


def scale(
    cluster: Cluster,
    replica: Replica,
    farm: Farm,
    args: argparse.Namespace,
    token: str,
    namespace: str,
) -> list[str]:
    names: list[str] = []
    idle = rss_mib(replica.pid)
    rows = []
    for count in (args.small, args.sandboxes):
        make_sandboxes(cluster, replica, farm, names, count, token, namespace)
        time.sleep(1)
        cached = rss_mib(replica.pid)
        use_all(cluster, replica, names, token, namespace)
        _, cpu = use_all(cluster, replica, names, token, namespace)
        rows.append((count, cached, rss_mib(replica.pid), cpu))
    print(f"scale: broker RSS idle {idle:.1f} MiB")
    for count, cached, used, cpu in rows:
        print(
            f"  {count} sandboxes: RSS with the claims cached {cached:.1f} MiB, after a request "
            f"to each {used:.1f} MiB; broker CPU {cpu * 1e6:.0f} µs per data-plane request"
        )
    (n0, c0, u0, _), (n1, c1, u1, _) = rows
    print(
        f"  per sandbox (slope {n0} -> {n1}): {(c1 - c0) / (n1 - n0) * 1024:.0f} KiB cached claim"
        f" + {((u1 - c1) - (u0 - c0)) / (n1 - n0) * 1024:.0f} KiB once used = "
        f"{(u1 - u0) / (n1 - n0) * 1024:.0f} KiB; against idle: "
        f"{(u1 - idle) / n1 * 1024:.0f} KiB (baseline: 711 KiB extrapolated from 30 before)"
    )
    return names


def restart(replica: Replica, first: tuple[float, float], probe: dict[str, str], n: int) -> None:
    replica.stop()
    again = replica.start(probe)
    print(
        f"restart with {n} claims: /readyz after {again[0]:.2f} s, the first data-plane answer "
        f"after {again[1]:.2f} s; baseline, the first start with no claims: /readyz after "
        f"{first[0]:.2f} s"
    )


@contextlib.contextmanager
def _callers_without_gc() -> Any:
    """The callers' own garbage collector kept out of the figures: what exists is frozen and
    collection paused while the callers run (the same for every load). A full collection in
    this process, with a hundred clients' objects alive, took 45-140 ms here and landed in
    whichever load ran at the time: its p99, not the broker's."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        gc.collect()


def _threads(urls: list[tuple[str, dict[str, str]]], calls: int, verify: Any) -> list[float]:
    out: list[float] = []
    lock, start = threading.Lock(), threading.Barrier(len(urls))

    def caller(url: str, headers: dict[str, str]) -> None:
        mine = []
        with httpx.Client(verify=verify, timeout=120) as c:
            c.post(url + "/execute", json={"command": "true"}, headers=headers).raise_for_status()
            start.wait()
            for _ in range(calls):
                t = time.perf_counter()
                c.post(url + "/execute", json={"command": "true"}, headers=headers)
                mine.append(time.perf_counter() - t)
        with lock:
            out.extend(mine)

    threads = [threading.Thread(target=caller, args=u) for u in urls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


async def _tasks(urls: list[tuple[str, dict[str, str]]], calls: int, verify: Any) -> list[float]:
    out: list[float] = []
    start = asyncio.Event()
    warm = 0

    async def caller(url: str, headers: dict[str, str]) -> None:
        nonlocal warm
        async with httpx.AsyncClient(verify=verify, timeout=120) as c:
            r = await c.post(url + "/execute", json={"command": "true"}, headers=headers)
            r.raise_for_status()
            warm += 1
            if warm == len(urls):
                start.set()
            await start.wait()
            for _ in range(calls):
                t = time.perf_counter()
                await c.post(url + "/execute", json={"command": "true"}, headers=headers)
                out.append(time.perf_counter() - t)

    await asyncio.gather(*(caller(*u) for u in urls))
    return out


def concurrency(
    cluster: Cluster,
    replica: Replica,
    farm: Farm,
    names: list[str],
    args: argparse.Namespace,
    token: str,
    namespace: str,
) -> None:
    chosen = names[: args.callers]
    via = [(replica.url, _headers(n, namespace, token)) for n in chosen]
    direct = [
        (f"http://{farm.ip(names.index(n))}:{FARM_PORT}", _headers(n, namespace, "x"))
        for n in chosen
    ]
    context = ssl.create_default_context(cafile=cluster.ca)
    print(
        f"concurrency: {len(chosen)} callers at once, each on its own sandbox, "
        f"{args.calls} POST /execute each (load average {os.getloadavg()[0]:.1f}):"
    )
    for kind in ("threads", "asyncio"):
        got = {}
        for label, urls, verify in (
            ("direct", direct, True),
            ("broker", via, context),
            ("direct again", direct, True),
        ):
            with _callers_without_gc():
                cpu, t = process_cpu(replica.pid), time.perf_counter()
                if kind == "threads":
                    samples = _threads(urls, args.calls, verify)
                else:
                    samples = asyncio.run(_tasks(urls, args.calls, verify))
                wall = time.perf_counter() - t
            got[label] = samples
            q = statistics.quantiles(samples, n=100)
            extra = (
                f"; broker CPU {(process_cpu(replica.pid) - cpu) / len(samples) * 1e6:.0f} "
                "µs per request"
                if label == "broker"
                else ""
            )
            print(
                f"  {kind}, {label}: {len(samples) / wall:.0f} requests/s, p50 "
                f"{q[49] * 1e3:.2f} ms, p99 {q[98] * 1e3:.2f} ms{extra}"
            )
        base = got["direct"] + got["direct again"]
        qb, qd = statistics.quantiles(got["broker"], n=100), statistics.quantiles(base, n=100)
        print(
            f"  {kind}: through the broker / direct: p50 {qb[49] / qd[49]:.2f}x, p99 "
            f"{qb[98] / qd[98]:.2f}x (goal <= 1.5x)"
        )


def api_calls(cluster: Cluster) -> dict[str, float]:
    """The API server's request counts so far, per verb, of claims and Leases (its
    ``apiserver_request_total``; watches left out)."""
    counts: dict[str, float] = {}
    for line in cluster.kube.admin.get("/metrics").text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(
            part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",")
        )
        labels = {k: v.strip('"') for k, v in labels.items()}
        resource, verb = labels.get("resource", ""), labels.get("verb", "")
        if resource in ("sandboxclaims", "leases") and verb != "WATCH":
            if resource == "sandboxclaims" and verb == "LIST":
                verb = "GET/LIST"  # 1.20 counts a custom resource's GET as a LIST
            key = f"{verb} {resource}" + ("/status" if labels.get("subresource") else "")
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _caller_tokens(cluster: Cluster, replicas: list[Replica], callers: int) -> list[list[str]]:
    """Per caller, its token for each replica (each replica's own audience): ServiceAccounts
    ``bench-c0`` ... of the policy's namespace (each its own quota ledger)."""
    out = []
    for j in range(callers):
        account = f"bench-c{j}"
        with contextlib.suppress(Exception):  # made by an earlier run of the part
            cluster.kube.create_service_account(cluster.ns, account)
        out.append([cluster.kube.token_request(cluster.ns, account, r.url) for r in replicas])
    return out


def creates(cluster: Cluster, replicas: list[Replica], farm: Farm, n: int, callers: int,
            namespace: str, first: int, per_replica: int) -> None:  # fmt: skip
    """``n`` creates of ``callers`` callers, ``per_replica`` threads per replica (create ``i``:
    caller ``i % callers``), each create: ``POST
    /v1/sandboxes`` (the broker), then the claim made Ready by the bench (the controller's
    part: a status write naming a farm pod, timed and subtracted), then ``GET ?wait=ready``
    (the broker seeing it). The API calls are the API server's counts (claims and Leases)."""
    context = ssl.create_default_context(cafile=cluster.ca)
    tokens = _caller_tokens(cluster, replicas, callers)
    controller: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        url = replicas[i % len(replicas)].url
        auth = {"Authorization": f"Bearer {tokens[i % callers][i % len(replicas)]}"}
        with httpx.Client(verify=context, timeout=60) as c:
            r = c.post(url + "/v1/sandboxes", json={"template": "python"}, headers=auth)
            r.raise_for_status()
            name = str(r.json()["name"])
            t = time.perf_counter()
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            cluster.kube.merge_patch(path(CLAIM, namespace, name) + "/status", {"status": {
                "conditions": [{"type": "Ready", "status": "True", "reason": "SandboxReady",
                                "message": "", "lastTransitionTime": now}],
                "sandbox": {"name": name, "podIPs": [farm.ip(first + i)]}}})  # fmt: skip
            spent = time.perf_counter() - t
            got = c.get(f"{url}/v1/sandboxes/{name}", params={"wait": "ready"}, headers=auth)
            assert got.json()["phase"] == "Ready", got.text
        with lock:
            controller.append(spent)

    threads = per_replica * len(replicas)
    before = api_calls(cluster)
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
    wall = time.perf_counter() - t
    after = api_calls(cluster)
    calls = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    broker_calls = sum(v for k, v in calls.items() if not k.endswith("/status"))
    own = wall - sum(controller) / threads
    print(f"creates, {len(replicas)} replica(s), {n} creates of {callers} caller(s) from "
          f"{threads} threads: "
          f"{n / wall:.1f} creates/s ({n / wall / len(replicas):.1f} per replica); the bench's "
          f"Ready writes (the controller's part) subtracted: {n / own:.1f} creates/s "
          f"({n / own / len(replicas):.1f} per replica); API calls per create "
          f"{broker_calls / n:.2f} (" + ", ".join(f"{k} {v / n:.2f}" for k, v in
          sorted(calls.items()) if not k.endswith("/status")) + ")")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=500)
    parser.add_argument("--small", type=int, default=50, help="the first count of the slope")
    parser.add_argument("--callers", type=int, default=100)
    parser.add_argument("--calls", type=int, default=20, help="requests per caller")
    parser.add_argument("--creates", type=int, default=100, help="creates per replica count")
    parser.add_argument("--parts", default="scr", help="s: scale, c: concurrency, r: creates")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        cluster = Cluster(stack, Path(stack.enter_context(tempfile.TemporaryDirectory())))
        namespace = cluster.kube.create_namespace()  # no controller watches it
        cluster.identity.bind(namespace)  # the broker's role there
        base = max(args.sandboxes, args.callers)
        farm = Farm(stack, base + 5 * args.creates)
        replica = Replica(cluster, namespace)
        first = replica.start()
        env = cluster.environ(replica.url)
        token = Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text().strip()
        print(
            f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}; {os.cpu_count()} cores; load average "
            f"{os.getloadavg()[0]:.1f}"
        )
        if "s" in args.parts:
            names = scale(cluster, replica, farm, args, token, namespace)
            restart(replica, first, _headers(names[-1], namespace, token), len(names))
        else:
            names = []
            make_sandboxes(cluster, replica, farm, names, args.callers, token, namespace)
        if "c" in args.parts:
            concurrency(cluster, replica, farm, names, args, token, namespace)
        if "r" in args.parts:
            second = Replica(cluster, namespace, "scale-2")
            second.start()
            runs = (([replica], 1, 1), ([replica], 4, 1), ([replica], 4, 4),
                    ([replica, second], 4, 8), ([replica, second], 4, 1))  # fmt: skip
            for i, (replicas, per, callers) in enumerate(runs):
                creates(cluster, replicas, farm, args.creates, callers, namespace,
                        base + i * args.creates, per)  # fmt: skip


if __name__ == "__main__":
    main()
