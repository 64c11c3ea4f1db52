"""Managed commands for the local sandbox runtime: start, follow, feed, kill and reattach.

Standard library only (the runtime is forked per sandbox). The wire protocol (documented in
docs/broker-api.md and openapi.json):

- ``POST /commands`` ``{"command": [argv...], "timeout"?, "request_id"?, "stdin"?, "envs"?,
  "cwd"?}`` -> ``{"command_id"}``; a repeated ``request_id`` returns the same command. With
  ``Accept: application/x-ndjson`` (the streamed start) the answer is NDJSON instead: the line
  ``{"command_id"}``, then the command's events as ``GET /commands/{id}/events?after=0`` sends
  them, until the exit event or ``max_duration`` (``SANDBOX_COMMAND_STREAM_START=0``: off, as
  a runtime without the extension).
- ``GET /commands`` -> ``{"commands": [summary...]}`` (``?request_id=R``: only the command whose
  start carried ``R``, or none); ``GET /commands/{id}`` -> the status.
- ``GET /commands/{id}/events?after=SEQ&duration=S`` -> NDJSON lines
  ``{"type": "stdout"|"stderr"|"exit"|"heartbeat", "seq", "data"}``.
- ``POST /commands/{id}/kill`` -> the final status; ``POST /commands/{id}/stdin``
  ``{"data", "eof"}``.

Each command runs in its own process group (``start_new_session``); one thread per command reads
its pipes as the bytes arrive (not line-buffered) and turns them into events with contiguous
sequence numbers. Output is decoded as UTF-8 with replacement characters by an incremental decoder
per stream, so a multi-byte character split across two reads stays whole.

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
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import itertools
import json
import os
import re
import selectors
import signal
import subprocess
import threading
import time
import traceback
import urllib.parse
import uuid
from collections import deque
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from . import _fs

READ_SIZE = 128 * 1024
"""The most one read of a command's pipe takes (what is there now: a read never waits to fill),
and the capacity asked for its stdout and stderr pipes (Linux ``F_SETPIPE_SZ``; the default is
64 KiB): a fast command writes ahead while the last read is handed on, in fewer, larger events.
Both are at most an eighth of the live window (see ``_read_size``)."""
BATCH_BYTES = 256 * 1024
TIMEOUT_EXIT_CODE = 124
KILLED_EXIT_CODE = 128 + signal.SIGKILL
STDIN_WRITE_SECONDS = 30.0
KILL_WAIT_SECONDS = 10.0
DRAIN_SECONDS = 2.0
FOLLOWER_GRACE_SECONDS = 5.0
REPEATS_THAT_HOLD = 2
"""How many times in a row a reader may come back with the cursor its previous stream continued
from although that stream sent it more (its events were lost on the way: a broken connection)
and still hold the command; the next such request, from a reader that reads but never moves
its cursor (one that replays from ``after=0`` again and again), no longer does."""
_ENV_NAME = re.compile(r"^[^=\x00]+$")
INVALID_TEXT = "invalid_text"
"""The code of a refusal of text UTF-8 cannot carry (argv, envs, cwd, stdin data)."""
_REQUEST_FIELDS = frozenset({"command", "timeout", "request_id", "stdin", "envs", "cwd"})
_STDIN_FIELDS = frozenset({"data", "eof"})


def _host_cwd(cwd: str, base_dir: str) -> str:
    """A command's working directory on this host: ``/app`` and ``/workspace`` (and what is
    below them, ``/app/workspace`` too) are the sandbox's roots, as in the file API (``/app``:
    the base directory, where commands run by default); any other absolute path is the host's
    own (NO ISOLATION: a local command is a host process)."""
    parts = [p for p in cwd.split("/") if p not in ("", ".")]
    if not parts or parts[0] not in ("app", "workspace"):
        return cwd
    try:
        target = _fs.check_path(cwd, base_dir, "cwd")
        # a root replaced (by a link, another directory) is refused, as the file API does
        target.roots.check(target.root, cwd)
    except _fs.FsError as exc:  # its detail names sandbox paths only, never host ones
        raise CommandError(exc.status, f"field 'cwd': {exc.detail}", code=exc.code) from None
    return os.path.join(target.root_dir, *target.parts)


def _argv(argv: Any) -> list[str]:
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        argv = None
    if argv is None or not argv[0]:
        raise CommandError(
            400,
            "field 'command' must be a non-empty list of strings (the argv; to use a shell "
            'send ["/bin/bash", "-c", "..."])',
        )
    if any("\x00" in a for a in argv):
        raise CommandError(400, "field 'command' contains a NUL byte, which argv cannot carry")
    checked: list[str] = argv
    for arg in checked:
        _check_text("command", arg)
    return checked


def _envs(envs: Any) -> dict[str, str]:
    if not isinstance(envs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
    ):
        raise CommandError(400, "field 'envs' must be an object of string values")
    for key, value in envs.items():
        if not _ENV_NAME.match(key) or "\x00" in value:
            raise CommandError(
                400,
                f"field 'envs': {key!r} is not a valid variable (a name is non-empty, without "
                "'=' or NUL; a value without NUL)",
            )
        _check_text("envs", key)
        _check_text("envs", value)
    return envs


def _check_text(name: str, text: str) -> None:
    """Refuse text UTF-8 cannot carry (a lone surrogate: JSON can escape one, ``"\\ud800"``),
    before anything is registered or started: ``400`` with code ``invalid_text``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise CommandError(
            400,
            f"field {name!r} holds text that is not valid Unicode (a lone surrogate, "
            f"{bad!r}), which UTF-8, and so an argv, an environment or a stdin, cannot carry; "
            "send valid text (decode bytes with errors='replace', or send them as base64)",
            code=INVALID_TEXT,
        ) from None


