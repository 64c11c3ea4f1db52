"""Benchmark of the Kubernetes backend: create-to-ready over the watch, the data-plane hop,
and many sandboxes on one replica (docs/performance.md, "Kubernetes backend").

Run (the API server's binaries from ``.ci/kube-tools``; the test helpers are imported):
``PYTHONPATH=src:. python bench/bench_kubernetes.py [--creates N] [--hops N] [--sandboxes N]``.
Prints numbers and ratios against baselines measured in the same run; asserts nothing.

- (a) create -> ready through ``broker serve`` (a process, pod data plane) on a real API server,
  minus the stand-in controller's own time (``controller.timings``: from its watch seeing the
  claim to its write of Ready returning) and minus one broker round trip of the same client
  (``GET /v1/sandboxes``: TLS, token, answer), in units of one API GET of a claim. Then the
  same creates on a second ``broker serve`` with timestamps (bench/_timed_broker.py: its HTTP
  requests, its API calls, its claim cache's events; the stand-in's ``timings``; one clock,
  ``time.perf_counter``), decomposed per phase: the critical path (its phases sum to the
  create's time; the quota ledger's write is on it, before the claim's POST) and the steps off
  it, which overlap the stand-in's work. Baselines in the
  same run, on copies of the broker's claim in a namespace no controller watches: one API GET,
  POST and LIST, and the API server's own watch delivery (a PATCH -> its event on a watch).
  ``BENCH_EVENTS=1`` also prints the raw events of the last create.
- (b) one data-plane ``GET /`` of the runtime: directly (the pod), through the stand-in
  router alone (tests/_support/kube_broker.py's ``StandInRouter``: plain HTTP, its bearer
  token, request bodies buffered), through the broker in pod mode and in router mode (the
  broker, then the stand-in router). Hops: router = router - direct; broker (pod mode) =
  broker - direct; broker in front of the router = broker(router mode) - router.
  With ``--upstream-router URL`` (a running upstream sandbox_router.py; ``--upstream-router-token
  FILE``: its ROUTER_AUTH_TOKEN), two more rows in the same run: that router alone and a third
  broker in router mode in front of it (``router_url`` = URL, ``router_token_file`` = FILE);
  the baseline of the broker's hop is then upstream's router hop (upstream - direct). That
  router resolves ``{X-Sandbox-ID}.{namespace}.svc.cluster.local``: for the run the bench
  appends a line per sandbox (its Sandbox's name -> its pod's loopback IP) to
  ``--upstream-hosts-file`` (default /etc/hosts; it must be writable) and writes the file's
  exact bytes back afterwards. The rows are then timed interleaved (one request of each row per
  round, the order rotating), medians and p90s printed.
- (c) ``--sandboxes`` sandboxes at once on one replica (each a stand-in pod: a runtime process),
  every one used concurrently: the broker process's RSS (idle, then with them) and its CPU
  time per data-plane request. Figures for 500 are extrapolated linearly from the measured
  per-sandbox RSS (500 runtime processes do not fit a small machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import operator
import os
import ssl
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from k8s_agent_sandbox_awx import Sandbox
from tests._support._api import CLAIM, collection, path
from tests._support.broker_server import CLI, Pki, Served
from tests._support.controller import ClaimTiming, StandInController
from tests._support.kube import KubeAPIServer, find_kube_tools, free_ports
from tests._support.kube_broker import BrokerIdentity, StandInRouter, write_config

TIMED_BROKER = Path(__file__).with_name("_timed_broker.py")


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def _timed(call: Callable[[], Any], n: int) -> list[float]:
    call()  # warm: connections made, memos filled
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append(time.perf_counter() - t)
    return out


def _proc(pid: int) -> tuple[float, float]:
    """(RSS MiB, user+system CPU seconds) of process ``pid``."""
    rss = next(
        int(line.split()[1]) / 1024
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return rss, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Cluster:
    """The API server, the stand-in, the broker's identity and ``broker serve`` processes."""

    def __init__(self, stack: contextlib.ExitStack, folder: Path) -> None:
        self.kube = stack.enter_context(KubeAPIServer(find_kube_tools()))
        self.ns = self.kube.create_namespace()
        self.controller = stack.enter_context(StandInController(self.kube, [self.ns]))
        self.controller.create_template(self.ns, "python")
        self.controller.create_warm_pool(self.ns, "python", "python", replicas=0)
        self.identity = BrokerIdentity(self.kube, self.ns, folder)
        self.pki = Pki(folder)
        self.pki.write(self.pki.issue())
        self.ca = str(folder / "ca.pem")
        self.folder, self.stack = folder, stack
        self.kube.create_service_account(self.ns, "agent")
        self.router_token = folder / "router-token"
        self.router_token.write_text("router-secret-for-the-bench\n")
        self.router = stack.enter_context(
            StandInRouter(self.controller, self.router_token, allow_loopback_pod_ip=True)
        )

    def broker(self, name: str, timings: Path | None = None, **config: Any) -> tuple[str, int]:
        """A ``broker serve`` process (its URL, its pid), stopped at the end; ``timings``: with
        the timestamps of bench/_timed_broker.py written there."""
        [port] = free_ports(1)
        conf = write_config(self.folder / f"{name}.toml", self.identity, self.pki, port,
                            max_sandboxes=1000, **config)  # fmt: skip
        cli = CLI if timings is None else [sys.executable, str(TIMED_BROKER), str(timings)]
        served = Served.start([*cli, "broker", "serve", "--config", str(conf)])
        self.stack.callback(served.stop)
        url = served.wait_started(60)
        deadline = time.monotonic() + 30
        with httpx.Client(verify=ssl.create_default_context(cafile=self.ca)) as c:
            while c.get(url + "/readyz").status_code != 200:
                assert time.monotonic() < deadline, served.output()
                time.sleep(0.05)
        return url, served.process.pid

    def environ(self, url: str) -> dict[str, str]:
        token = self.folder / f"token-{url.rsplit(':', 1)[1]}"
        token.write_text(self.kube.token_request(self.ns, "agent", url))
        return {"AGENT_SANDBOX_BROKER_URL": url, "AGENT_SANDBOX_CA_BUNDLE": self.ca,
                "AGENT_SANDBOX_TOKEN_FILE": str(token),
                "AGENT_SANDBOX_BROKER_PROTOCOL": "v1"}  # fmt: skip


