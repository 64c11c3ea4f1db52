"""File API benchmarks at the wire level (httpx straight at the local broker, loopback HTTPS).
Prints numbers; asserts nothing.

    python bench/bench_fs_server.py [--runs 200]

1. Small-file (1 KiB) write + read round trip: ``POST /fs/write`` + ``GET /fs/read`` vs the
   legacy ``POST /upload`` + ``GET /download/...`` (medians, ms).
2. Listing a 2,000-entry directory: ``GET /fs/list`` (FileInfo) vs ``GET /list/...`` (ms).
3. Watch latency: ``GET /fs/watch`` open, a file written with ``/fs/write``; the time from the
   write's answer to the ``created`` event (the runtime polls every 250 ms: expect ~0-250 ms).

These are the broker + runtime costs a client adds its own overhead to.
"""

from __future__ import annotations

import argparse
import json
import ssl
import statistics
import threading
import time
from typing import Any

import httpx

from k8s_agent_sandbox_awx.testing import LocalBroker


def _median_ms(samples: list[float]) -> str:
    p90 = sorted(samples)[int(len(samples) * 0.9)]
    return f"{statistics.median(samples) * 1000:.2f} ms (p90 {p90 * 1000:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    with LocalBroker(warn=False) as broker:
        token = broker.issue_kubernetes_token("default", "bench")
        http = httpx.Client(
            base_url=broker.url,
            verify=ssl.create_default_context(cafile=broker.ca_bundle),
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
        name = http.post("/v1/sandboxes", json={}).json()["name"]
        sandbox = http.get(f"/v1/sandboxes/{name}", params={"wait": "ready"}).json()
        router = sandbox["router"]
        headers = {"X-Sandbox-ID": router["sandbox_id"], "X-Sandbox-Namespace": router["namespace"]}
        payload = b"x" * 1024

        def timed(fn: Any) -> list[float]:
            out = []
            for i in range(args.runs):
                started = time.perf_counter()
                fn(i)
                out.append(time.perf_counter() - started)
            return out

        def fs_round_trip(i: int) -> None:
            path = f"/workspace/small-{i % 10}"
            http.post("/fs/write", data={"path": path}, files={"file": payload}, headers=headers)
            assert http.get("/fs/read", params={"path": path}, headers=headers).content == payload

        def legacy_round_trip(i: int) -> None:
            path = f"small-{i % 10}"
            http.post("/upload", files={"file": (path, payload)}, headers=headers)
            assert http.get(f"/download/{path}", headers=headers).content == payload

        print(f"1 KiB write+read, /fs/*:             {_median_ms(timed(fs_round_trip))}")
        print(f"1 KiB write+read, /upload+/download: {_median_ms(timed(legacy_round_trip))}")

        http.post("/fs/mkdir", json={"path": "many"}, headers=headers)
        make = "python3 -c \"[open(f'many/{i}', 'w').close() for i in range(2000)]\""
        http.post("/execute", json={"command": make}, headers=headers)
        runs = max(10, args.runs // 10)
        fs_list = [0.0] * runs
        for i in range(runs):
            started = time.perf_counter()
            assert (
                len(http.get("/fs/list", params={"path": "many"}, headers=headers).json()) == 2000
            )
            fs_list[i] = time.perf_counter() - started
        legacy_list = [0.0] * runs
        for i in range(runs):
            started = time.perf_counter()
            assert len(http.get("/list/many", headers=headers).json()) == 2000
            legacy_list[i] = time.perf_counter() - started
        print(f"list 2,000 entries, /fs/list:        {_median_ms(fs_list)}")
        print(f"list 2,000 entries, /list/...:       {_median_ms(legacy_list)}")

        latencies: list[float] = []
        writer = httpx.Client(
            base_url=broker.url,
            verify=ssl.create_default_context(cafile=broker.ca_bundle),
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
        for i in range(10):
            written: dict[str, float] = {}

            def write(i: int = i, written: dict[str, float] = written) -> None:
                time.sleep(0.1 + (i % 5) * 0.037)  # not in step with the poll
                writer.post(
                    "/fs/write", data={"path": f"w/{i}"}, files={"file": b"x"}, headers=headers
                )
                written["at"] = time.perf_counter()

            params: dict[str, str | int] = {"path": "w", "duration": 5}
            http.post("/fs/mkdir", json={"path": "w"}, headers=headers)
            with http.stream("GET", "/fs/watch", params=params, headers=headers) as resp:
                lines = resp.iter_lines()
                next(lines)  # the snapshot
                thread = threading.Thread(target=write)
                thread.start()
                for line in lines:
                    if line and json.loads(line)["type"] == "created":
                        seen = time.perf_counter()
                        break
                thread.join()
            latencies.append(max(0.0, seen - written["at"]))
        print(f"watch: write answered -> created:    {_median_ms(latencies)}")
        writer.close()
        http.close()


if __name__ == "__main__":
    main()