class CommandError(Exception):
    """An error answer: HTTP ``status`` and a JSON body ``{"detail", ...extra}``."""

    def __init__(self, status: int, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.body: dict[str, Any] = {"detail": detail, **extra}


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

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], max_timeout: float) -> Limits:
        """Limits from ``SANDBOX_COMMAND_*`` variables; a bad value is a ``ValueError``."""

        def number(name: str, default: float, kind: type[int] | type[float]) -> Any:
            raw = environ.get(name)
            if not raw:
                return default
            try:
                value = kind(raw)
            except ValueError:
                value = 0
            if value <= 0:
                raise ValueError(f"{name}={raw!r}: must be a positive {kind.__name__}")
            return value

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
        )
        if limits.max_handles < limits.max_running:
            raise ValueError(
                f"SANDBOX_COMMAND_MAX_HANDLES={limits.max_handles} must be at least "
                f"SANDBOX_COMMAND_MAX_RUNNING={limits.max_running}"
            )
        return limits


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
            "timeout": self.timeout,
            "stdin": self.stdin_open,
            "last_seq": self.last_seq,
            "output_truncated": self.output_truncated,
            "started_at": _timestamp(self.started_at),
            "ended_at": _timestamp(self.ended_at),
        }

    def status(self) -> dict[str, Any]:
        with self.cond:
            return {**self.summary(), "stdout": self.text("stdout"), "stderr": self.text("stderr")}


class Handler(Protocol):
    """What the runtime's request handler offers this module."""

    path: str

    @property
    def headers(self) -> Any: ...

    @property
    def connection(self) -> Any: ...

    def _read_json(self) -> Any: ...

    def _send_json(self, status: int, payload: Any) -> None: ...

    def send_response(self, code: int, message: str | None = None) -> None: ...

    def send_header(self, keyword: str, value: str) -> None: ...

    def end_headers(self) -> None: ...

    @property
    def wfile(self) -> Any: ...

    close_connection: bool