def _events(timings: Path) -> list[list[Any]]:
    return [json.loads(line) for line in timings.read_text().splitlines() if line]


PATH = 7
"""The first PATH phases are the critical path: they sum to the create's time exactly."""


def _phases(events: list[list[Any]], name: str, t0: float, t1: float,
            timing: ClaimTiming) -> dict[str, float]:  # fmt: skip
    """One create's phases (seconds) from the timed broker's events in [t0, t1] and the
    stand-in's timing of the claim (keys with "#": counts, "?": 1 or 0)."""
    seen = [e for e in events if t0 <= e[3] <= t1]  # began (or, cache events, happened) then
    [post] = [e for e in seen if e[:3] == ["http", "POST", "/v1/sandboxes"]]
    [get] = [e for e in seen if e[:2] == ["http", "GET"] and e[2].endswith("/" + name)]
    [api_post] = [e for e in seen if e[:3] == ["api", "create", name]]
    api = [e for e in seen if e[0] == "api"]
    quota = [e for e in api if e[3] < api_post[3]]  # the quota ledger's (and a LIST)
    ready = min(e[3] for e in seen if e[:2] == ["cache", name] and e[2])
    observed, written = timing.observed_at, timing.ready_written_at
    assert written is not None
    return {
        "client, to its POST reaching the broker (config, token, TLS connection)": post[3] - t0,
        "broker, before its API POST (token, policy, the quota ledger, the claim)": (
            api_post[3] - post[3]
        ),
        "API POST sent -> the stand-in's watch delivers the claim": observed - api_post[3],
        "the stand-in controller's own work (its timings)": written - observed,
        "its Ready write answered -> the broker's claim cache has it": ready - written,
        "broker, from the cache event to its answer": get[4] - ready,
        "client, from the answer to create() returning": t1 - get[4],
        "API POST of the claim, sent -> answered": api_post[4] - api_post[3],
        "quota ledger calls before the POST (its write; a GET, a LIST), sent -> answered": sum(
            e[4] - e[3] for e in quota
        ),
        "broker, from the POST's answer to its 201": post[4] - api_post[4],
        "client, from the 201 to its GET ?wait=ready reaching the broker": get[3] - post[4],
        "broker, GET ?wait=ready arrival -> waiting on the cache (its API GETs)": sum(
            e[4] - e[3] for e in api if e[1] == "get" and e[3] >= get[3]
        ),
        "# API calls of the broker (ledger, POST, GET)": len(api),
        "? the GET ?wait=ready was waiting before the Ready event": float(get[3] < ready),
    }


