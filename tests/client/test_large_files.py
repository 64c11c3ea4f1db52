"""Large files written and read back through the broker with bounded client memory: 1 GiB from a
file object (``read_to``), 2 GiB from a generator (``format="stream"``, docs/client.md's figure).
The client's peak RSS may grow by 64 MiB at most: a buffered body would grow it by the size."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SIZE = 2 * 1024**3
FILE_SIZE = 1024**3  # the file-object round trip: 16x the limit proves it streams
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
    sb.files.write("big/1g.bin", source)
    sink = Sink()
    n = sb.files.read_to("big/1g.bin", sink)
    peak = vm_hwm_kib()
print(json.dumps({"base_kib": base, "peak_kib": peak, "size": n,
                  "same": source.digest.hexdigest() == sink.digest.hexdigest()}))
"""


def test_1gib_round_trip_with_bounded_memory(round_trip_growth: Any) -> None:
    growth = round_trip_growth(CLIENT, FILE_SIZE)  # asserts every byte came back unchanged
    print(f"client peak RSS growth for 1 GiB up+down: {growth / 2**20:.1f} MiB")
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


def test_2gib_generator_write_and_stream_read_with_bounded_memory(
    round_trip_growth: Any,
) -> None:
    growth = round_trip_growth(CLIENT_GENERATOR, SIZE)
    mib = growth / 2**20
    print(f"client peak RSS growth for a 2 GiB generator write + stream read: {mib:.1f} MiB")
    assert growth <= LIMIT
