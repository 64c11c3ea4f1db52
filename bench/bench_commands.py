"""Managed-command benchmarks against the local broker (loopback HTTPS). Prints numbers; asserts
nothing.

    python bench/bench_commands.py [--runs 200] [--lines 200] [--size-mib 1024]

1. Live-output latency: a command prints a line carrying the wall-clock time it was printed;
   the time until ``on_stdout`` receives it (through the runtime, the broker and the client),
   against the round trip of a plain ``commands.run("true")`` on the same sandbox.
2. Throughput: ``--size-mib`` of output streamed through ``on_stdout`` (MiB/s) and the client's
   peak RSS growth, measured in a separate client process.
3. Start to exit of ``true``: the managed path (the streamed ``POST /commands``, whose answer
   carries the events up to the exit) vs the legacy ``POST /execute`` (the same client, told the
   runtime has no managed commands), alternating run by run.
4. Start to exit of ``true`` as an argv and as a string (which runs through ``/bin/sh`` and
   bash: what the shell choice costs).
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

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.testing import LocalBroker


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _ms(values: list[float]) -> str:
    values = sorted(values)
    p90 = values[int(len(values) * 0.9) - 1] if len(values) >= 10 else values[-1]
    return f"median {_median_ms(values):7.2f} ms  p90 {p90 * 1e3:7.2f} ms"


def _round_trips(sandbox: Sandbox, command: Any, runs: int) -> list[float]:
    for _ in range(10):
        sandbox.commands.run(command)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        sandbox.commands.run(command)
        times.append(time.perf_counter() - t)
    return times


PRINTER = (
    "import sys, time\n"
    "for _ in range(int(sys.argv[1])):\n"
    "    print(repr(time.time()), flush=True)\n"
    "    time.sleep(0.02)\n"
)


def bench_latency(env: dict[str, str], runs: int, lines: int) -> None:
    with Sandbox.create(environ=env) as sandbox:
        plain = _round_trips(sandbox, "true", runs)
        latencies: list[float] = []

        def on_stdout(text: str) -> None:
            now = time.time()
            latencies.extend(now - float(line) for line in text.split())

        sandbox.commands.run([sys.executable, "-c", PRINTER, str(lines)], on_stdout=on_stdout)
    print(f"live output: {lines} lines printed 20 ms apart")
    print(f"  print -> on_stdout:            {_ms(latencies)}")
    print(f"  commands.run('true') round trip: {_ms(plain)}")
    gap = _median_ms(latencies) - _median_ms(plain)
    print(f"  difference of medians: {gap:+.2f} ms (goal: within +2 ms)")


CLIENT = r"""
import json, os, sys, time
from k8s_agent_sandbox_awx import Sandbox

def vm_hwm_kib():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0

size = int(sys.argv[1])
with Sandbox.create(env={"SANDBOX_EXEC_TIMEOUT_SECONDS": "3600"}) as sandbox:
    sandbox.commands.run("true")
    base = vm_hwm_kib()
    received = 0
    def on_stdout(text):
        global received
        received += len(text)
    t = time.perf_counter()
    cpu = time.process_time()
    result = sandbox.commands.run(
        f"yes aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa | head -c {size}",
        timeout=3600, on_stdout=on_stdout,
    )
    elapsed = time.perf_counter() - t
    cpu = time.process_time() - cpu
print(json.dumps({"size": size, "received": received, "elapsed": elapsed, "cpu": cpu,
                  "base_kib": base, "peak_kib": vm_hwm_kib(), "exit_code": result.exit_code,
                  "truncated": result.output_truncated}))
"""


def bench_throughput(broker: LocalBroker, size_mib: int) -> None:
    size = size_mib * 1024 * 1024
    env = {
        **os.environ,
        **broker.environ("kubernetes"),
        "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, str(size)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        print(f"throughput client failed:\n{out.stderr[-2000:]}")
        return
    report = json.loads(out.stdout.strip().splitlines()[-1])
    mib_s = report["received"] / report["elapsed"] / 2**20
    growth = (report["peak_kib"] - report["base_kib"]) / 1024
    print(f"{size_mib} MiB of output through on_stdout")
    print(
        f"  received {report['received']} characters in {report['elapsed']:.2f} s: "
        f"{mib_s:.0f} MiB/s"
    )
    print(
        f"  client CPU: {report['cpu']:.2f} s ({report['cpu'] / report['elapsed']:.0%} of the time)"
    )
    print(
        f"  client peak RSS growth: {growth:.1f} MiB (exit {report['exit_code']}, result "
        f"output_truncated={report['truncated']})"
    )


def bench_paths(env: dict[str, str], runs: int) -> None:
    """Alternates the two paths run by run, so that a change of the machine's load (other jobs)
    hits both alike."""
    times: dict[bool, list[float]] = {True: [], False: []}
    with Sandbox.create(environ=env) as sandbox:
        features = sandbox.commands._features
        for index in range(2 * (runs + 10)):
            is_managed = index % 2 == 0
            features.managed = is_managed  # False: as if the runtime had no /commands
            t = time.perf_counter()
            sandbox.commands.run(["true"])
            if index >= 20:  # the first ten of each warm up
                times[is_managed].append(time.perf_counter() - t)
    managed, legacy = times[True], times[False]
    print(f"start to exit of `true` x{runs}, the two paths alternating")
    print(f"  managed (streamed POST /commands):  {_ms(managed)}")
    print(f"  legacy (POST /execute):            {_ms(legacy)}")
    ratio = statistics.median(managed) / statistics.median(legacy)
    print(f"  ratio of medians: {ratio:.2f}x (goal: at most 1.3x)")


def bench_shell(env: dict[str, str], runs: int) -> None:
    """What a string costs over an argv: the string goes through ``/bin/sh`` running the script
    that replaces itself with bash (``_command_rules.SHELL``)."""
    with Sandbox.create(environ=env) as sandbox:
        argv = _round_trips(sandbox, ["true"], runs)
        string = _round_trips(sandbox, "true", runs)
    print(f"start to exit, argv ['true'] vs string 'true' (sh -> bash) x{runs}")
    print(f"  argv:   {_ms(argv)}")
    print(f"  string: {_ms(string)}")
    extra = _median_ms(string) - _median_ms(argv)
    print(f"  a string costs {extra:.2f} ms more (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--size-mib", type=int, default=1024)
    args = parser.parse_args()
    os.environ["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    with LocalBroker(warn=False) as broker:
        env = broker.environ("kubernetes")
        bench_latency(env, args.runs, args.lines)
        bench_paths(env, args.runs)
        bench_shell(env, args.runs)
        bench_throughput(broker, args.size_mib)


if __name__ == "__main__":
    main()
