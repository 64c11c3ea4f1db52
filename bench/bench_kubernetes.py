"""Benchmark of the Kubernetes backend: create-to-ready over the watch, the data-plane hop,
and many sandboxes on one replica (docs/performance.md, "Kubernetes backend").

Run (the API server's binaries from ``.ci/kube-tools``; the test helpers are imported):
``PYTHONPATH=src:. python bench/bench_kubernetes.py [--creates N] [--hops N] [--sandboxes N]``.
Prints numbers and ratios against baselines measured in the same run; asserts nothing.

- (a) create -> ready through ``broker serve`` (a process, pod data plane) on a real API server,
  minus the stand-in controller's own time (``controller.timings``: from its watch seeing the
  claim to its write of Ready returning) and minus one broker round trip of the same client
  (``GET /v1/sandboxes``: TLS, token, answer), in units of one API GET of a claim.
- (b) one data-plane ``GET /`` of the runtime: directly (the pod), through the stand-in
  router alone (tests/_support/kube_broker.py's ``StandInRouter``: plain HTTP, its bearer
  token, request bodies buffered), through the broker in pod mode and in router mode (the
  broker, then the stand-in router). Hops: router = router - direct; broker (pod mode) =
  broker - direct; broker in front of the router = broker(router mode) - router.
- (c) ``--sandboxes`` sandboxes at once on one replica (each a stand-in pod: a runtime process),
  every one used concurrently: the broker process's RSS (idle, then with them) and its CPU
  time per data-plane request. Figures for 500 are extrapolated linearly from the measured
  per-sandbox RSS (500 runtime processes do not fit a small machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import ssl
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from k8s_agent_sandbox_awx import Sandbox
from tests._support._api import CLAIM, path
from tests._support.broker_server import CLI, Pki, Served
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer, find_kube_tools, free_ports
from tests._support.kube_broker import BrokerIdentity, StandInRouter, write_config


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

    def broker(self, name: str, **config: Any) -> tuple[str, int]:
        """A ``broker serve`` process (its URL, its pid), stopped at the end."""
        [port] = free_ports(1)
        conf = write_config(self.folder / f"{name}.toml", self.identity, self.pki, port,
                            max_sandboxes=1000, **config)  # fmt: skip
        served = Served.start([*CLI, "broker", "serve", "--config", str(conf)])
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


def create_to_ready(cluster: Cluster, url: str, n: int) -> None:
    env = cluster.environ(url)
    headers = {"Authorization": "Bearer " + Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()}
    with httpx.Client(verify=ssl.create_default_context(cafile=cluster.ca)) as c:
        broker_rtt = _timed(lambda: c.get(url + "/v1/sandboxes", headers=headers), 20)
    made = Sandbox.create(environ=env)  # warm
    made.kill()
    probe = made.name
    totals, stand_in = [], []
    for _ in range(n):
        t = time.perf_counter()
        sandbox = Sandbox.create(environ=env)
        totals.append(time.perf_counter() - t)
        uid = cluster.kube.get(path(CLAIM, cluster.ns, sandbox.name))["metadata"]["uid"]
        stand_in.append(cluster.controller.timings[uid].seconds or 0.0)
        probe = sandbox.name
        sandbox.kill()
    claim_path = path(CLAIM, cluster.ns, probe)
    api_get = _timed(lambda: cluster.kube.admin.get(claim_path), 20)
    own = [t - s - statistics.median(broker_rtt) for t, s in zip(totals, stand_in, strict=True)]
    print(
        f"(a) create -> ready (n={n}): total {_median_ms(totals):.1f} ms, the stand-in's own "
        f"{_median_ms(stand_in):.1f} ms, one broker round trip {_median_ms(broker_rtt):.1f} ms"
    )
    print(f"    the rest (the broker's create over the watch) {_median_ms(own):.1f} ms = "
          f"{statistics.median(own) / statistics.median(api_get):.2f} x one API GET "
          f"({_median_ms(api_get):.2f} ms)")  # fmt: skip


def data_plane_hops(cluster: Cluster, pod_url: str, router_url: str, n: int) -> None:
    env = cluster.environ(pod_url)
    router_env = cluster.environ(router_url)
    with Sandbox.create(environ=env) as sandbox, Sandbox.create(environ=router_env) as routed:
        direct = cluster.controller.pod_url(cluster.ns, sandbox.sandbox_id)
        context = ssl.create_default_context(cafile=cluster.ca)
        token = Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
        rtoken = Path(router_env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
        ident = {"X-Sandbox-Namespace": cluster.ns}
        with httpx.Client(trust_env=False) as plain, httpx.Client(verify=context) as tls:
            runs = {
                "direct": lambda: plain.get(direct + "/"),
                "router": lambda: plain.get(cluster.router.url + "/", headers={
                    **ident, "X-Sandbox-ID": routed.sandbox_id,
                    "Authorization": f"Bearer {cluster.router_token.read_text().strip()}"}),
                "broker (pod)": lambda: tls.get(pod_url + "/", headers={
                    **ident, "X-Sandbox-ID": sandbox.sandbox_id,
                    "Authorization": f"Bearer {token}"}),
                "broker (router)": lambda: tls.get(router_url + "/", headers={
                    **ident, "X-Sandbox-ID": routed.sandbox_id,
                    "Authorization": f"Bearer {rtoken}"}),
            }  # fmt: skip
            for run in runs.values():
                assert run().status_code == 200
            times = {name: _median_ms(_timed(run, n)) for name, run in runs.items()}
    router_hop = times["router"] - times["direct"]
    pod_hop = times["broker (pod)"] - times["direct"]
    front = times["broker (router)"] - times["router"]
    print(f"(b) GET / (n={n}, medians): " + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))
    print(f"    hops: router {router_hop:.2f} ms; broker, pod mode {pod_hop:.2f} ms "
          f"= {pod_hop / router_hop:.2f} x the router's; broker in front of the router "
          f"{front:.2f} ms = {front / router_hop:.2f} x")  # fmt: skip


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
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        cluster = Cluster(stack, Path(stack.enter_context(tempfile.TemporaryDirectory())))
        cluster.router_token = cluster.folder / "router-token"
        cluster.router_token.write_text("router-secret-for-the-bench\n")
        cluster.router = stack.enter_context(StandInRouter(cluster.controller,
                                                           cluster.router_token))  # fmt: skip
        pod_url, pod_pid = cluster.broker("pod")
        router_url, _ = cluster.broker("router", router=(cluster.router.url, cluster.router_token))
        create_to_ready(cluster, pod_url, args.creates)
        data_plane_hops(cluster, pod_url, router_url, args.hops)
        many_sandboxes(cluster, pod_url, pod_pid, args.sandboxes, args.rounds)


if __name__ == "__main__":
    main()
