"""A request through ``sandbox.ports.forward`` against the same request straight to the port.

    python bench/bench_ports.py [--requests 300]

A stdlib HTTP server (``tests/_support/port_app.py``) runs in a local sandbox (a host process:
its port is on loopback). The same ``GET /headers`` (a small JSON answer) is timed:

1. straight to ``http://127.0.0.1:PORT`` (plain HTTP on loopback, a new connection per request,
   with ``http.client``);
2. through ``ports.forward(PORT)`` (the same client): the forwarder's local listener, a new TLS
   connection to the broker per request (the forwarder sends ``Connection: close``), the
   broker's checks (token, owner, policy) and its forward to the port (a new connection to the
   port per request, as for every port request);
3. through ``ports.client(PORT)`` (HTTPS to the broker, one kept-alive connection).

Medians and p90 in ms, and the ratios to the straight request. The broker runs in this process
(its own thread); the client in this one too, so both share the machine's cores. Prints
numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import http.client
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

APP = str(Path(__file__).resolve().parents[1] / "tests" / "_support" / "port_app.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _times(call: Callable[[], None], count: int) -> list[float]:
    for _ in range(min(20, count)):  # warm up
        call()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return times


def _stats(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[max(0, int(len(ordered) * 0.9) - 1)]


def _get(port: int) -> Callable[[], None]:
    """``GET /headers`` to ``127.0.0.1:port`` on a new connection (http.client: cheap to make,
    so the connection's cost is the server's and the forward's, not the client library's)."""

    def call() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("GET", "/headers")
            answer = connection.getresponse()
            answer.read()
            assert answer.status == 200
        finally:
            connection.close()

    return call


def _kept_alive(client: httpx.Client) -> Callable[[], None]:
    def call() -> None:
        assert client.get("/headers").status_code == 200

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()

    from k8s_agent_sandbox_awx import Sandbox
    from k8s_agent_sandbox_awx.errors import PortNotListeningError
    from k8s_agent_sandbox_awx.testing import LocalBroker

    with LocalBroker(warn=False) as broker, Sandbox.create(environ=broker.environ()) as sandbox:
        port = _free_port()
        handle = sandbox.commands.run(
            [sys.executable, APP, str(port)], timeout=300, background=True
        )
        with sandbox.ports.client(port) as client:
            for _ in range(300):
                try:
                    client.get("/headers")
                    break
                except PortNotListeningError:
                    time.sleep(0.05)
            with sandbox.ports.forward(port) as forward:
                count = args.requests
                rows = {
                    "straight to the port": _times(_get(port), count),
                    "through ports.forward": _times(_get(forward.port), count),
                    "through ports.client": _times(_kept_alive(client), count),
                }
        handle.kill()
    base = _stats(rows["straight to the port"])[0]
    print(f"GET /headers, {args.requests} requests each")
    for name, times in rows.items():
        median, p90 = _stats(times)
        shown = f"median {median * 1000:6.2f} ms  p90 {p90 * 1000:6.2f} ms"
        print(f"{name:24} {shown}  ratio {median / base:5.1f}x")


if __name__ == "__main__":
    main()
