"""CPU per ``commands.run`` of the clients alone: every answer comes from memory.

    python bench/bench_async_inmemory.py [--n 2000] [--batches 9] [--no-sync] [--profile]

No broker, no runtime, no socket: an httpx transport (``httpx.AsyncBaseTransport``, and
``httpx.BaseTransport`` for the sync twins) answers every request with the bytes the local
runtime sends (captured from it: ``POST /commands`` with ``Prefer: no-live-output`` answered
whole with its ``Content-Length``, ``POST /execute`` answered with its JSON), so what is
measured is the Python work of each client around the same HTTP exchange:

  bare     ``httpx.AsyncClient.send`` of our request, its body read (the floor)
  upstream k8s_agent_sandbox ``AsyncSandbox.commands.run("true")`` (its ``[async]`` extra),
           its connector's httpx client over the memory transport
  ours     our ``AsyncSandbox.commands.run(["true"])``: the credential chain re-reading a
           projected token file at every request, the process's shared pool (its client's
           transport replaced by the memory one), the streamed start

and, unless ``--no-sync``, the sync twins (``sbare``, ``supstream``: upstream's ``Sandbox``
over ``requests`` with an adapter answering from memory, ``sours``). One event loop; the
clients take turns batch by batch (``--batches`` batches of ``--n`` calls each), and each
figure is the best batch's CPU time of this thread per call (``time.thread_time``): the
least disturbed by other work on the machine. The last lines are the same-run ratios
ours / upstream. ``--profile``: a cProfile of ours (async) on a thread-CPU clock instead.
Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import cProfile
import importlib.util
import json
import os
import platform
import pstats
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import requests
from _upstream import upstream_async_sandbox, upstream_sandbox
from k8s_agent_sandbox.models import SandboxDirectConnectionConfig
from requests.adapters import BaseAdapter

from k8s_agent_sandbox_awx import AsyncBrokerSandboxClient, BrokerSandboxClient
from k8s_agent_sandbox_awx.client._async_commands import AsyncCommands
from k8s_agent_sandbox_awx.client._commands import Commands
from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget

RUNTIME = "http://127.0.0.1:8888"
"""The address the clients are aimed at (nothing listens: the transports answer)."""

_HEAD = [(b"Server", b"agent-sandbox-local-runtime"), (b"Date", b"Wed, 02 Dec 2026 17:51:32 GMT")]
COMMANDS_ANSWER = (
    b'{"command_id":"5a958d04-fbb8-45fb-985a-d27ac3a63f06"}\n'
    b'{"type":"exit","seq":1,"data":"","exit_code":0,"state":"exited"}\n'
)
COMMANDS_HEADERS = [
    *_HEAD,
    (b"Content-Type", b"application/x-ndjson"),
    (b"Cache-Control", b"no-store"),
    (b"Content-Length", str(len(COMMANDS_ANSWER)).encode()),
    (b"Preference-Applied", b"no-live-output"),
]
EXECUTE_ANSWER = (
    b'{"stdout": "", "stderr": "", "exit_code": 0, "timed_out": false, "output_truncated": false}'
)
EXECUTE_HEADERS = [
    *_HEAD,
    (b"Content-Type", b"application/json"),
    (b"Content-Length", str(len(EXECUTE_ANSWER)).encode()),
]


class _Body(httpx.AsyncByteStream, httpx.SyncByteStream):
    """An answer's body as a network transport gives it: read (and closed) by the client."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self._data

    def __iter__(self) -> Iterator[bytes]:
        yield self._data


def _answer(request: httpx.Request) -> httpx.Response:
    if request.url.path.endswith("/execute"):
        return httpx.Response(200, headers=EXECUTE_HEADERS, stream=_Body(EXECUTE_ANSWER))
    return httpx.Response(200, headers=COMMANDS_HEADERS, stream=_Body(COMMANDS_ANSWER))


