"""A 256 MiB file written (from an async iterable) and read back (``read(format="stream")``)
through the broker with the async client, with bounded client memory (4 times the limit; any
size: ``AGENT_SANDBOX_TEST_LARGE_FILE_BYTES``, as in test_large_files.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.memory import large_file_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SIZE = large_file_bytes(256 * 1024**2)  # 4x the limit: a buffered body grows the RSS by it
LIMIT = 64 * 1024**2

# Runs in a fresh interpreter (``round_trip_growth``), which defines SIZE and vm_hwm_kib().
CLIENT = r"""
import asyncio
from k8s_agent_sandbox_awx import AsyncSandbox

class Sink:
    def __init__(self):
        self.digest = hashlib.sha256()
    async def write(self, data):
        self.digest.update(data)
        return len(data)

async def main():
    block = os.urandom(1024 * 1024)
    sent = hashlib.sha256()

    async def generated():
        left = SIZE
        while left:
            data = block[: min(left, len(block))]
            left -= len(data)
            sent.update(data)
            yield data

    async with await AsyncSandbox.create(ready_timeout=60, request_timeout=120) as sb:
        await sb.files.write("warm.bin", b"x" * 4096)
        await sb.files.read_to("warm.bin", Sink())
        base = vm_hwm_kib()
        info = await sb.files.write("big/large.bin", generated())
        sink, n = Sink(), 0
        async for chunk in await sb.files.read("big/large.bin", format="stream"):
            await sink.write(chunk)
            n += len(chunk)
        peak = vm_hwm_kib()
    return {"base_kib": base, "peak_kib": peak, "size": n,
            "same": info.size == SIZE and sent.hexdigest() == sink.digest.hexdigest()}

print(json.dumps(asyncio.run(main())))
"""


def test_async_round_trip_with_bounded_memory(round_trip_growth: Any) -> None:
    growth = round_trip_growth(CLIENT, SIZE)  # asserts that every byte came back unchanged
    mib = growth / 2**20
    print(f"async client peak RSS growth for {SIZE / 2**20:.0f} MiB up+down: {mib:.1f} MiB")
    assert growth < LIMIT
