"""Fault injection for managed-command event streams (``GET /commands/{id}/events``).

The broker passes an event stream through :meth:`StreamPlan.apply` when a rule matches: it
forwards whole NDJSON lines only, so it can end the stream after N lines or S seconds at a line
boundary (as a proxy timeout would), or send half of a line and then drop the connection.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

EVENTS_PATH = re.compile(r"^/commands/[^/]+/events$")


class StreamDropped(Exception):
    """The plan sent part of a line; the broker must now drop the connection."""


@dataclass
class CutRule:
    """End every matching event stream after ``after_events`` lines or ``after_seconds``."""

    after_events: int | None
    after_seconds: float | None
    sandbox: str | None


@dataclass
class DropRule:
    """The next ``remaining`` matching streams: after ``after_events`` lines, half a line, drop."""

    remaining: int
    after_events: int
    sandbox: str | None


@dataclass
class StreamPlan:
    """What to do to one event stream."""

    cut: CutRule | None
    drop_after: int | None
    take_drop: Callable[[], bool]
    """Consumes one use of the drop rule; ``False`` when another stream used it up meanwhile."""

    async def apply(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        seconds = self.cut.after_seconds if self.cut is not None else None
        max_lines = self.cut.after_events if self.cut is not None else None
        deadline = None if seconds is None else loop.time() + seconds
        pending = b""
        lines = 0
        upstream = chunks.__aiter__()
        while True:
            try:
                if deadline is None:
                    chunk = await upstream.__anext__()
                else:
                    remaining = max(0.0, deadline - loop.time())
                    chunk = await asyncio.wait_for(upstream.__anext__(), remaining)
            except StopAsyncIteration:
                if pending:
                    yield pending  # the runtime ended inside a line: pass that on unchanged
                return
            except TimeoutError:
                return  # cut at a line boundary: the part of a line held back is never sent
            pending += chunk
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                line += b"\n"
                if lines == self.drop_after and self.take_drop():
                    yield line[: max(1, len(line) // 2)]
                    raise StreamDropped(f"injected: event stream dropped inside line {lines + 1}")
                yield line
                lines += 1
                if max_lines is not None and lines >= max_lines:
                    return
