"""What the broker's forward to a runtime costs in its HTTP client, against raw asyncio streams.

Run: ``PYTHONPATH=src:. python bench/bench_forward_client.py [--n 2000]``. Prints numbers;
asserts nothing (docs/performance.md, "The Kubernetes hop").

One event loop sends ``POST /execute`` (the body upstream's client sends for ``commands.run``)
to one stand-in pod of bench/_pod_farm.py (which answers in tens of microseconds) over one
kept-alive connection, ``--n`` times per way, and prints the CPU time of the loop's thread and
the wall time per request:

- the way the forward sends over httpx (an ``https`` route's): ``AsyncClient.build_request``,
  ``send(stream=True)``, the body read raw, the response closed;
- the client's transport alone (``AsyncHTTPTransport.handle_async_request``: no client layer);
- the way the forward sends to a plain-HTTP runtime: the broker's own pool
  (``backends._http11.Http11Pool``: its own codec, ``backends._h1``, over an asyncio
  protocol), the body read raw;
- asyncio streams with the request written in two writes (its head, then its body: as
  httpcore writes them) and in one write, the answer read by its ``Content-Length``.

The last two are the floor for a forward that parses and frames the messages itself.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from k8s_agent_sandbox_awx.broker.backends._http11 import Http11Pool

FARM = Path(__file__).with_name("_pod_farm.py")
BODY = b'{"command": "true"}'
HEAD = (
    b"POST /execute HTTP/1.1\r\nhost: pod\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n"
)


async def _read_answer(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            await reader.readexactly(int(value))
            return


async def _measure(n: int, url: str, host: str, port: int) -> None:
    async with httpx.AsyncClient(trust_env=False) as client:
        transport = client._transport  # the client's own, as the forward's client uses it
        reader, writer = await asyncio.open_connection(host, port)
        headers = {"content-type": "application/json"}

        async def forward_way() -> None:
            request = client.build_request("POST", url, content=BODY, headers=headers)
            response = await client.send(request, stream=True)
            async for _ in response.aiter_raw():
                pass
            await response.aclose()

        async def transport_only() -> None:
            request = httpx.Request("POST", url, content=BODY, headers=headers)
            response = await transport.handle_async_request(request)
            await response.aread()
            await response.aclose()

        pool = Http11Pool(host, port, keep=8, idle_seconds=15.0)
        timeout = httpx.Timeout(connect=5.0, read=300.0, write=300.0, pool=10.0)
        raw_headers = [(b"content-type", b"application/json")]

        async def own_pool() -> None:
            answer = await pool.send(b"POST", b"/execute", list(raw_headers), BODY, timeout)
            async for _ in answer.aiter_raw():
                pass
            await answer.aclose()

        async def two_writes() -> None:
            writer.write(HEAD)
            await writer.drain()
            writer.write(BODY)
            await _read_answer(reader)

        async def one_write() -> None:
            writer.write(HEAD + BODY)
            await _read_answer(reader)

        ways: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("httpx AsyncClient, as the forward sends", forward_way),
            ("httpx transport alone", transport_only),
            ("the broker's own pool (backends._http11), as the forward sends", own_pool),
            ("asyncio streams, head and body in two writes", two_writes),
            ("asyncio streams, one write", one_write),
        ]
        for name, way in ways:
            for _ in range(200):
                await way()
            cpu, wall = time.thread_time(), time.perf_counter()
            for _ in range(n):
                await way()
            print(f"{name}: {(time.thread_time() - cpu) / n * 1e6:.0f} µs CPU, "
                  f"{(time.perf_counter() - wall) / n * 1e6:.0f} µs wall per request")  # fmt: skip
        writer.close()
        await pool.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args()
    prefix = "127.211.7"
    farm = subprocess.Popen([sys.executable, str(FARM), prefix, "1", "8888"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert farm.stdout is not None and farm.stdout.readline().strip() == "ready"
        asyncio.run(_measure(args.n, f"http://{prefix}.1:8888/execute", f"{prefix}.1", 8888))
    finally:
        farm.kill()


if __name__ == "__main__":
    main()