def _claim_copy(claim: dict[str, Any], name: str) -> dict[str, Any]:
    """A SandboxClaim like ``claim`` (the broker's: its labels, annotations, spec), named
    ``name``, for a namespace no controller watches."""
    meta = claim["metadata"]
    return {"apiVersion": CLAIM[0], "kind": CLAIM[1], "spec": claim["spec"], "metadata": {
        "name": name, "labels": meta.get("labels", {}),
        "annotations": meta.get("annotations", {})}}  # fmt: skip


def _watch_delivery(
    cluster: Cluster, namespace: str, claim: dict[str, Any], n: int
) -> tuple[list[float], list[float]]:
    """A merge PATCH of a claim (no controller, no broker), its event on a watch of it:
    seconds from the PATCH's answer to the event, and from its send."""
    claims = collection(CLAIM, namespace)
    made = cluster.kube.request("POST", claims, json=_claim_copy(claim, "bench-watch"))
    seen: dict[str, float] = {}
    arrived = threading.Condition()
    params = {"fieldSelector": "metadata.name=bench-watch"}

    def watch() -> None:
        with cluster.kube.watch(claims, resource_version=made["metadata"]["resourceVersion"],
                                timeout_seconds=120, token=cluster.kube.admin_token,
                                params=params) as events:  # fmt: skip
            for event in events:
                mark = (event["object"]["metadata"].get("annotations") or {}).get("bench")
                with arrived:
                    seen[str(mark)] = time.perf_counter()
                    arrived.notify_all()
                if mark == str(n):
                    return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    time.sleep(0.5)  # the watch is open
    after, since_send = [], []
    for i in range(1, n + 1):
        sent = time.perf_counter()
        cluster.kube.merge_patch(f"{claims}/bench-watch", {"metadata": {"annotations": {
            "bench": str(i)}}})  # fmt: skip
        answered = time.perf_counter()
        with arrived:
            assert arrived.wait_for(functools.partial(operator.contains, seen, str(i)), 10)
        after.append(seen[str(i)] - answered)
        since_send.append(seen[str(i)] - sent)
        time.sleep(0.02)
    thread.join(10)
    return after, since_send


def _baselines(cluster: Cluster, claim: dict[str, Any], n: int) -> dict[str, list[float]]:
    """Baselines on copies of the broker's claim ``claim`` in a namespace of their own."""
    namespace = cluster.kube.create_namespace()
    claims = collection(CLAIM, namespace)
    posts = []
    for i in range(n + 1):
        t = time.perf_counter()
        cluster.kube.request("POST", claims, json=_claim_copy(claim, f"bench-post-{i}"))
        posts.append(time.perf_counter() - t)
    after, since_send = _watch_delivery(cluster, namespace, claim, n)
    one = f"{claims}/bench-post-0"
    return {
        "one API GET of a claim": _timed(lambda: cluster.kube.admin.get(one), n),
        "one API POST of a claim": posts[1:],
        "one API LIST of claims by label": _timed(
            lambda: cluster.kube.admin.get(
                claims,
                params={"labelSelector": "app.kubernetes.io/managed-by=agent-sandbox-awx-broker"},
            ),
            n,
        ),
        "watch delivery, PATCH answered -> event": after,
        "watch delivery, PATCH sent -> event": since_send,
    }


def create_to_ready(cluster: Cluster, url: str, timed: tuple[str, Path], n: int) -> None:
    """(a): totals on ``url``; the phases on ``timed`` (a ``broker serve`` with timestamps,
    bench/_timed_broker.py), in the same run; baselines after."""
    env = cluster.environ(url)
    headers = {"Authorization": "Bearer " + Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()}
    with httpx.Client(verify=ssl.create_default_context(cafile=cluster.ca)) as c:
        broker_rtt = _timed(lambda: c.get(url + "/v1/sandboxes", headers=headers), 20)
    Sandbox.create(environ=env).kill()  # warm
    totals, stand_in = [], []
    for _ in range(n):
        t = time.perf_counter()
        sandbox = Sandbox.create(environ=env)
        totals.append(time.perf_counter() - t)
        claim = cluster.kube.get(path(CLAIM, cluster.ns, sandbox.name))
        stand_in.append(cluster.controller.timings[claim["metadata"]["uid"]].seconds or 0.0)
        sandbox.kill()
    phases = _timed_creates(cluster, *timed, n)
    base = _baselines(cluster, claim, n)
    api_get = base["one API GET of a claim"]
    own = [t - s - statistics.median(broker_rtt) for t, s in zip(totals, stand_in, strict=True)]
    print(
        f"(a) create -> ready (n={n}): total {_median_ms(totals):.1f} ms, the stand-in's own "
        f"{_median_ms(stand_in):.1f} ms, one broker round trip {_median_ms(broker_rtt):.1f} ms"
    )
    print(f"    the rest (the broker's create over the watch) {_median_ms(own):.1f} ms = "
          f"{statistics.median(own) / statistics.median(api_get):.2f} x one API GET "
          f"({_median_ms(api_get):.2f} ms)")  # fmt: skip
    _print_phases(phases, base)


