"""Large files written and read back through the broker with bounded client memory: 256 MiB from
a file object (``read_to``), 512 MiB from a generator (``format="stream"``), each 4 or 8 times
the limit: the client's peak RSS may grow by 64 MiB at most, and a buffered body would grow it
by the size. docs/client.md's 2 GiB figure: ``AGENT_SANDBOX_TEST_LARGE_FILE_BYTES=2147483648``
(``memory.SIZE_VARIABLE``) runs both with 2 GiB."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.memory import large_file_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SIZE = large_file_bytes(512 * 1024**2)  # the generator's round trip: 8x the limit
FILE_SIZE = large_file_bytes(256 * 1024**2)  # the file object's: 4x the limit
LIMIT = 64 * 1024**2

# Runs in a fresh interpreter (``round_trip_growth``), which defines SIZE and vm_hwm_kib().
CLIENT = r"""
import io
from k8s_agent_sandbox_awx import Sandbox

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
    sb.files.write("big/large.bin", source)
    sink = Sink()
    n = sb.files.read_to("big/large.bin", sink)
    peak = vm_hwm_kib()
print(json.dumps({"base_kib": base, "peak_kib": peak, "size": n,
                  "same": source.digest.hexdigest() == sink.digest.hexdigest()}))
"""


def test_file_object_round_trip_with_bounded_memory(round_trip_growth: Any) -> None:
    growth = round_trip_growth(CLIENT, FILE_SIZE)  # asserts every byte came back unchanged
    mib = growth / 2**20
    print(f"client peak RSS growth for {FILE_SIZE / 2**20:.0f} MiB up+down: {mib:.1f} MiB")
    assert growth < LIMIT


# A generator written with files.write and read back with read(format="stream").
CLIENT_GENERATOR = r"""
from k8s_agent_sandbox_awx import Sandbox

sent = hashlib.sha256()

def generated():
    block = os.urandom(1024 * 1024)
    for _ in range(SIZE // len(block)):
        sent.update(block)
        yield block

with Sandbox.create(ready_timeout=60, request_timeout=120) as sb:
    sb.files.write("warm.bin", iter([b"x" * 4096]))
    b"".join(sb.files.read("warm.bin", format="stream"))
    base = vm_hwm_kib()
    info = sb.files.write("big/gen.bin", generated())
    got, n = hashlib.sha256(), 0
    for chunk in sb.files.read("big/gen.bin", format="stream"):
        got.update(chunk)
        n += len(chunk)
    peak = vm_hwm_kib()
print(json.dumps({"base_kib": base, "peak_kib": peak, "size": n,
                  "same": info.size == SIZE and sent.hexdigest() == got.hexdigest()}))
"""


def test_generator_write_and_stream_read_with_bounded_memory(round_trip_growth: Any) -> None:
    growth = round_trip_growth(CLIENT_GENERATOR, SIZE)
    mib, size = growth / 2**20, SIZE / 2**20
    print(
        f"client peak RSS growth for a {size:.0f} MiB generator write + stream read: {mib:.1f} MiB"
    )
    assert growth <= LIMIT
