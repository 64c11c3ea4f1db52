"""One ``run_code`` execution: its events, their sequence numbers, and the stream that sends them.

An execution's events (docs/broker-api.md, "Code") are ``stdout`` and ``stderr`` (text as it
arrives, with a ``timestamp`` in nanoseconds), ``result`` (one per value shown: the last
expression's, ``display(obj)``'s, a matplotlib figure's; ``is_main_result`` marks the first),
``error`` (``name``, ``value``, ``traceback``) and last ``end`` (``state``, ``execution_count``,
``timed_out``, ``restarted``, ``output_truncated``). Their ``seq`` are contiguous from 1; a
``heartbeat`` repeats the last ``seq`` while nothing happens. Every event is kept until the
execution is forgotten (so a stream resumes from any cursor): at most ``output_bytes`` of
them, beyond which output is dropped and results are replaced by a note (the ``end`` event
says ``output_truncated``).

Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._command import _timestamp
from ._http import Exchange, start_ndjson

RESULT_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
"""A display bundle's MIME types and the fields of a ``result`` event that carry them (E2B's
names); any other type goes into its ``extra``."""
ENDED = ("done", "timed_out", "interrupted", "context_died", "failed")
"""The states of an execution that ended (``running`` before)."""


def _line(event: Mapping[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def result_event(data: Mapping[str, Any], main: bool) -> dict[str, Any]:
    """A ``result`` event of the kernel's display bundle ``data`` (``main``: the value of the
    cell's last expression)."""
    event: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        if mime == "_dropped":
            event["dropped"] = [RESULT_FIELDS.get(m, m) for m in value if isinstance(m, str)]
        elif mime in RESULT_FIELDS:
            event[RESULT_FIELDS[mime]] = value
        else:
            extra[mime] = value
    if extra:
        event["extra"] = extra
    return event


