"""Terminal benchmarks against the local broker (loopback HTTPS). Prints numbers; asserts
nothing.

    python bench/bench_pty.py [--runs 300]

1. Keystroke to echo: one byte typed into a terminal (``send_stdin``) until the program on it
   (``cat`` on a raw terminal: the echo comes from the program, as from a shell's line editor)
   sends it back and ``on_data`` has it — one stdin request through the broker, the byte through
   the runtime's pseudo-terminal, and its echo on the command's event stream — sync and async;
2. the same echo on a local pseudo-terminal (``os.openpty`` + ``cat``, no broker): the floor;
3. ``commands.run("true")`` round trip on the same sandbox: what one command through the broker
   costs, measured in the same run;
4. ``resize`` round trip.

Each keystroke waits for its echo before the next is typed, so the figures are latencies, not
a throughput. The broker runs in this process and shares the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import threading
import time
import tty
from collections.abc import Callable

from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox
from k8s_agent_sandbox_awx.testing import LocalBroker

RAW_CAT = "stty raw -echo; echo ready; exec cat"


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(int(len(ordered) * 0.9) - 1, 0)]


def _line(name: str, values: list[float], base: list[float] | None = None) -> str:
    median = statistics.median(values) * 1e3
    text = f"  {name:<40} median {median:7.2f} ms  p90 {_p90(values) * 1e3:7.2f} ms"
    if base:
        text += f"  ({median / (statistics.median(base) * 1e3):5.2f}x)"
    return text


class _Echoes:
    """Output seen so far; ``wait_for(n)``: until ``n`` bytes have come back."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.changed = threading.Condition()

    def __call__(self, chunk: bytes) -> None:
        with self.changed:
            self.data += chunk
            self.changed.notify_all()

    def wait_for(self, size: int, timeout: float = 10.0) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: len(self.data) >= size, timeout):
                raise TimeoutError(f"no echo after {timeout}s: {bytes(self.data[-40:])!r}")


def _keys(runs: int, send: Callable[[bytes], object], echoes: _Echoes) -> list[float]:
    base = len(echoes.data)
    times = []
    for i in range(runs + 20):  # 20 to warm up
        key = bytes([97 + i % 26])
        t = time.perf_counter()
        send(key)
        echoes.wait_for(base + i + 1)
        if i >= 20:
            times.append(time.perf_counter() - t)
    return times


def bench_sync(env: dict[str, str], runs: int) -> dict[str, list[float]]:
    with Sandbox.create(environ=env) as sandbox:
        echoes = _Echoes()
        term = sandbox.pty.create(on_data=echoes, command=RAW_CAT)
        echoes.wait_for(len(b"ready\n"))  # raw: no \r added
        keys = _keys(runs, term.send_stdin, echoes)
        resizes = []
        for i in range(runs):
            t = time.perf_counter()
            term.resize(80 + i % 2, 24)
            resizes.append(time.perf_counter() - t)
        term.kill()
        plain = []
        for i in range(runs + 10):
            t = time.perf_counter()
            sandbox.commands.run("true")
            if i >= 10:
                plain.append(time.perf_counter() - t)
    return {"keys": keys, "resize": resizes, "true": plain}


async def _async_keys(env: dict[str, str], runs: int) -> list[float]:
    async with await AsyncSandbox.create(environ=env) as sandbox:
        seen = bytearray()
        arrived = asyncio.Event()

        def on_data(chunk: bytes) -> None:
            seen.extend(chunk)
            arrived.set()

        term = await sandbox.pty.create(on_data=on_data, command=RAW_CAT)
        while len(seen) < len(b"ready\n"):
            arrived.clear()
            await arrived.wait()
        times = []
        for i in range(runs + 20):
            size = len(seen)
            t = time.perf_counter()
            await term.send_stdin(bytes([97 + i % 26]))
            while len(seen) <= size:
                arrived.clear()
                await arrived.wait()
            if i >= 20:
                times.append(time.perf_counter() - t)
        await term.kill()
        return times


def bench_local(runs: int) -> list[float]:
    """The same echo on a pseudo-terminal of this machine: no HTTP at all."""
    master, slave = os.openpty()
    tty.setraw(slave)
    proc = subprocess.Popen(["cat"], stdin=slave, stdout=slave, stderr=slave)
    echoes = _Echoes()

    def read() -> None:
        try:
            while chunk := os.read(master, 4096):
                echoes(chunk)
        except OSError:
            pass

    threading.Thread(target=read, daemon=True).start()
    try:
        return _keys(runs, lambda key: os.write(master, key), echoes)
    finally:
        proc.kill()
        proc.wait()
        os.close(slave)
        os.close(master)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    runs = parser.parse_args().runs
    with LocalBroker(warn=False) as broker:
        env = broker.environ("kubernetes")
        local = bench_local(runs)
        sync = bench_sync(env, runs)
        keys_async = asyncio.run(_async_keys(env, runs))
    print(f"terminals: {runs} keystrokes, each one byte, each waiting for its echo")
    print(_line("local pty echo (no broker)", local))
    print(_line("keystroke -> echo, sync client", sync["keys"], sync["true"]))
    print(_line("keystroke -> echo, async client", keys_async, sync["true"]))
    print(_line("resize round trip", sync["resize"], sync["true"]))
    print(_line("commands.run('true') round trip (1.00x)", sync["true"]))
    print(f"  load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