def _timed_creates(cluster: Cluster, url: str, timings: Path, n: int) -> list[dict[str, float]]:
    env = cluster.environ(url)
    Sandbox.create(environ=env).kill()  # warm
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        sandbox = Sandbox.create(environ=env)
        t1 = time.perf_counter()
        uid = cluster.kube.get(path(CLAIM, cluster.ns, sandbox.name))["metadata"]["uid"]
        runs.append((sandbox.name, t0, t1, cluster.controller.timings[uid]))
        sandbox.kill()
    time.sleep(0.2)  # the last events written
    events = _events(timings)
    if os.environ.get("BENCH_EVENTS"):
        _, t0, t1, timing = runs[-1]
        assert timing.ready_written_at is not None
        for e in events:
            if t0 <= e[3] <= t1:
                print("     ", [f"{(x - t0) * 1000:.2f}" if isinstance(x, float) else x for x in e])
        print(
            "      stand-in",
            (timing.observed_at - t0) * 1000,
            (timing.ready_written_at - t0) * 1000,
        )
    return [_phases(events, *run) for run in runs]


def _print_phases(phases: list[dict[str, float]], base: dict[str, list[float]]) -> None:
    totals = [sum(list(p.values())[:PATH]) for p in phases]
    print(f"    on the timed broker (n={len(phases)}, medians): total {_median_ms(totals):.1f} ms;"
          " the critical path, then off it (overlapping the stand-in's work):")  # fmt: skip
    api_get = statistics.median(base["one API GET of a claim"])
    for i, key in enumerate(phases[0]):
        values = [p[key] for p in phases]
        if key[0] == "#":
            print(f"      {key[2:]}: {statistics.median(values):g}")
            continue
        if key[0] == "?":
            print(f"      {key[2:]}: {sum(values):g} of {len(values)}")
            continue
        mark = "  " if i < PATH else "| "
        print(f"    {mark}{key}: {_median_ms(values):.2f} ms = "
              f"{statistics.median(values) / api_get:.2f} x one API GET")  # fmt: skip
    for key, values in base.items():
        print(f"    baseline {key}: {_median_ms(values):.2f} ms")


@dataclasses.dataclass(frozen=True)
class UpstreamRouter:
    """Upstream's sandbox_router.py running at ``url`` (``token``: the file of its
    ROUTER_AUTH_TOKEN), the ``hosts`` file its resolver reads, the broker in front of it."""

    url: str
    token: Path
    hosts: Path
    broker_url: str


@contextlib.contextmanager
def _resolvable(cluster: Cluster, hosts: Path, names: list[str]) -> Iterator[None]:
    """``{name}.{namespace}.svc.cluster.local`` -> its pod's IP appended to ``hosts`` (the
    Sandbox ``name``'s pod), for the block only: the file's exact bytes are written back."""
    before = hosts.read_bytes()
    lines = "".join(f"{cluster.controller.pod_address(cluster.ns, name)[0]} "
                    f"{name}.{cluster.ns}.svc.cluster.local\n" for name in names)  # fmt: skip
    hosts.write_bytes(before + (b"" if before.endswith(b"\n") or not before else b"\n")
                      + lines.encode())  # fmt: skip
    try:
        yield
    finally:
        hosts.write_bytes(before)


def _sandbox_name(cluster: Cluster, sandbox: Sandbox) -> str:
    """The claim's Sandbox (``status.sandbox.name``): the X-Sandbox-ID the broker sends a router."""
    claim = cluster.kube.get(path(CLAIM, cluster.ns, sandbox.sandbox_id))
    return str(claim["status"]["sandbox"]["name"])


def _interleaved(runs: dict[str, Callable[[], Any]], n: int) -> dict[str, list[float]]:
    """``n`` rounds, one call of each run per round (the order rotating): seconds per call."""
    for run in runs.values():
        run()  # warm
    names = list(runs)
    out: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(n):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t = time.perf_counter()
            runs[name]()
            out[name].append(time.perf_counter() - t)
    return out


