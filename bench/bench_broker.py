"""Benchmark of the local broker stack: startup, create-to-ready, command round trip.

Run: ``.venv/bin/python bench/bench_broker.py [--sandboxes N] [--concurrent N] [--isolation
auto|bwrap|none]``. Prints numbers; asserts nothing (speed goals are not test assertions).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

COLD = (
    "import time; t = time.perf_counter(); "
    "from k8s_agent_sandbox_awx.testing import LocalBroker; "
    "b = LocalBroker(warn=False).start(); t1 = time.perf_counter(); b.stop(); "
    "print(f'{t1 - t:.4f} {b.startup_seconds:.4f}')"
)


def _ms(values: list[float]) -> str:
    values = sorted(values)
    p90 = values[max(0, int(len(values) * 0.9) - 1)]
    return (
        f"median {statistics.median(values) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms, "
        f"max {values[-1] * 1000:.1f} ms (n={len(values)})"
    )


def _big_file(http: httpx.Client, headers: dict[str, str], mib: int) -> None:
    import resource

    block = b"x" * (1 << 20)

    def body() -> Iterator[bytes]:
        yield b'--B\r\nContent-Disposition: form-data; name="file"; filename="big.bin"\r\n\r\n'
        for _ in range(mib):
            yield block
        yield b"\r\n--B--\r\n"

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    http.post(
        "/upload",
        content=body(),
        headers={**headers, "Content-Type": "multipart/form-data; boundary=B"},
    ).raise_for_status()
    up = time.perf_counter() - t
    t = time.perf_counter()
    size = 0
    with http.stream("GET", "/download/big.bin", headers=headers) as stream:
        for chunk in stream.iter_raw():
            size += len(chunk)
    down = time.perf_counter() - t
    assert size == mib << 20
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{mib} MiB streamed: upload {mib / up:.0f} MiB/s, download {mib / down:.0f} MiB/s; "
        f"max RSS of this process (broker + client) {before:.0f} -> {after:.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandboxes", type=int, default=20)
    parser.add_argument("--concurrent", type=int, default=50)
    parser.add_argument("--commands", type=int, default=100)
    parser.add_argument(
        "--big-mib", type=int, default=0, help="also stream a file of this size up and down"
    )
    parser.add_argument(
        "--isolation",
        choices=("auto", "bwrap", "none"),
        default=None,
        help="the local sandboxes' (default: $AGENT_SANDBOX_LOCAL_ISOLATION, else auto)",
    )
    args = parser.parse_args()
    if args.isolation:  # this process's brokers and the fresh processes' alike
        os.environ["AGENT_SANDBOX_LOCAL_ISOLATION"] = args.isolation

    cold, start_only = [], []
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", COLD], capture_output=True, text=True, check=True
        ).stdout.split()
        cold.append(float(out[0]))
        start_only.append(float(out[1]))
    print(f"stack startup, fresh process, import + start: {_ms(cold)}")
    print(f"stack startup, start() only (CA, keys, server): {_ms(start_only)}")

    from k8s_agent_sandbox_awx.testing import LocalBroker

    warm = []
    for _ in range(5):
        t = time.perf_counter()
        b = LocalBroker(warn=False).start()
        warm.append(time.perf_counter() - t)
        b.stop()
    print(f"stack startup, warm (modules imported): {_ms(warm)}")

    from k8s_agent_sandbox_awx.testing import Policy

    policy = Policy(namespace="bench", max_sandboxes=10_000)
    with LocalBroker(warn=False, kubernetes_policy=policy) as broker:
        info = broker.isolation_info
        print(f"sandboxes' isolation: {info.describe() if info else 'a custom backend'}")
        token = broker.issue_kubernetes_token("bench", "bench")
        ctx = ssl.create_default_context(cafile=broker.ca_bundle)
        limits = httpx.Limits(max_connections=args.concurrent + 10)
        with httpx.Client(
            base_url=broker.url,
            verify=ctx,
            headers={"Authorization": f"Bearer {token}"},
            timeout=120,
            limits=limits,
        ) as http:

            def create_ready() -> tuple[float, str]:
                t = time.perf_counter()
                name = http.post("/v1/sandboxes", json={}).json()["name"]
                while True:
                    state = http.get(
                        f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 60}
                    ).json()
                    if state["phase"] != "Pending":
                        break
                assert state["phase"] == "Ready", state
                return time.perf_counter() - t, name

            sequential = [create_ready() for _ in range(args.sandboxes)]
            print(f"create-to-ready, one at a time: {_ms([s[0] for s in sequential])}")
            name = sequential[0][1]
            headers = {"X-Sandbox-ID": name, "X-Sandbox-Namespace": "bench"}
            rtts = []
            for _ in range(args.commands):
                t = time.perf_counter()
                http.post("/execute", json={"command": "true"}, headers=headers).raise_for_status()
                rtts.append(time.perf_counter() - t)
            print(f"commands.run('true') through the broker (HTTPS): {_ms(rtts)}")
            if broker.isolation == "bwrap":  # runtime_pid is bwrap's, the runtime is below it
                print("runtime process RSS: not measured in bwrap")
            else:
                with open(f"/proc/{broker.runtime_pid(name)}/status") as fh:
                    rss = next(line.split()[1] for line in fh if line.startswith("VmRSS:"))
                print(f"runtime process RSS: {int(rss) / 1024:.1f} MiB")
            if args.big_mib:
                _big_file(http, headers, args.big_mib)
            broker.delete_all()

            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.concurrent) as pool:
                results = list(pool.map(lambda _: create_ready(), range(args.concurrent)))
            wall = time.perf_counter() - t
            print(
                f"create-to-ready, {args.concurrent} concurrent: {_ms([r[0] for r in results])}; "
                f"all ready after {wall:.2f} s"
            )
            t = time.perf_counter()
            broker.delete_all()
            print(f"delete {args.concurrent} sandboxes: {time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()
