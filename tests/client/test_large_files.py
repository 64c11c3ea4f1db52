"""A 2 GiB file written and read back through the broker with bounded client memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SIZE = 2 * 1024**3
LIMIT = 64 * 1024**2

# Runs in a fresh interpreter so that ru_maxrss/VmHWM measure the client only (the broker and
# the runtime live in the test process and in their own processes).
CLIENT = r"""
import hashlib, io, json, os, sys
from k8s_agent_sandbox_awx import Sandbox

SIZE = int(sys.argv[1])

def vm_hwm_kib():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

class Generated(io.RawIOBase):
    # A non-seekable stream of SIZE bytes; never materialised.
    def __init__(self):
        self.block = os.urandom(1024 * 1024)
        self.left = SIZE
        self.digest = hashlib.sha256()
    def readable(self):
        return True
    def read(self, n=-1):
        n = min(self.left, len(self.block) if n < 0 else n, len(self.block))
        data = self.block[:n]
        self.left -= n
        self.digest.update(data)
        return data

class Sink:
    def __init__(self):
        self.digest = hashlib.sha256()
    def write(self, data):
        self.digest.update(data)
        return len(data)

with Sandbox.create(ready_timeout=60, request_timeout=120) as sb:
    # warm up every code path (TLS, multipart, streaming download) before the baseline
    sb.files.write("warm.bin", b"x" * 4096)
    sb.files.read_to("warm.bin", Sink())
    base = vm_hwm_kib()
    source = Generated()
    sb.files.write("big/2g.bin", source)
    sink = Sink()
    n = sb.files.read_to("big/2g.bin", sink)
    peak = vm_hwm_kib()
print(json.dumps({"base_kib": base, "peak_kib": peak, "size": n,
                  "same": source.digest.hexdigest() == sink.digest.hexdigest()}))
"""


def test_2gib_round_trip_with_bounded_memory(broker: Any) -> None:
    env = {**os.environ, **broker.environ("kubernetes")}
    env.pop("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", None)
    env["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, str(SIZE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["size"] == SIZE
    assert report["same"]
    growth = (report["peak_kib"] - report["base_kib"]) * 1024
    print(f"client peak RSS growth for 2 GiB up+down: {growth / 2**20:.1f} MiB")
    assert growth < LIMIT
