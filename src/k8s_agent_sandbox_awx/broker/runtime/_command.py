"""One managed command: its output events, their sequence numbers and their retention.

Retention: the first ``output_bytes`` (1 MiB) of output are kept for replay; later events are kept
only in a live window of the most recent ``window_bytes`` (1 MiB). The window never drops an event
that a follower (an event stream, open or ended less than ``FOLLOWER_GRACE_SECONDS`` ago) may not
have received: everything after the cursor its request continued from, the protocol's only
acknowledgement (what a stream sent may still be in socket buffers or a proxy when the connection
breaks). A request continuing from within what one ended stream sent replaces it; when several
streams' ranges hold its cursor (two readers with overlapping ranges), those keep their pins for
their grace time. A stream ends once it has sent ``unacked_bytes`` (16 MiB) of window output past
that cursor, so the client continues from its cursor and acknowledges it; the command's pipes are
not read while a follower that holds has a window's size of output it was not sent
(backpressure: the command blocks on its writes). A follower does not hold once its send has
made no progress for the grace time (its reader does not read), once it ended so, or once a
later request continued from within what it sent: its pin then gives way beyond the window's
size plus ``unacked_bytes``. Every send of a stream must be done by its duration plus the grace
time, else the runtime closes the connection (the reader continues from its cursor). After the
exit the window returns to its size once its followers acknowledged or their grace ended. A
replay from the start finds the events between the two gone: the request is ``410`` naming the
lost range and the cursor to resume from. The ``exit`` event is always kept.

Standard library only.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

FOLLOWER_GRACE_SECONDS = 5.0
REPEATS_THAT_HOLD = 2
"""How many times in a row a reader may come back with the cursor its previous stream continued
from although that stream sent it more (its events were lost on the way: a broken connection)
and still hold the command; the next such request, from a reader that reads but never moves
its cursor (one that replays from ``after=0`` again and again), no longer does."""


@dataclass(frozen=True)
class Limits:
    """The runtime's limits for managed commands (see ``from_environ`` for the variables)."""

    output_bytes: int = 1024 * 1024
    window_bytes: int = 1024 * 1024
    unacked_bytes: int = 16 * 1024 * 1024
    """The most output beyond the cap one event stream sends past the cursor it continued from
    (then it ends, and the client continues from its cursor: that acknowledges it)."""
    max_running: int = 16
    max_handles: int = 64
    retention_seconds: float = 900.0
    default_timeout: float = 60.0
    max_timeout: float = 300.0
    heartbeat_seconds: float = 2.0
    max_duration: float = 20.0
    follower_grace_seconds: float = FOLLOWER_GRACE_SECONDS
    stream_start: bool = True
    """Answer ``POST /commands`` with ``Accept: application/x-ndjson`` by a stream of events."""
    pty: bool = True
    """Run commands on a pseudo-terminal when their start asks (``"pty"``), and resize them."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], max_timeout: float) -> Limits:
        """Limits from ``SANDBOX_COMMAND_*`` variables; a bad value is a ``ValueError``."""

        def number(name: str, default: float, kind: type[int] | type[float]) -> Any:
            return positive_number(environ, name, default, kind)

        limits = cls(
            output_bytes=number("SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES", cls.output_bytes, int),
            window_bytes=number("SANDBOX_COMMAND_LIVE_WINDOW_BYTES", cls.window_bytes, int),
            unacked_bytes=number("SANDBOX_COMMAND_UNACKED_BYTES", cls.unacked_bytes, int),
            max_running=number("SANDBOX_COMMAND_MAX_RUNNING", cls.max_running, int),
            max_handles=number("SANDBOX_COMMAND_MAX_HANDLES", cls.max_handles, int),
            retention_seconds=number(
                "SANDBOX_COMMAND_RETENTION_SECONDS", cls.retention_seconds, float
            ),
            heartbeat_seconds=number(
                "SANDBOX_COMMAND_HEARTBEAT_SECONDS", cls.heartbeat_seconds, float
            ),
            follower_grace_seconds=number(
                "SANDBOX_COMMAND_FOLLOWER_GRACE_SECONDS", cls.follower_grace_seconds, float
            ),
            max_timeout=max_timeout,
            default_timeout=min(cls.default_timeout, max_timeout),
            stream_start=environ.get("SANDBOX_COMMAND_STREAM_START", "1") != "0",
            pty=environ.get("SANDBOX_COMMAND_PTY", "1") != "0",
        )
        if limits.max_handles < limits.max_running:
            raise ValueError(
                f"SANDBOX_COMMAND_MAX_HANDLES={limits.max_handles} must be at least "
                f"SANDBOX_COMMAND_MAX_RUNNING={limits.max_running}"
            )
        return limits


def positive_number(
    environ: Mapping[str, str], name: str, default: float, kind: type[int] | type[float]
) -> Any:
    """The runtime's setting ``name`` (``default`` when unset): a number of ``kind`` above 0,
    else a ``ValueError`` naming the variable and the rule."""
    raw = environ.get(name)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: must be a positive {kind.__name__}")
    return value


def _timestamp(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _utf8_prefix(text: str, size: int) -> str:
    """The longest start of ``text`` whose UTF-8 encoding has at most ``size`` bytes."""
    if text.isascii():
        return text[:size]
    raw = text.encode()[: size + 1]
    cut = min(size, len(raw))
    while 0 < cut < len(raw) and raw[cut] & 0xC0 == 0x80:  # inside a character: back off
        cut -= 1
    return raw[:cut].decode()


def _line(event: Mapping[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


_RARE_CONTROLS = tuple(bytes([c]) for c in range(32) if c not in (9, 10, 13))
_ESCAPES = ((b"\\", b"\\\\"), (b'"', b'\\"'), (b"\n", b"\\n"), (b"\r", b"\\r"), (b"\t", b"\\t"))


def _output_line(kind: str, seq: int, data: str) -> bytes:
    """The NDJSON line of an output event, as ``_line`` makes it but cheaper for the usual
    output (no control characters but tab, newline and carriage return: a few replaces of the
    UTF-8 bytes instead of ``json``'s character by character escaping, the fastest path for a
    command that prints a lot)."""
    raw = data.encode()
    if any(control in raw for control in _RARE_CONTROLS):
        return _line({"type": kind, "seq": seq, "data": data})
    for plain, escaped in _ESCAPES:
        raw = raw.replace(plain, escaped)
    return b"".join((b'{"type":"%s","seq":%d,"data":"' % (kind.encode(), seq), raw, b'"}\n'))


@dataclass
class _Event:
    seq: int
    kind: str
    data: str
    size: int
    offset: int
    """Output bytes before this event (so ``offset + size`` is where it ends)."""
    line: bytes


_SERIALS = itertools.count(1)


@dataclass
class _Follower:
    """An event stream: ``acked``, the cursor its request continued from (its reader is known to
    have every event up to it: the protocol's only acknowledgement), and ``cursor``, the seq of
    the last event it sent (or is sending). What it sent after ``acked`` may still be in flight
    (socket buffers, a proxy) and lost if the connection breaks: it is kept until the
    follower's grace time after its stream ended, unless its own reader is known to have come
    back (see ``Command.follow``).

    ``holds``: whether the reader waits for it (backpressure) when it has a window's size of
    output it was not sent, and whether its pin holds beyond the window's bound (see
    ``Command.evict``). A stream whose send has made no progress for the grace time does not
    hold (its reader does not read), nor one that ended so, nor one that ended after a later
    request continued from within what it sent (perhaps its own reader, perhaps another)."""

    acked: int
    cursor: int
    ended_at: float | None = None
    holds: bool = True
    repeats: int = 0
    """How many requests in a row came back with this ``acked`` after a stream sent more."""
    sending_since: float | None = None
    """While a chunk is being sent: when the send started or last made progress."""
    serial: int = field(default_factory=lambda: next(_SERIALS))

    def stalled(self, now: float, grace: float) -> bool:
        """Its send has made no progress for ``grace`` seconds: its reader does not read."""
        return self.sending_since is not None and now - self.sending_since >= grace

    def holding(self, now: float, grace: float) -> bool:
        return self.holds and not self.stalled(now, grace)


@dataclass
class Command:
    """One managed command and its output events."""

    command_id: str
    request_id: str | None
    request: dict[str, Any]
    argv: list[str]
    cwd: str
    timeout: float
    stdin_requested: bool
    started_at: float
    proc: subprocess.Popen[bytes] | None = None
    state: str = "running"
    exit_code: int | None = None
    ended_at: float | None = None
    killed_by: str | None = None
    retained: list[_Event] = field(default_factory=list)
    window: deque[_Event] = field(default_factory=deque)
    window_size: int = 0
    retained_size: int = 0
    output_size: int = 0
    output_truncated: bool = False
    last_seq: int = 0
    exit_event: _Event | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    done: threading.Event = field(default_factory=threading.Event)
    stdin_lock: threading.Lock = field(default_factory=threading.Lock)
    stdin_open: bool = False
    followers: list[_Follower] = field(default_factory=list)
    pty: tuple[int, int] | None = None
    """``(cols, rows)`` of a command run on a pseudo-terminal (``None``: pipes)."""
    master_fd: int | None = None
    """The pty's master while the command's output is read (under ``cond``; users ``os.dup``
    it, so that its closing never hands its number to another file under them)."""

    # -- events (callers hold ``cond``) --------------------------------------------------------
    def append(self, kind: str, data: str, size: int, limits: Limits, **extra: Any) -> None:
        """Add an event (``size``: its UTF-8 bytes). Output that crosses the retention cap is
        split there: exactly the first ``output_bytes`` are kept (whole characters)."""
        room = limits.output_bytes - self.retained_size
        if not extra and not self.output_truncated and 0 < room < size:
            kept = _utf8_prefix(data, room)
            if kept:
                kept_size = len(kept) if kept.isascii() else len(kept.encode())
                self._add(kind, kept, kept_size, limits)
                data, size = data[len(kept) :], size - kept_size
        self._add(kind, data, size, limits, **extra)

    def _add(self, kind: str, data: str, size: int, limits: Limits, **extra: Any) -> None:
        self.last_seq += 1
        event = _Event(
            self.last_seq,
            kind,
            data,
            size,
            self.output_size,
            _line({"type": kind, "seq": self.last_seq, "data": data, **extra})
            if extra
            else _output_line(kind, self.last_seq, data),
        )
        self.output_size += size
        if kind == "exit":
            self.exit_event = event
        if not self.output_truncated and self.retained_size + size <= limits.output_bytes:
            self.retained.append(event)
            self.retained_size += size
        else:
            self.output_truncated = True
            event.data = ""  # only its line is sent again; the status shows the retained text
            self.window.append(event)
            self.window_size += size
            self.evict(limits)
        self.cond.notify_all()

    def evict(self, limits: Limits) -> bool:
        """Drop the window's oldest events beyond its size, but never one that a follower may
        not have received (after its ``acked`` cursor) while it holds; the pin of a follower
        that does not hold (see ``_Follower``) gives way only beyond the bound of the window's
        size plus ``unacked_bytes``. ``True`` when a follower that holds has a window's size
        of output it has not been sent: the reader waits (backpressure) until it is sent, the
        follower's send stalls for the grace time, or its grace time after its end ends. The
        window so holds at most its size beyond what the slowest follower sent past its
        ``acked`` (``unacked_bytes``, the most one stream sends)."""
        now = time.monotonic()
        grace = limits.follower_grace_seconds
        self.followers = [
            f for f in self.followers if f.ended_at is None or f.ended_at > now - grace
        ]
        held, kept, unsent = self._pins(now, grace)
        bound = limits.window_bytes + limits.unacked_bytes
        while self.window_size > limits.window_bytes and len(self.window) > 1:
            first = self.window[0].seq
            if held is not None and first > held:
                break
            if kept is not None and first > kept and self.window_size <= bound:
                break
            self.window_size -= self.window.popleft().size
        return unsent >= limits.window_bytes

    def _pins(self, now: float, grace: float) -> tuple[int | None, int | None, int]:
        """The lowest ``acked`` of the followers that hold and of those that do not (the first
        event either may not have received is that + 1), and the most window output a follower
        that holds has not been sent."""
        held: int | None = None
        kept: int | None = None
        unsent = 0
        start = self.window[0].offset if self.window else self.output_size
        for follower in self.followers:
            try:
                self.event_at(follower.acked + 1)
            except LookupError:
                continue  # that follower already lost events: it gets a 410
            if not follower.holding(now, grace):
                kept = follower.acked if kept is None else min(kept, follower.acked)
                continue
            try:
                sent = self.event_at(follower.cursor) if follower.cursor else None
                sent_end = sent.offset + sent.size if sent is not None else 0
            except LookupError:  # its cursor is its acked one, dropped already: before the window
                sent_end = start
            held = follower.acked if held is None else min(held, follower.acked)
            unsent = max(unsent, self.output_size - max(sent_end, start))
        return held, kept, unsent

    def follow(self, after: int) -> _Follower:
        """A new follower for a request continuing from ``after``. A stream that sent up to at
        least ``after`` from at most ``after`` may be this reader's (what it sent beyond
        ``after`` was lost on the way). When it is the only follower whose range holds
        ``after`` and it ended, it is this reader's: it is replaced (its pin moves up to
        ``after``). When several do (two readers whose ranges overlap), the continuation may be
        any one's: those that ended keep their pins for their grace time, without holding.
        A request from the very cursor an ended stream continued from, after it sent more, does
        not move the pin: past :data:`REPEATS_THAT_HOLD` such requests in a row, the follower
        does not hold (a reader that never moves its cursor cannot hold the command)."""
        containing = [f for f in self.followers if f.acked <= after <= f.cursor]
        repeats = 0
        for ended in (f for f in containing if f.ended_at is not None):
            if ended.acked == after < ended.cursor:
                repeats = max(repeats, ended.repeats + 1)
            if len(containing) == 1:
                self.followers.remove(ended)
            else:
                ended.holds = False
        follower = _Follower(after, after, repeats=repeats, holds=repeats <= REPEATS_THAT_HOLD)
        self.followers.append(follower)
        self.cond.notify_all()  # acknowledged: the reader may go on
        return follower

    def unfollow(self, follower: _Follower, grace: float) -> None:
        """The stream of ``follower`` ended: it holds the window for the grace time. It no
        longer holds the reader if its send had stalled (its reader did not read), or if a
        later request continued from within what it sent (it may have reconnected before this
        stream noticed the broken connection; or that is another reader: it keeps its pin)."""
        now = time.monotonic()
        follower.ended_at = now
        continued = any(
            other.serial > follower.serial and follower.acked <= other.acked <= follower.cursor
            for other in self.followers
        )
        if continued or follower.stalled(now, grace):
            follower.holds = False
        follower.sending_since = None
        self.cond.notify_all()

    def event_at(self, seq: int) -> _Event | None:
        """The event ``seq``; ``None`` when it does not exist yet; ``LookupError`` when lost."""
        if seq > self.last_seq:
            return None
        if seq <= len(self.retained):
            return self.retained[seq - 1]
        if self.window and self.window[0].seq <= seq:
            return self.window[seq - self.window[0].seq]
        if self.exit_event is not None and self.exit_event.seq == seq:
            return self.exit_event
        first = self.window[0].seq if self.window else self.last_seq + 1
        if self.exit_event is not None:
            first = min(first, self.exit_event.seq)
        raise LookupError(first)

    def text(self, kind: str) -> str:
        return "".join(e.data for e in self.retained if e.kind == kind)

    # -- answers -------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        return {
            "command_id": self.command_id,
            "request_id": self.request_id,
            "command": list(self.argv),
            "cwd": self.cwd,
            "state": self.state,
            "exit_code": self.exit_code,
            "pid": self.proc.pid if self.proc is not None else None,
            "timeout": self.timeout if math.isfinite(self.timeout) else None,
            "stdin": self.stdin_open,
            "last_seq": self.last_seq,
            "output_truncated": self.output_truncated,
            "started_at": _timestamp(self.started_at),
            "ended_at": _timestamp(self.ended_at),
            "pty": None if self.pty is None else {"cols": self.pty[0], "rows": self.pty[1]},
        }

    def status(self) -> dict[str, Any]:
        with self.cond:
            return {**self.summary(), "stdout": self.text("stdout"), "stderr": self.text("stderr")}