_MANAGERS: list[CommandManager] = []


def kill_all() -> None:
    """Kill the process group of every running managed command (the runtime is going away)."""
    for manager in list(_MANAGERS):
        manager.kill_all()


class CommandManager:
    """The managed commands of one runtime (one sandbox)."""

    def __init__(self, base_dir: str, limits: Limits) -> None:
        self.base_dir = base_dir
        self.limits = limits
        self.lock = threading.Lock()
        self.commands: dict[str, Command] = {}
        self.by_request: dict[str, str] = {}
        _MANAGERS.append(self)

    # -- HTTP routing --------------------------------------------------------------------------
    def handle(self, handler: Handler, method: str) -> None:
        """Answer one request whose path is ``/commands`` or under ``/commands/``."""
        split = urllib.parse.urlsplit(handler.path)
        parts = split.path.split("/")[2:]  # "", "commands", ...
        body: dict[str, Any] = {}
        try:
            if method == "POST":
                try:
                    body = handler._read_json()
                except (ValueError, ConnectionError) as exc:
                    handler.close_connection = True
                    raise CommandError(400, f"the body must be a JSON object: {exc}") from None
                if not isinstance(body, dict):
                    raise CommandError(400, "the body must be a JSON object")
            if method == "POST" and parts == []:
                self._answer_start(handler, self.start(body))
            elif method == "GET" and parts == []:
                query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
                listed = self.list_commands(_request_id_query(query))
                handler._send_json(200, {"commands": listed})
            elif method == "GET" and len(parts) == 1:
                handler._send_json(200, self.get(parts[0]).status())
            elif method == "GET" and len(parts) == 2 and parts[1] == "events":
                query = urllib.parse.parse_qs(split.query)
                self.stream(handler, self.get(parts[0]), query)
            elif method == "POST" and len(parts) == 2 and parts[1] == "kill":
                handler._send_json(200, self.kill(self.get(parts[0])))
            elif method == "POST" and len(parts) == 2 and parts[1] == "stdin":
                handler._send_json(200, self.write_stdin(self.get(parts[0]), body))
            else:
                raise CommandError(404, f"no route for {method} {split.path}")
        except CommandError as exc:
            handler._send_json(exc.status, exc.body)

    # -- start ---------------------------------------------------------------------------------
    def _parse(self, body: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(body) - _REQUEST_FIELDS)
        if unknown:
            raise CommandError(
                400, f"unknown field(s) {unknown}: the fields are {sorted(_REQUEST_FIELDS)}"
            )
        argv = _argv(body.get("command"))
        timeout = self._timeout(body.get("timeout"))
        request_id = body.get("request_id")
        if request_id is not None and (
            not isinstance(request_id, str) or not 0 < len(request_id) <= 255
        ):
            raise CommandError(400, "field 'request_id' must be a string of 1 to 255 characters")
        stdin = body.get("stdin", False)
        if not isinstance(stdin, bool):
            raise CommandError(400, "field 'stdin' must be true or false")
        envs = _envs(body.get("envs") or {})
        return {
            "command": argv,
            "timeout": timeout,
            "request_id": request_id,
            "stdin": stdin,
            "envs": envs,
            "cwd": self._cwd(body.get("cwd")),
        }

    def _timeout(self, timeout: Any) -> float:
        if timeout is None:
            timeout = self.limits.default_timeout
        max_timeout = self.limits.max_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= max_timeout
        ):
            raise CommandError(
                400,
                f"field 'timeout' must be a number of seconds above 0 and at most {max_timeout:g} "
                "(this runtime's SANDBOX_EXEC_TIMEOUT_SECONDS)",
            )
        return float(timeout)

    def _cwd(self, cwd: Any) -> str:
        if cwd is None:
            return self.base_dir
        if not isinstance(cwd, str) or not cwd.startswith("/") or "\x00" in cwd:
            raise CommandError(400, f"field 'cwd' must be an absolute path, not {cwd!r}")
        _check_text("cwd", cwd)
        host = _host_cwd(cwd, self.base_dir)
        if not os.path.isdir(host):
            raise CommandError(400, f"field 'cwd': {cwd!r} is not an existing directory")
        return host

    def start(self, body: dict[str, Any]) -> Command:
        request = self._parse(body)
        request_id = request["request_id"]
        with self.lock:
            self._sweep()
            if request_id is not None and request_id in self.by_request:
                existing = self.commands[self.by_request[request_id]]
                if existing.request != request:
                    raise CommandError(
                        409,
                        f"request_id {request_id!r} was already used for a different command; "
                        "use a new request id for a new command",
                    )
                return existing
            running = sum(1 for c in self.commands.values() if c.state == "running")
            if running >= self.limits.max_running:
                raise CommandError(
                    429,
                    f"too many running commands: this sandbox runs at most "
                    f"{self.limits.max_running} at a time; wait for one to end or kill one",
                    limit=self.limits.max_running,
                )
            if len(self.commands) >= self.limits.max_handles:
                finished = [c for c in self.commands.values() if c.state != "running"]
                oldest = min(finished, key=lambda c: c.ended_at or 0.0)
                self._forget(oldest)
            command = Command(
                command_id=str(uuid.uuid4()),
                request_id=request_id,
                request=request,
                argv=list(request["command"]),
                cwd=request["cwd"],
                timeout=request["timeout"],
                stdin_requested=request["stdin"],
                started_at=time.time(),
            )
            # its caller is about to follow it: the window keeps its start for the grace time
            command.followers.append(_Follower(0, 0, ended_at=time.monotonic()))
            self.commands[command.command_id] = command
            if request_id is not None:
                self.by_request[request_id] = command.command_id
            self._launch(command, request["envs"])
        return command

    def _launch(self, command: Command, envs: dict[str, str]) -> None:
        try:
            proc = subprocess.Popen(
                command.argv,
                cwd=command.cwd,
                env={**os.environ, **envs},
                stdin=subprocess.PIPE if command.stdin_requested else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except (OSError, ValueError) as exc:
            # not found / not executable (126, 127: a result, as a shell reports it), or what
            # _parse did not foresee (1): never a command left running without a process
            code = 126 if isinstance(exc, PermissionError) else 127
            code = 1 if isinstance(exc, ValueError) else code
            with command.cond:
                why = (exc.strerror if isinstance(exc, OSError) else None) or exc
                reason = f"cannot start {command.argv[0]!r}: {why}\n"
                command.append("stderr", reason, len(reason.encode()), self.limits)
                self._finish(command, code, "exited")
            return
        for pipe in (proc.stdout, proc.stderr):
            with contextlib.suppress(AttributeError, OSError):  # not Linux, or above the maximum
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, self._read_size())  # type: ignore[union-attr]
        command.proc = proc
        command.stdin_open = command.stdin_requested
        threading.Thread(
            target=self._guarded_pump,
            args=(command,),
            name=f"command-{command.command_id}",
            daemon=True,
        ).start()

    # -- the per-command thread ----------------------------------------------------------------
    def _guarded_pump(self, command: Command) -> None:
        """``_pump``, and if it fails: kill the group and end the command visibly anyway."""
        try:
            self._pump(command)
        except Exception:  # logged to the runtime's log (stderr), and the command ends below
            traceback.print_exc()
        finally:
            if not command.done.is_set() and command.proc is not None:
                _killpg(command.proc.pid)
                try:
                    rc = command.proc.wait(KILL_WAIT_SECONDS)
                except subprocess.TimeoutExpired:
                    rc = -int(signal.SIGKILL)
                with command.cond:
                    note = (
                        "\nthe runtime failed while reading this command's output; it was killed\n"
                    )
                    command.append("stderr", note, len(note), self.limits)
                    self._finish(command, rc if rc >= 0 else 128 - rc, "exited")

    def _pump(self, command: Command) -> None:
        proc = command.proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        selector = selectors.DefaultSelector()
        decoders = {}
        for stream, kind in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            selector.register(stream.fileno(), selectors.EVENT_READ, kind)
            decoders[kind] = codecs.getincrementaldecoder("utf-8")("replace")
        pidfd = -1
        with contextlib.suppress(AttributeError, OSError):
            pidfd = os.pidfd_open(proc.pid)  # readable when the leader exits
            selector.register(pidfd, selectors.EVENT_READ, "exit")
        deadline = time.monotonic() + command.timeout
        pipes = 2
        leader_done = False
        drain_until: float | None = None
        try:
            while pipes or not leader_done:
                if not leader_done and command.killed_by is None:
                    with command.cond:  # backpressure: a follower has not sent the window yet
                        full = command.evict(self.limits)
                        if full:
                            command.cond.wait(0.1)
                    if full and not _exited(proc.pid) and time.monotonic() < deadline:
                        continue  # the pipe fills and the command blocks on its writes
                now = time.monotonic()
                waits = []
                if not leader_done:
                    if command.killed_by is None:
                        waits.append(deadline - now)
                    if pidfd < 0:
                        waits.append(0.05)
                if drain_until is not None:
                    waits.append(drain_until - now)
                for key, _ in selector.select(max(0.0, min(waits)) if waits else None):
                    if key.data == "exit":
                        selector.unregister(pidfd)
                    elif not self._read(command, key.fd, key.data, decoders[key.data]):
                        selector.unregister(key.fd)
                        pipes -= 1
                if not leader_done and _exited(proc.pid):
                    leader_done = True
                    _killpg(proc.pid)  # what the command left in its group ends with it
                    drain_until = time.monotonic() + DRAIN_SECONDS
                elif not leader_done and time.monotonic() >= deadline:
                    with command.cond:
                        if command.killed_by is None:
                            command.killed_by = "timeout"
                    _killpg(proc.pid)
                if drain_until is not None and time.monotonic() >= drain_until:
                    break  # a process that left the group holds the pipes: stop reading
        finally:
            selector.close()
            if pidfd >= 0:
                os.close(pidfd)
            proc.stdout.close()
            proc.stderr.close()
        rc = proc.wait()
        with command.cond:
            if rc < 0 and command.killed_by == "cancel":
                self._finish(command, KILLED_EXIT_CODE, "cancelled")
            elif rc < 0 and command.killed_by == "timeout":
                self._finish(command, TIMEOUT_EXIT_CODE, "timed_out")
            else:
                self._finish(command, rc if rc >= 0 else 128 - rc, "exited")
        self._trim(command)

    def _trim(self, command: Command) -> None:
        """After the exit: bring the window back to its size once its followers acknowledged
        what they were sent or their grace time ended (nothing else would drop it now)."""
        while True:
            with command.cond:
                command.evict(self.limits)
                if (
                    command.window_size <= self.limits.window_bytes
                    or not command.followers
                    or command.command_id not in self.commands
                ):
                    return
                command.cond.wait(self.limits.follower_grace_seconds)

    def _read(
        self, command: Command, fd: int, kind: str, decoder: codecs.IncrementalDecoder
    ) -> bool:
        """Read what the pipe holds now into events; ``False`` at its end."""
        try:
            data = os.read(fd, self._read_size())
        except OSError:
            data = b""
        text = decoder.decode(data, final=not data)  # a split character waits for its rest
        if text:
            size = len(text) if text.isascii() else len(text.encode())
            with command.cond:
                command.append(kind, text, size, self.limits)
        return bool(data)

    def _read_size(self) -> int:
        """``READ_SIZE``, or an eighth of the live window if less: the window keeps several
        events, and what a command wrote ahead into its pipe stays small beside it."""
        return max(4096, min(READ_SIZE, self.limits.window_bytes // 8))

    def _finish(self, command: Command, exit_code: int, state: str) -> None:
        """Record the end and the ``exit`` event (the caller holds ``command.cond``)."""
        command.exit_code = exit_code
        command.state = state
        command.ended_at = time.time()
        command.stdin_open = False
        if command.proc is not None and command.proc.stdin is not None:
            with contextlib.suppress(OSError):
                command.proc.stdin.close()
        command.append("exit", "", 0, self.limits, exit_code=exit_code, state=state)
        command.done.set()

    # -- lookups -------------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Forget finished commands older than the retention time (the caller holds the lock)."""
        horizon = time.time() - self.limits.retention_seconds
        for command in list(self.commands.values()):
            if command.ended_at is not None and command.ended_at < horizon:
                self._forget(command)

    def _forget(self, command: Command) -> None:
        self.commands.pop(command.command_id, None)
        if command.request_id is not None:
            self.by_request.pop(command.request_id, None)
        with command.cond:
            command.cond.notify_all()

    def get(self, command_id: str) -> Command:
        with self.lock:
            self._sweep()
            command = self.commands.get(command_id)
        if command is None:
            raise CommandError(
                404,
                f"no command {command_id!r} in this sandbox (finished commands are kept "
                f"{self.limits.retention_seconds:g} s, at most {self.limits.max_handles})",
            )
        return command

    def list_commands(self, request_id: str | None = None) -> list[dict[str, Any]]:
        """The summaries of the commands, oldest first; with ``request_id``, of the one its
        start carried it (the cleanup of a client whose start's answer was lost), or none."""
        with self.lock:
            self._sweep()
            if request_id is None:
                commands = sorted(self.commands.values(), key=lambda c: c.started_at)
            else:
                found = self.commands.get(self.by_request.get(request_id, ""))
                commands = [found] if found is not None else []
        out = []
        for command in commands:
            with command.cond:
                out.append(command.summary())
        return out

    # -- kill and stdin ------------------------------------------------------------------------
    def kill(self, command: Command) -> dict[str, Any]:
        with command.cond:
            if command.state == "running" and command.proc is not None:
                if command.killed_by is None:
                    command.killed_by = "cancel"
                _killpg(command.proc.pid)
        command.done.wait(KILL_WAIT_SECONDS)
        return command.status()

    def kill_all(self) -> None:
        with self.lock:
            commands = list(self.commands.values())
        for command in commands:
            if command.state == "running" and command.proc is not None:
                _killpg(command.proc.pid)

    def write_stdin(self, command: Command, body: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(body) - _STDIN_FIELDS)
        if unknown:
            raise CommandError(400, f"unknown field(s) {unknown}: the fields are 'data' and 'eof'")
        data = body.get("data", "")
        eof = body.get("eof", False)
        if not isinstance(data, str) or not isinstance(eof, bool):
            raise CommandError(400, "field 'data' must be a string and 'eof' true or false")
        _check_text("data", data)
        if not command.stdin_requested:
            raise CommandError(
                409, 'the command was started without stdin; start it with "stdin": true'
            )
        with command.stdin_lock:
            proc = command.proc
            if command.state != "running" or proc is None or proc.stdin is None:
                raise CommandError(409, f"the command is {command.state}: its stdin is closed")
            if not command.stdin_open:
                raise CommandError(409, "stdin was closed (eof was sent)")
            payload = data.encode()
            try:
                _write_all(proc.stdin.fileno(), payload)
            except TimeoutError:
                raise CommandError(
                    409,
                    f"the command did not read its stdin for {STDIN_WRITE_SECONDS:g} s",
                ) from None
            except OSError:
                command.stdin_open = False
                raise CommandError(409, "the command closed its stdin") from None
            if eof:
                command.stdin_open = False
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        return {"command_id": command.command_id, "written": len(payload), "stdin": not eof}

    # -- the event stream ----------------------------------------------------------------------
    def stream(self, handler: Handler, command: Command, query: dict[str, list[str]]) -> None:
        after = _query_number(query, "after", 0, int)
        duration = _query_number(query, "duration", self.limits.max_duration, float)
        if after < 0:
            raise CommandError(400, "query 'after' must be an integer sequence number >= 0")
        if not 0 <= duration <= self.limits.max_duration:
            raise CommandError(
                400,
                f"query 'duration' must be a number of seconds from 0 to "
                f"{self.limits.max_duration:g}",
            )
        with command.cond:
            if after > command.last_seq:
                raise CommandError(
                    400,
                    f"query 'after'={after} is beyond the last event ({command.last_seq})",
                    last_seq=command.last_seq,
                )
            try:
                command.event_at(after + 1)
            except LookupError as lost:
                first = int(lost.args[0])
                raise CommandError(
                    410,
                    f"events {after + 1} to {first - 1} were dropped: output beyond "
                    f"{self.limits.output_bytes} bytes is streamed live but not kept for replay; "
                    f"resume with after={first - 1} (the output is truncated)",
                    resume_after=first - 1,
                ) from None
        sending = _Sending(command, duration + self.limits.follower_grace_seconds)
        _send_ndjson(handler, self._lines(command, after, duration, sending), sending)

    def _answer_start(self, handler: Handler, command: Command) -> None:
        """``{"command_id"}``, or with ``Accept: application/x-ndjson`` (the streamed start)
        that line followed by the command's events from the first one."""
        started = {"command_id": command.command_id}
        accept = handler.headers.get("Accept") or ""
        if not self.limits.stream_start or "application/x-ndjson" not in accept:
            handler._send_json(200, started)
            return
        duration = self.limits.max_duration
        sending = _Sending(command, duration + self.limits.follower_grace_seconds)

        def lines() -> Generator[bytes, None, None]:
            yield _line(started)
            with contextlib.closing(self._lines(command, 0, duration, sending)) as events:
                yield from events

        _send_ndjson(handler, lines(), sending)

    def _lines(
        self, command: Command, after: int, duration: float, sending: _Sending
    ) -> Generator[bytes, None, None]:
        """Batches of NDJSON lines after ``after``, until the exit event or ``duration``."""
        with command.cond:
            follower = sending.follower = command.follow(after)
        try:
            yield from self._batches(command, follower, after, duration)
        finally:
            with command.cond:
                command.unfollow(follower, self.limits.follower_grace_seconds)

    def _batches(
        self, command: Command, follower: _Follower, after: int, duration: float
    ) -> Iterator[bytes]:
        deadline = time.monotonic() + duration
        beat = self.limits.heartbeat_seconds
        cursor = after
        last_sent = time.monotonic()
        unacked = 0  # window output sent: kept until a request continues from a later cursor
        while True:
            batch: list[bytes] = []
            size = 0
            ended = lost = False
            with command.cond:
                while True:
                    try:
                        event = command.event_at(cursor + 1)
                    except LookupError:
                        lost = True
                        break
                    if event is None:
                        break
                    batch.append(event.line)
                    size += len(event.line)
                    cursor = event.seq
                    if event.seq > len(command.retained):
                        unacked += event.size
                    if event.kind == "exit":
                        ended = True
                        break
                    if size >= BATCH_BYTES or unacked >= self.limits.unacked_bytes:
                        break
                if batch:  # sent from now on (a broken send may deliver part): read more
                    follower.cursor = cursor
                    command.cond.notify_all()
                now = time.monotonic()
                if not batch and not lost and now < deadline:
                    gone = command.command_id not in self.commands
                    if not gone:
                        command.cond.wait(max(0.0, min(deadline, last_sent + beat) - now))
                    else:
                        lost = True
            if batch:
                yield b"".join(batch)
                last_sent = time.monotonic()
            if ended or lost or unacked >= self.limits.unacked_bytes:
                return  # enough sent unacknowledged: the client continues from its cursor
            now = time.monotonic()
            if now >= deadline:
                return
            if not batch and now - last_sent >= beat:
                yield _line({"type": "heartbeat", "seq": cursor, "data": ""})
                last_sent = now


class _Sending:
    """The sending side of one event stream: its sends must be done ``limit`` seconds (its
    duration plus the follower grace time) after it began, else the runtime ends it (a
    reader that does not read never holds a thread, a connection or the window for longer);
    and the progress of its follower's sends (``_Follower.sending_since``), which tells the
    reader whether that follower still reads."""

    def __init__(self, command: Command, limit: float) -> None:
        self.command = command
        self.send_by = time.monotonic() + limit
        self.follower: _Follower | None = None

    def remaining(self) -> float:
        """Seconds left to send in; a ``TimeoutError`` when none are."""
        left = self.send_by - time.monotonic()
        if left <= 0:
            raise TimeoutError("the event stream could not be sent within its time")
        return left

    def progress(self, sending: bool = True) -> None:
        """A send started or made progress (``sending``), or is done."""
        follower = self.follower
        if follower is not None:
            with self.command.cond:
                follower.sending_since = time.monotonic() if sending else None


def _send_ndjson(handler: Handler, chunks: Generator[bytes, None, None], sending: _Sending) -> None:
    """A ``200`` NDJSON answer, each chunk sent as it comes (chunked transfer encoding). Every
    write is bounded by ``sending``: a reader that stops reading gets its connection closed
    (no end of the chunked body) once the stream's time is up, and continues from its cursor."""
    sock = handler.connection
    try:
        sock.settimeout(sending.remaining())  # the status line and headers too
        handler.send_response(200)
        handler.send_header("Content-Type", "application/x-ndjson")
        handler.send_header("Cache-Control", "no-store")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        with contextlib.closing(chunks):
            for chunk in chunks:
                _send_parts(sock, (b"%x\r\n" % len(chunk), chunk, b"\r\n"), sending)
            _send_parts(sock, (b"0\r\n\r\n",), sending)
    except OSError:  # the reader went away, or did not read within the stream's time
        handler.close_connection = True
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(None)


def _send_parts(sock: Any, parts: tuple[bytes, ...], sending: _Sending) -> None:
    """Send ``parts`` as one write without joining them (no copy of a large chunk), within the
    stream's time (``TimeoutError`` past it), recording the progress of the send."""
    views = [memoryview(part) for part in parts]
    sending.progress()
    while views:
        sock.settimeout(sending.remaining())
        sent = sock.sendmsg(views)
        sending.progress()
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views and sent:
            views[0] = views[0][sent:]
    sending.progress(False)


def _request_id_query(query: dict[str, list[str]]) -> str | None:
    """The ``request_id`` a ``GET /commands`` asks for (``None``: every command)."""
    values = query.get("request_id")
    if values is None:
        return None
    if not 0 < len(values[-1]) <= 255:
        raise CommandError(400, "query 'request_id' must be a string of 1 to 255 characters")
    return values[-1]


def _query_number(
    query: dict[str, list[str]], name: str, default: float, kind: type[int] | type[float]
) -> Any:
    values = query.get(name)
    if not values:
        return default
    try:
        return kind(values[-1])
    except ValueError:
        raise CommandError(400, f"query {name!r}={values[-1]!r} is not a number") from None


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited, without reaping it (its pgid stays valid)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to a pipe, waiting at most ``STDIN_WRITE_SECONDS`` for the reader."""
    if not data:
        return
    deadline = time.monotonic() + STDIN_WRITE_SECONDS
    os.set_blocking(fd, False)
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_WRITE)
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not selector.select(remaining):
                continue
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                continue
            view = view[written:]