def _p90_ms(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] * 1000


def data_plane_hops(
    cluster: Cluster, pod_url: str, router_url: str, n: int, upstream: UpstreamRouter | None
) -> None:
    env = cluster.environ(pod_url)
    router_env = cluster.environ(router_url)
    with contextlib.ExitStack() as stack:
        sandbox = stack.enter_context(Sandbox.create(environ=env))
        routed = stack.enter_context(Sandbox.create(environ=router_env))
        direct = cluster.controller.pod_url(cluster.ns, sandbox.sandbox_id)
        context = ssl.create_default_context(cafile=cluster.ca)
        token = Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
        rtoken = Path(router_env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
        routed_ip = cluster.controller.pod_address(cluster.ns, routed.sandbox_id)[0]
        ident = {"X-Sandbox-Namespace": cluster.ns}
        plain = stack.enter_context(httpx.Client(trust_env=False))
        tls = stack.enter_context(httpx.Client(verify=context))
        runs: dict[str, Callable[[], httpx.Response]] = {
            "direct": lambda: plain.get(direct + "/"),
            "router": lambda: plain.get(cluster.router.url + "/", headers={
                **ident, "X-Sandbox-ID": routed.sandbox_id, "X-Sandbox-Pod-IP": routed_ip,
                "Authorization": f"Bearer {cluster.router_token.read_text().strip()}"}),
            "broker (pod)": lambda: tls.get(pod_url + "/", headers={
                **ident, "X-Sandbox-ID": sandbox.sandbox_id,
                "Authorization": f"Bearer {token}"}),
            "broker (router)": lambda: tls.get(router_url + "/", headers={
                **ident, "X-Sandbox-ID": routed.sandbox_id,
                "Authorization": f"Bearer {rtoken}"}),
        }  # fmt: skip
        if upstream is not None:
            runs.update(_upstream_runs(cluster, stack, upstream, plain, tls))
        for run in runs.values():
            assert run().status_code == 200
        if upstream is None:
            times = {name: _median_ms(_timed(run, n)) for name, run in runs.items()}
        else:
            samples = _interleaved(runs, n)
            times = {name: _median_ms(values) for name, values in samples.items()}
    router_hop = times["router"] - times["direct"]
    pod_hop = times["broker (pod)"] - times["direct"]
    front = times["broker (router)"] - times["router"]
    print(f"(b) GET / (n={n}, medians): " + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))
    print(f"    hops: router {router_hop:.2f} ms; broker, pod mode {pod_hop:.2f} ms "
          f"= {pod_hop / router_hop:.2f} x the router's; broker in front of the router "
          f"{front:.2f} ms = {front / router_hop:.2f} x")  # fmt: skip
    if upstream is not None:
        _print_upstream(samples)


def _upstream_runs(
    cluster: Cluster,
    stack: contextlib.ExitStack,
    upstream: UpstreamRouter,
    plain: httpx.Client,
    tls: httpx.Client,
) -> dict[str, Callable[[], httpx.Response]]:
    """The rows of upstream's router: alone (its token, the router headers of a Sandbox the
    broker in front of it made) and through that broker in router mode."""
    env = cluster.environ(upstream.broker_url)
    btoken = Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
    sandbox = stack.enter_context(Sandbox.create(environ=env))
    name = _sandbox_name(cluster, sandbox)
    stack.enter_context(_resolvable(cluster, upstream.hosts, [name]))
    secret = upstream.token.read_text().strip()
    alone = {"X-Sandbox-Namespace": cluster.ns, "X-Sandbox-ID": name, "X-Sandbox-Port": "8888",
             "Authorization": f"Bearer {secret}"}  # fmt: skip
    front = {"X-Sandbox-Namespace": cluster.ns, "X-Sandbox-ID": sandbox.sandbox_id,
             "Authorization": f"Bearer {btoken}"}  # fmt: skip
    return {
        "upstream router": lambda: plain.get(upstream.url + "/", headers=alone),
        "broker (upstream router)": lambda: tls.get(upstream.broker_url + "/", headers=front),
    }