@dataclass
class Execution:
    """One execution of code in a context, and its events."""

    execution_id: str
    context_id: str
    request_id: str | None
    request: dict[str, Any]
    timeout: float
    """Its time limit in seconds (``math.inf``: none)."""
    limit_bytes: int
    started_at: float = field(default_factory=time.time)
    deadline: float = math.inf
    """When it is interrupted (``time.monotonic()``), once it runs."""
    kill_at: float | None = None
    """When its interpreter is killed if the interrupt did not end it (``time.monotonic()``)."""
    interrupted: str | None = None
    """Why it was interrupted: ``timeout`` or ``request`` (``POST .../interrupt``)."""
    started: bool = False
    """Whether the kernel said ``started`` (a ``SIGINT`` reaches the cell from then on)."""
    signal_pending: bool = False
    """An interrupt came before ``started``: its ``SIGINT`` is sent then."""
    state: str = "running"
    execution_count: int | None = None
    ended_at: float | None = None
    lines: list[bytes] = field(default_factory=list)
    size: int = 0
    truncated: bool = False
    errored: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def last_seq(self) -> int:
        return len(self.lines)

    @property
    def ended(self) -> bool:
        return self.state != "running"

    def add(self, event: dict[str, Any], *, output: bool = False) -> None:
        """Append ``event`` (its ``seq`` is set), within the execution's limit: beyond it an
        output event is dropped and a result replaced by a note."""
        with self.cond:
            if self.ended:
                return
            line = _line({**event, "seq": self.last_seq + 1})
            if self.size + len(line) > self.limit_bytes and event["type"] != "error":
                self.truncated = True
                if output:  # what fits is kept (the start of it), the rest dropped
                    room = self.limit_bytes - self.size - (len(line) - len(event["data"]))
                    if room <= 0 or self.size >= self.limit_bytes:
                        return
                    event = {**event, "data": event["data"][: room // 2]}
                    line = _line({**event, "seq": self.last_seq + 1})
                else:
                    line = _line(self._over_limit(event, len(line)))
            self.size += len(line)
            self.lines.append(line)
            self.errored = self.errored or event["type"] == "error"
            self.cond.notify_all()

    def _over_limit(self, event: dict[str, Any], size: int) -> dict[str, Any]:
        kept: dict[str, Any] = {k: event[k] for k in ("type", "is_main_result") if k in event}
        note = (
            f"[a result of {size} bytes was left out: this execution's events are over the "
            f"runtime's limit of {self.limit_bytes} bytes (SANDBOX_CODE_OUTPUT_LIMIT_BYTES)]"
        )
        dropped = [f for f in (*RESULT_FIELDS.values(), "extra") if f in event and f != "text"]
        return {**kept, "text": note, "dropped": dropped, "seq": self.last_seq + 1}

    def end(self, state: str, *, restarted: bool = False) -> None:
        """Append the ``end`` event: the execution ended in ``state``."""
        with self.cond:
            if self.ended:
                return
            event = {
                "type": "end",
                "seq": self.last_seq + 1,
                "state": state,
                "execution_count": self.execution_count,
                "timed_out": self.interrupted == "timeout",
                "restarted": restarted,
                "output_truncated": self.truncated,
            }
            self.lines.append(_line(event))
            self.state = state
            self.ended_at = time.time()
            self.cond.notify_all()

    def summary(self) -> dict[str, Any]:
        with self.cond:
            return {
                "execution_id": self.execution_id,
                "context_id": self.context_id,
                "request_id": self.request_id,
                "state": self.state,
                "execution_count": self.execution_count,
                "last_seq": self.last_seq,
                "timeout": self.timeout if math.isfinite(self.timeout) else None,
                "started_at": _timestamp(self.started_at),
                "ended_at": _timestamp(self.ended_at),
            }


@dataclass(frozen=True)
class StreamSettings:
    """How long an event stream stays open, and how often it beats when idle."""

    duration: float
    heartbeat: float
    send_grace: float = 5.0
    """Seconds past ``duration`` its sends may take before the connection is closed (a reader
    that stops reading never holds the thread)."""


def stream(
    exchange: Exchange,
    execution: Execution,
    after: int,
    settings: StreamSettings,
    first: dict[str, Any] | None = None,
) -> None:
    """A ``200`` NDJSON answer: ``first`` (the streamed start's line), then the execution's
    events after ``after``, as they come, until its ``end`` event or ``settings.duration``;
    heartbeats while nothing happens. A reader that does not read gets its connection closed
    once the stream's time is up (it continues from its cursor)."""
    sock = exchange.connection
    start = time.monotonic()
    deadline = start + settings.duration
    send_by = deadline + settings.send_grace

    def send(data: bytes) -> None:
        sock.settimeout(max(0.001, send_by - time.monotonic()))
        exchange.wfile.write(data)

    try:
        sock.settimeout(send_by - start)  # the status line and headers too
        start_ndjson(exchange)
        if first is not None:
            send(_chunk(_line(first)))
        cursor = after
        while True:
            beat = min(deadline, time.monotonic() + settings.heartbeat)
            batch, ended = _wait_events(execution, cursor, beat)
            if batch:
                send(_chunk(b"".join(batch)))
                cursor += len(batch)
            if (ended and cursor >= execution.last_seq) or time.monotonic() >= deadline:
                break
            if not batch:
                send(_chunk(_line({"type": "heartbeat", "seq": cursor})))
        send(b"0\r\n\r\n")
    except OSError:  # the reader went away, or did not read within the stream's time
        exchange.close_connection = True
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(None)


def _wait_events(execution: Execution, cursor: int, until: float) -> tuple[list[bytes], bool]:
    """The events after ``cursor`` (waiting for some until ``until``), and whether the
    execution ended."""
    with execution.cond:
        while execution.last_seq <= cursor and not execution.ended:
            left = until - time.monotonic()
            if left <= 0:
                break
            execution.cond.wait(left)
        return execution.lines[cursor:], execution.ended


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
