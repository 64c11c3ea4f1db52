"""What the terminal tests share: a ``Screen`` that collects a terminal's output bytes (an
``on_data`` callback, from any thread) and waits for a pattern in it, and the deterministic
producers whose output a test compares byte for byte."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time

__all__ = ["PRODUCER", "Screen", "produced", "producer_argv"]

PRODUCER = (
    "import sys, time\n"
    "out = sys.stdout.buffer\n"
    "for i in range(1, int(sys.argv[1]) + 1):\n"
    "    out.write(b'line-%d \\xff\\xfe\\xe2\\x82\\n' % i)\n"
    "    out.flush()\n"
    "    time.sleep(0.001)\n"
)
"""A program writing ``N`` numbered lines, each with bytes that are not UTF-8 (and a UTF-8
sequence cut short), one write per line: many small output events."""


def producer_argv(lines: int) -> list[str]:
    return [sys.executable, "-c", PRODUCER, str(lines)]


def produced(lines: int) -> bytes:
    """What :data:`PRODUCER` shows on a terminal (which turns ``\\n`` into ``\\r\\n``)."""
    return b"".join(b"line-%d \xff\xfe\xe2\x82\r\n" % i for i in range(1, lines + 1))


class Screen:
    """A terminal's output so far; ``expect`` waits for a pattern (bytes regex) in what came
    after the previous match."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.chunks = 0
        self._seen = 0
        self._changed = threading.Condition()

    def __call__(self, chunk: bytes) -> None:
        assert isinstance(chunk, bytes), chunk
        with self._changed:
            self.data += chunk
            self.chunks += 1
            self._changed.notify_all()

    def expect(self, pattern: bytes, timeout: float = 15.0) -> re.Match[bytes]:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        with self._changed:
            while (found := regex.search(self.data, self._seen)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{pattern!r} not shown in {timeout}s: {bytes(self.data)!r}"
                    )
                self._changed.wait(left)
            self._seen = found.end()
            return found

    async def aexpect(
        self,
        pattern: bytes,
        timeout: float = 15.0,  # noqa: ASYNC109
    ) -> re.Match[bytes]:
        """``expect`` for an event loop (whose tasks fill the screen): it polls."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while (found := regex.search(self.data, self._seen)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not shown in {timeout}s: {bytes(self.data)!r}")
            await asyncio.sleep(0.01)
        self._seen = found.end()
        return found