def _print_upstream(samples: dict[str, list[float]]) -> None:
    med = {name: _median_ms(values) for name, values in samples.items()}
    p90 = {name: _p90_ms(values) for name, values in samples.items()}
    print("    p90s: " + ", ".join(f"{k} {v:.2f} ms" for k, v in p90.items()))
    for label, stat in (("median", med), ("p90", p90)):
        hop = stat["upstream router"] - stat["direct"]
        pod = stat["broker (pod)"] - stat["direct"]
        front = stat["broker (upstream router)"] - stat["upstream router"]
        print(f"    {label}s, against upstream's router: its hop {hop:.2f} ms; broker, pod mode "
              f"{pod:.2f} ms = {pod / hop:.2f} x upstream's hop; broker in front of upstream's "
              f"router {front:.2f} ms = {front / hop:.2f} x")  # fmt: skip


def many_sandboxes(cluster: Cluster, url: str, pid: int, count: int, rounds: int) -> None:
    env = cluster.environ(url)
    token = Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
    idle_rss, _ = _proc(pid)
    with concurrent.futures.ThreadPoolExecutor(min(count, 32)) as pool:
        sandboxes = list(pool.map(lambda _: Sandbox.create(environ=env), range(count)))
        try:
            context = ssl.create_default_context(cafile=cluster.ca)
            with httpx.Client(verify=context, limits=httpx.Limits(max_connections=64)) as tls:

                def use(sb: Sandbox) -> None:
                    for _ in range(rounds):
                        tls.get(url + "/", headers={
                            "X-Sandbox-ID": sb.sandbox_id, "X-Sandbox-Namespace": cluster.ns,
                            "Authorization": f"Bearer {token}"}).raise_for_status()  # fmt: skip

                list(pool.map(use, sandboxes))  # warm
                rss_before, cpu_before = _proc(pid)
                t = time.perf_counter()
                list(pool.map(use, sandboxes))
                wall = time.perf_counter() - t
                rss_after, cpu_after = _proc(pid)
        finally:
            list(pool.map(lambda sb: sb.kill(), sandboxes))
    requests = count * rounds
    per = (max(rss_after, rss_before) - idle_rss) / count
    cpu_ms = (cpu_after - cpu_before) / requests * 1000
    print(f"(c) {count} sandboxes at once, {requests} data-plane GETs in {wall:.2f} s: broker RSS "
          f"idle {idle_rss:.0f} MiB, with them {max(rss_after, rss_before):.0f} MiB "
          f"({per * 1024:.0f} KiB per sandbox); CPU {cpu_ms:.2f} ms per request")  # fmt: skip
    print(f"    extrapolated to 500: RSS about {idle_rss + per * 500:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--creates", type=int, default=10)
    parser.add_argument("--hops", type=int, default=200)
    parser.add_argument("--sandboxes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--parts", default="abc", help="which of (a), (b), (c) to run")
    parser.add_argument(
        "--upstream-router",
        metavar="URL",
        help="(b) also against upstream's sandbox_router.py running there",
    )
    parser.add_argument(
        "--upstream-router-token",
        metavar="FILE",
        type=Path,
        help="the file of that router's ROUTER_AUTH_TOKEN",
    )
    parser.add_argument(
        "--upstream-hosts-file",
        metavar="FILE",
        type=Path,
        default=Path("/etc/hosts"),
        help="the hosts file that router resolves through (restored after)",
    )
    args = parser.parse_args()
    if args.upstream_router and args.upstream_router_token is None:
        parser.error("--upstream-router needs --upstream-router-token (its ROUTER_AUTH_TOKEN)")
    with contextlib.ExitStack() as stack:
        cluster = Cluster(stack, Path(stack.enter_context(tempfile.TemporaryDirectory())))
        pod_url, pod_pid = cluster.broker("pod")
        router_url, _ = cluster.broker("router", router=(cluster.router.url, cluster.router_token))
        timings = cluster.folder / "timings.jsonl"
        timed = cluster.broker("timed", timings)[0], timings
        upstream = None
        if args.upstream_router and "b" in args.parts:
            front = (args.upstream_router, args.upstream_router_token)
            upstream = UpstreamRouter(args.upstream_router, args.upstream_router_token,
                                      args.upstream_hosts_file,
                                      cluster.broker("upstream", router=front,
                                                     router_pod_ip=False)[0])  # fmt: skip
        if "a" in args.parts:
            create_to_ready(cluster, pod_url, timed, args.creates)
        if "b" in args.parts:
            data_plane_hops(cluster, pod_url, router_url, args.hops, upstream)
        if "c" in args.parts:
            many_sandboxes(cluster, pod_url, pod_pid, args.sandboxes, args.rounds)


if __name__ == "__main__":
    main()