class MemoryAsync(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        return _answer(request)


class Memory(httpx.BaseTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        return _answer(request)


class MemoryAdapter(BaseAdapter):
    """``requests``' adapter answering ``/execute`` from memory (upstream's sync client)."""

    def send(self, request: Any, *args: Any, **kwargs: Any) -> requests.Response:
        response = requests.Response()
        response.status_code = 200
        response.headers.update({k.decode(): v.decode() for k, v in EXECUTE_HEADERS})
        response._content = EXECUTE_ANSWER
        response.url = request.url
        response.request = request
        response.encoding = "utf-8"
        return response

    def close(self) -> None:
        return None


def _token_file(directory: str) -> str:
    """A projected-token-shaped file (a JWT whose audience is :data:`RUNTIME`)."""

    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    now = int(time.time())
    claims = {"aud": [RUNTIME], "iss": "https://bench", "sub": "system:serviceaccount:d:d"}
    token = ".".join(
        [part({"alg": "RS256"}), part({**claims, "iat": now, "exp": now + 86400}), "c2ln"]
    )
    path = os.path.join(directory, "token")
    with open(path, "w") as fh:
        fh.write(token)
    return path


def _environ(token_file: str) -> dict[str, str]:
    return {"AGENT_SANDBOX_TOKEN_FILE": token_file, "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1"}


TARGET = RouterTarget(sandbox_id="sbx-bench", namespace="default", port=8888)
_BODY = {"command": ["true"], "timeout": 60.0, "request_id": "r", "stdin": False}
_STREAMED = {"Accept": "application/x-ndjson", "Prefer": "no-live-output"}


async def _async_clients(token_file: str) -> tuple[dict[str, Callable[[], Awaitable[Any]]], Any]:
    bare_client = httpx.AsyncClient(transport=MemoryAsync())

    async def bare() -> Any:
        request = bare_client.build_request(
            "POST", RUNTIME + "/commands", json=_BODY, headers=_STREAMED
        )
        response = await bare_client.send(request, stream=True)
        await response.aread()
        await response.aclose()

    upstream = upstream_async_sandbox(
        "sbx-bench", "default", SandboxDirectConnectionConfig(api_url=RUNTIME)
    )
    upstream.connector.client = httpx.AsyncClient(
        transport=MemoryAsync(), timeout=httpx.Timeout(60.0)
    )
    client = AsyncBrokerSandboxClient(
        broker_url=RUNTIME, allow_insecure_http=True, environ=_environ(token_file)
    )
    ours = AsyncCommands(client._transport, TARGET)
    client._transport._http.client._transport = MemoryAsync()  # the shared pool's client
    calls = {
        "bare": bare,
        "upstream": lambda: upstream.commands.run("true"),
        "ours": lambda: ours.run(["true"]),
    }

    async def close() -> None:
        await bare_client.aclose()
        await upstream.connector.client.aclose()
        await client.close()

    return calls, close


def _sync_clients(token_file: str) -> dict[str, Callable[[], Any]]:
    bare_client = httpx.Client(transport=Memory())

    def bare() -> Any:
        request = bare_client.build_request(
            "POST", RUNTIME + "/commands", json=_BODY, headers=_STREAMED
        )
        response = bare_client.send(request, stream=True)
        response.read()
        response.close()

    upstream = upstream_sandbox(
        "sbx-bench", "default", SandboxDirectConnectionConfig(api_url=RUNTIME)
    )
    for session in (upstream.connector.session, upstream.connector._no_retry_session):
        session.mount("http://", MemoryAdapter())
    client = BrokerSandboxClient(
        broker_url=RUNTIME, allow_insecure_http=True, environ=_environ(token_file)
    )
    ours = Commands(client._transport, TARGET)
    client._transport._http.client._transport = Memory()  # the shared pool's client
    return {
        "sbare": bare,
        "supstream": lambda: upstream.commands.run("true"),
        "sours": lambda: ours.run(["true"]),
    }


async def _time_async(call: Callable[[], Awaitable[Any]], n: int) -> float:
    started = time.thread_time()
    for _ in range(n):
        await call()
    return time.thread_time() - started


def _time_sync(call: Callable[[], Any], n: int) -> float:
    started = time.thread_time()
    for _ in range(n):
        call()
    return time.thread_time() - started


async def _measure_async(token_file: str, args: Any) -> dict[str, float]:
    calls, close = await _async_clients(token_file)
    try:
        for call in calls.values():
            assert (await _time_async(call, 50)) >= 0  # warm
        best = dict.fromkeys(calls, float("inf"))
        for batch in range(args.batches):
            names = list(calls)
            for name in names[batch % 3 :] + names[: batch % 3]:
                best[name] = min(best[name], await _time_async(calls[name], args.n) / args.n * 1e6)
        return best
    finally:
        await close()


def _measure_sync(token_file: str, args: Any) -> dict[str, float]:
    calls = _sync_clients(token_file)
    for call in calls.values():
        _time_sync(call, 50)  # warm
    best = dict.fromkeys(calls, float("inf"))
    for batch in range(args.batches):
        names = list(calls)
        for name in names[batch % 3 :] + names[: batch % 3]:
            best[name] = min(best[name], _time_sync(calls[name], args.n) / args.n * 1e6)
    return best


async def _profile(token_file: str, args: Any) -> None:
    calls, close = await _async_clients(token_file)
    try:
        ours = calls["ours"]
        await _time_async(ours, 50)
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        await _time_async(ours, args.n)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(35)
    finally:
        await close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="calls per batch (default 2000)")
    parser.add_argument("--batches", type=int, default=9, help="batches per client (default 9)")
    parser.add_argument("--no-sync", action="store_true", help="only the async clients")
    parser.add_argument("--profile", action="store_true", help="cProfile ours (async) instead")
    args = parser.parse_args()
    if importlib.util.find_spec("kubernetes_asyncio") is None:
        raise SystemExit("upstream's async client needs its [async] extra (kubernetes_asyncio)")
    os.environ["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    with tempfile.TemporaryDirectory() as directory:
        token_file = _token_file(directory)
        if args.profile:
            asyncio.run(_profile(token_file, args))
            return
        best = asyncio.run(_measure_async(token_file, args))
        if not args.no_sync:
            best |= _measure_sync(token_file, args)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"commands.run from memory, best of {args.batches} batches of {args.n}; {when}; "
        f"load average {load}; Python {platform.python_version()}, httpx {httpx.__version__}"
    )
    for name, figure in best.items():
        print(f"  {name:10} {figure:7.1f} µs CPU per call")
    print(
        f"async ours / upstream {best['ours'] / best['upstream']:.2f}x "
        f"({best['ours'] - best['upstream']:+.1f} µs); over bare httpx: "
        f"ours {best['ours'] - best['bare']:+.1f} µs, upstream "
        f"{best['upstream'] - best['bare']:+.1f} µs"
    )
    if not args.no_sync:
        print(
            f"sync  ours / upstream {best['sours'] / best['supstream']:.2f}x "
            f"({best['sours'] - best['supstream']:+.1f} µs); ours over bare httpx "
            f"{best['sours'] - best['sbare']:+.1f} µs"
        )


if __name__ == "__main__":
    main()
