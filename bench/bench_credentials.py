"""Per-request credential cost: what the client pays before every request to the broker.

    .venv/bin/python bench/bench_credentials.py

Measures ``get_credential(audience)`` (sync) and ``await aget_credential(audience)`` (async, on
one running event loop) on already-discovered sources (discovery is a one-time cost): a
file-backed source (re-read on every request: open/read/close, strip, checks with the memoised
claims) and a cached source (the process cache). The baseline is a plain ``open(path).read()`` of
the same file in the same process. The "rejected" rows measure the alternative the async path
does not take: handing the file read to a worker thread (``asyncio.to_thread``). Goals on this
machine, for both paths: file < 30 µs, cached < 5 µs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import sys
import tempfile
import time
import timeit
from collections.abc import Awaitable, Callable

from k8s_agent_sandbox_awx import Credential, DefaultCredentials, KubernetesAuth, OIDCTokenAuth

BROKER = "https://sandbox-broker.example"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def projected_like_token() -> str:
    """A token shaped like a real projected ServiceAccount token (RS256 size, ~1 KB)."""
    now = int(time.time())
    header = {"alg": "RS256", "kid": secrets.token_hex(20)}
    payload = {
        "aud": [BROKER],
        "exp": now + 3600,
        "iat": now,
        "nbf": now,
        "iss": "https://kubernetes.default.svc.cluster.local",
        "jti": secrets.token_hex(16),
        "sub": "system:serviceaccount:team-a:agent",
        "kubernetes.io": {
            "namespace": "team-a",
            "serviceaccount": {"name": "agent", "uid": secrets.token_hex(16)},
            "pod": {"name": "agent-7d9f8-x2x9z", "uid": secrets.token_hex(16)},
        },
    }
    signature = secrets.token_bytes(256)
    return ".".join(
        (_b64(json.dumps(header).encode()), _b64(json.dumps(payload).encode()), _b64(signature))
    )


def per_call_us(function: Callable[[], object], number: int = 20_000, repeat: int = 7) -> float:
    function()
    best = min(timeit.repeat(function, number=number, repeat=repeat))
    return best / number * 1e6


def per_await_us(
    function: Callable[[], Awaitable[object]], number: int = 20_000, repeat: int = 7
) -> float:
    """Like :func:`per_call_us` for ``await function()``, on one running event loop."""

    async def measure() -> float:
        await function()
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(number):
                await function()
            best = min(best, time.perf_counter() - start)
        return best

    return asyncio.run(measure()) / number * 1e6


Row = tuple[str, float, float | None, float | None]
"""(source, sync µs/call, async µs/call or None, goal µs or None)"""


def main() -> int:
    token = projected_like_token()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "agent-sandbox-token")
        with open(path, "w") as f:
            f.write(token + "\n")

        def baseline() -> str:
            with open(path) as f:
                return f.read()

        def baseline_raw() -> bytes:
            fd = os.open(path, os.O_RDONLY)
            try:
                return os.read(fd, 65536)
            finally:
                os.close(fd)

        async def raw_inline() -> bytes:
            return baseline_raw()

        async def raw_in_thread() -> bytes:
            return await asyncio.to_thread(baseline_raw)

        async def k8s_in_thread() -> Credential:
            return await asyncio.to_thread(k8s.get_credential, BROKER)

        quiet = {"AGENT_SANDBOX_LOAD_PLUGINS": ""}
        file_chain = DefaultCredentials(quiet, _token_path=path)
        file_chain.get_credential(BROKER)  # discovery
        k8s = KubernetesAuth(path)
        env_chain = DefaultCredentials({**quiet, "AGENT_SANDBOX_TOKEN": token}, _token_path=path)
        env_chain.get_credential(BROKER)
        callable_auth = OIDCTokenAuth(lambda: token)
        callable_auth.get_credential(BROKER)

        base = per_call_us(baseline)
        rows: list[Row] = [
            ("baseline: open(path).read()", base, None, None),
            (
                "baseline: os.open/os.read/os.close (async: inline)",
                per_call_us(baseline_raw),
                per_await_us(raw_inline),
                None,
            ),
            (
                "rejected: the same read in asyncio.to_thread",
                float("nan"),
                per_await_us(raw_in_thread, number=2_000, repeat=5),
                None,
            ),
            (
                "file:   DefaultCredentials (kubernetes-projected)",
                per_call_us(lambda: file_chain.get_credential(BROKER)),
                per_await_us(lambda: file_chain.aget_credential(BROKER)),
                30.0,
            ),
            (
                "file:   KubernetesAuth(path)",
                per_call_us(lambda: k8s.get_credential(BROKER)),
                per_await_us(lambda: k8s.aget_credential(BROKER)),
                30.0,
            ),
            (
                "rejected: KubernetesAuth read in asyncio.to_thread",
                float("nan"),
                per_await_us(k8s_in_thread, number=2_000, repeat=5),
                None,
            ),
            (
                "cached: DefaultCredentials (AGENT_SANDBOX_TOKEN)",
                per_call_us(lambda: env_chain.get_credential(BROKER)),
                per_await_us(lambda: env_chain.aget_credential(BROKER)),
                5.0,
            ),
            (
                "cached: OIDCTokenAuth(callable)",
                per_call_us(lambda: callable_auth.get_credential(BROKER)),
                per_await_us(lambda: callable_auth.aget_credential(BROKER)),
                5.0,
            ),
        ]
    print(
        f"Per-request credential cost (token {len(token)} chars, Python {sys.version.split()[0]})"
    )
    columns = ("sync µs", "async µs", "x baseline", "goal (both paths)")
    print(f"{'source':<52} {columns[0]:>8} {columns[1]:>9} {columns[2]:>11} {columns[3]:>20}")
    failed = False
    for name, sync_us, async_us, goal in rows:
        verdict = ""
        if goal is not None:
            worst = max(sync_us, async_us if async_us is not None else sync_us)
            ok = worst < goal
            failed |= not ok
            verdict = f"< {goal:g} µs {'ok' if ok else 'MISSED'}"
        sync_text = "-" if sync_us != sync_us else f"{sync_us:.2f}"  # NaN: not applicable
        async_text = "-" if async_us is None else f"{async_us:.2f}"
        ratio = max(x for x in (sync_us, async_us or 0.0) if x == x) / base
        print(f"{name:<52} {sync_text:>8} {async_text:>9} {ratio:>11.2f} {verdict:>20}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
