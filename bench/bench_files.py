"""File API benchmarks against the local broker (loopback HTTPS). Prints numbers; asserts
nothing.

    python bench/bench_files.py [--runs 200] [--entries 2000] [--watches 20]

1. A small file (1 KiB) written and read back, through the runtime's file API (``/fs/write`` +
   ``/fs/read``) and through the legacy endpoints (``/upload`` + ``/download``), interleaved.
2. ``files.list`` of a directory of 2,000 entries, file API vs legacy.
3. Watch latency: a file written with ``files.write`` until ``watch_dir`` delivers its
   ``created`` event (the runtime polls the directory every 250 ms).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.testing import LocalBroker


def _ms(values: list[float]) -> str:
    values = sorted(values)
    p90 = values[int(len(values) * 0.9) - 1] if len(values) >= 10 else values[-1]
    return f"median {statistics.median(values) * 1e3:7.2f} ms  p90 {p90 * 1e3:7.2f} ms"


def _legacy(sandbox: Sandbox) -> Sandbox:
    """A second handle of the same sandbox that uses the legacy endpoints (as it would for a
    runtime without the file API)."""
    other = Sandbox(sandbox.client, sandbox.info)
    other.files._api.has_fs = False
    return other


def bench_round_trip(sandbox: Sandbox, runs: int) -> None:
    legacy, data = _legacy(sandbox), os.urandom(1024)
    timings: dict[str, list[float]] = {"fs": [], "legacy": []}
    for i in range(runs + 10):
        for name, handle in (("fs", sandbox), ("legacy", legacy)):
            t = time.perf_counter()
            handle.files.write(f"small/{name}.bin", data)
            assert handle.files.read(f"small/{name}.bin") == data
            if i >= 10:  # warmed up
                timings[name].append(time.perf_counter() - t)
    print(f"1 KiB write + read round trip x{runs}")
    print(f"  file API (/fs/write + /fs/read):    {_ms(timings['fs'])}")
    print(f"  legacy (/upload + /download):       {_ms(timings['legacy'])}")
    ratio = statistics.median(timings["fs"]) / statistics.median(timings["legacy"])
    print(f"  ratio of medians (fs / legacy): {ratio:.2f}x")


def bench_list(sandbox: Sandbox, entries: int, runs: int = 20) -> None:
    code = (
        "import os; os.makedirs('many'); "
        f"[open(f'many/{{i:05d}}', 'w').close() for i in range({entries})]"
    )
    result = sandbox.commands.run(f'{sys.executable} -c "{code}"', timeout=120)
    assert result.exit_code == 0, result.stderr
    legacy = _legacy(sandbox)
    timings: dict[str, list[float]] = {"fs": [], "legacy": []}
    for i in range(runs + 3):
        for name, handle in (("fs", sandbox), ("legacy", legacy)):
            t = time.perf_counter()
            listing = handle.files.list("many")
            if i >= 3:
                timings[name].append(time.perf_counter() - t)
            assert len(listing) == entries
    print(f"files.list of {entries} entries x{runs}")
    print(f"  file API (/fs/list):  {_ms(timings['fs'])}")
    print(f"  legacy (/list/...):   {_ms(timings['legacy'])}")


def bench_watch(sandbox: Sandbox, watches: int) -> None:
    sandbox.files.make_dir("watched")
    latencies: list[float] = []
    for i in range(watches):
        seen = threading.Event()
        written: list[float] = []
        stop = f"/app/watched/{i}.txt"

        def follow() -> None:
            with contextlib.closing(sandbox.files.watch_dir("watched", timeout=15)) as events:
                for event in events:
                    if event.type == "created" and event.path == stop:  # noqa: B023
                        latencies.append(time.perf_counter() - written[0])  # noqa: B023
                        seen.set()  # noqa: B023
                        return

        thread = threading.Thread(target=follow)
        thread.start()
        time.sleep(0.5)  # the watch's snapshot is taken
        t = time.perf_counter()
        sandbox.files.write(f"watched/{i}.txt", b"x")
        written.append(t)
        seen.wait(15)
        thread.join(20)
    print(f"watch latency (write -> created event delivered) x{len(latencies)}")
    print(f"  {_ms(latencies)}   (the local runtime polls every 250 ms)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--entries", type=int, default=2000)
    parser.add_argument("--watches", type=int, default=20)
    args = parser.parse_args()
    with LocalBroker(warn=False) as broker:
        env = broker.environ("kubernetes", namespace="team-a", service_account="bench")
        with Sandbox.create(environ=env, timeout=1800) as sandbox:
            bench_round_trip(sandbox, args.runs)
            bench_list(sandbox, args.entries)
            bench_watch(sandbox, args.watches)


if __name__ == "__main__":
    main()
