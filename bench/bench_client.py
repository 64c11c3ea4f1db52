"""Client benchmarks against the local broker (loopback HTTPS). Prints numbers; asserts nothing.

    python bench/bench_client.py [--runs 200] [--creates 20] [--size-mib 1024]

1. ``commands.run("true")`` round trip through the broker vs the same ``POST /execute`` sent
   straight to the sandbox runtime (plain HTTP, keep-alive): medians and their ratio.
2. create-to-ready latency as the client sees it, minus the broker's own time from accepting the
   claim to marking it Ready (= the client's and the protocol's overhead).
3. Upload and download throughput of a generated file (default 1 GiB) and the client's peak RSS
   growth, measured in a separate client process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.testing import LocalBroker


def _ms(values: list[float]) -> str:
    values = sorted(values)
    p90 = values[int(len(values) * 0.9) - 1] if len(values) >= 10 else values[-1]
    return f"median {statistics.median(values) * 1e3:7.2f} ms  p90 {p90 * 1e3:7.2f} ms"


def bench_run(broker: LocalBroker, env: dict[str, str], runs: int) -> None:
    with Sandbox.create(environ=env) as sandbox:
        for _ in range(10):
            sandbox.commands.run("true")
        through: list[float] = []
        for _ in range(runs):
            t = time.perf_counter()
            sandbox.commands.run("true")
            through.append(time.perf_counter() - t)
        record = broker._require_store().sandboxes[sandbox.name]
        assert record.handle is not None
        runtime = f"http://{record.handle.host}:{record.handle.port}"
        direct: list[float] = []
        with httpx.Client(base_url=runtime) as client:
            for _ in range(10):
                client.post("/execute", json={"command": "true", "timeout_seconds": 60})
            for _ in range(runs):
                t = time.perf_counter()
                r = client.post("/execute", json={"command": "true", "timeout_seconds": 60})
                r.raise_for_status()
                direct.append(time.perf_counter() - t)
    print(f"commands.run('true') x{runs}")
    print(f"  through the broker (HTTPS, auth, proxy): {_ms(through)}")
    print(f"  straight to the runtime (HTTP):          {_ms(direct)}")
    print(f"  ratio of medians: {statistics.median(through) / statistics.median(direct):.2f}x")


def bench_create(broker: LocalBroker, env: dict[str, str], creates: int) -> None:
    client_times: list[float] = []
    overheads: list[float] = []
    for _ in range(creates):
        t0 = time.perf_counter()
        sandbox = Sandbox.create(environ=env)
        elapsed = time.perf_counter() - t0
        record = broker._require_store().sandboxes[sandbox.name]
        broker_ready = record.transition_at - record.created_at
        client_times.append(elapsed)
        overheads.append(elapsed - broker_ready)
        sandbox.kill()
    print(f"Sandbox.create() to Ready x{creates}")
    print(f"  client-observed:                  {_ms(client_times)}")
    print(f"  minus the broker's own ready time: {_ms(overheads)}")


CLIENT = r"""
import hashlib, io, json, os, sys, time
from k8s_agent_sandbox_awx import Sandbox
SIZE = int(sys.argv[1])
def hwm():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
class Gen(io.RawIOBase):
    def __init__(self):
        self.block = os.urandom(1 << 20); self.left = SIZE
    def readable(self): return True
    def read(self, n=-1):
        n = min(self.left, len(self.block) if n < 0 else n, len(self.block))
        self.left -= n
        return self.block[:n]
class Sink:
    def write(self, b): return len(b)
with Sandbox.create(request_timeout=300) as sb:
    sb.files.write("w", b"x" * 4096); sb.files.read_to("w", Sink())
    base = hwm()
    t = time.perf_counter(); sb.files.write("big.bin", Gen()); up = time.perf_counter() - t
    t = time.perf_counter(); n = sb.files.read_to("big.bin", Sink()); down = time.perf_counter() - t
    peak = hwm()
print(json.dumps({"up": up, "down": down, "n": n, "base": base, "peak": peak}))
"""


def bench_files(broker: LocalBroker, env: dict[str, str], size_mib: int) -> None:
    size = size_mib * 1024 * 1024
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, str(size)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["n"] == size
    print(f"files, {size_mib} MiB generated stream (client in its own process)")
    print(f"  upload   {size_mib / r['up']:8.1f} MiB/s ({r['up']:.2f} s)")
    print(f"  download {size_mib / r['down']:8.1f} MiB/s ({r['down']:.2f} s)")
    print(
        f"  client peak RSS {r['peak'] / 1024:.1f} MiB; growth during the transfers "
        f"{(r['peak'] - r['base']) / 1024:.1f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--size-mib", type=int, default=1024)
    args = parser.parse_args()
    os.environ["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    # host processes: the paths straight to the runtime need its address on this host (under
    # bubblewrap the runtime listens inside the sandbox, behind the broker only)
    with LocalBroker(warn=False, isolation="none") as broker:
        env = broker.environ("kubernetes")
        env["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        bench_run(broker, env, args.runs)
        bench_create(broker, env, args.creates)
        bench_files(broker, env, args.size_mib)


if __name__ == "__main__":
    main()
