"""The event stream of a managed command (``GET /commands/{id}/events``, and the streamed
start): NDJSON batches of its events from a cursor until its exit event or the stream's
duration, heartbeats between them, each send bounded in time (:class:`Sending`) so that a
reader that stops reading never holds a thread, a connection or the window. A streamed start
whose reader shows no output live (``Prefer: no-live-output``) is held until the exit and sent
whole (:func:`send_held`).

Standard library only (the runtime is forked per sandbox).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

from ._command import Command, Limits, _Follower, _line
from ._http import Exchange, send_whole, start_ndjson

BATCH_BYTES = 256 * 1024


class Sending:
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


def send_ndjson(handler: Exchange, chunks: Generator[bytes, None, None], sending: Sending) -> None:
    """A ``200`` NDJSON answer, each chunk sent as it comes (chunked transfer encoding). Every
    write is bounded by ``sending``: a reader that stops reading gets its connection closed
    (no end of the chunked body) once the stream's time is up, and continues from its cursor."""
    sock = handler.connection
    try:
        sock.settimeout(sending.remaining())  # the status line and headers too
        start_ndjson(handler)
        with contextlib.closing(chunks):
            for chunk in chunks:
                _send_parts(sock, (b"%x\r\n" % len(chunk), chunk, b"\r\n"), sending)
            _send_parts(sock, (b"0\r\n\r\n",), sending)
    except OSError:  # the reader went away, or did not read within the stream's time
        handler.close_connection = True
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(None)


PREFER_WHOLE = "no-live-output"
"""The preference (``Prefer: no-live-output``) of a streamed start whose reader shows no output
live: the runtime may hold the answer until the command's exit (:func:`send_held`)."""


def wants_whole(handler: Exchange) -> bool:
    """Whether the request prefers its answer whole (``Prefer: no-live-output``)."""
    prefer = handler.headers.get("Prefer") or ""
    return any(part.split("=", 1)[0].strip().lower() == PREFER_WHOLE for part in prefer.split(","))


def send_held(
    handler: Exchange, chunks: Generator[bytes, None, None], sending: Sending, hold: float
) -> None:
    """A streamed start whose reader shows no output live: its lines are held until the
    command's exit (the end of ``chunks``) and sent as one answer with a ``Content-Length``
    (one read for the reader instead of one per batch). Held at most ``hold`` seconds (the
    heartbeat interval: a reader or proxy waits no longer for the first byte than between two
    heartbeats) and :data:`BATCH_BYTES`: past either, what is held is sent and the rest
    streams as usual (:func:`send_ndjson`)."""
    held: list[bytes] = []
    size = 0
    until = time.monotonic() + hold
    with contextlib.closing(chunks):
        while size < BATCH_BYTES and time.monotonic() < until:
            chunk = next(chunks, None)
            if chunk is None:
                _send_whole(handler, b"".join(held), sending)
                return
            held.append(chunk)
            size += len(chunk)
        send_ndjson(handler, _then(held, chunks), sending)


def _then(held: list[bytes], rest: Generator[bytes, None, None]) -> Generator[bytes, None, None]:
    yield from held
    yield from rest


def _send_whole(handler: Exchange, data: bytes, sending: Sending) -> None:
    sock = handler.connection
    try:
        sock.settimeout(sending.remaining())
        handler.send_response(200)
        handler.send_header("Content-Type", "application/x-ndjson")
        handler.send_header("Cache-Control", "no-store")
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("Preference-Applied", PREFER_WHOLE)
        send_whole(handler, data)
    except OSError:  # the reader went away, or did not read within the stream's time
        handler.close_connection = True
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(None)


def _send_parts(sock: Any, parts: tuple[bytes, ...], sending: Sending) -> None:
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


def event_lines(
    command: Command,
    after: int,
    duration: float,
    sending: Sending,
    limits: Limits,
    kept: Callable[[Command], bool],
) -> Generator[bytes, None, None]:
    """Batches of NDJSON lines after ``after``, until the exit event or ``duration`` (or the
    command is no longer ``kept``: forgotten)."""
    with command.cond:
        follower = sending.follower = command.follow(after)
    try:
        yield from _batches(command, follower, after, duration, limits, kept)
    finally:
        with command.cond:
            command.unfollow(follower, limits.follower_grace_seconds)


def _batches(
    command: Command,
    follower: _Follower,
    after: int,
    duration: float,
    limits: Limits,
    kept: Callable[[Command], bool],
) -> Iterator[bytes]:
    deadline = time.monotonic() + duration
    beat = limits.heartbeat_seconds
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
                if size >= BATCH_BYTES or unacked >= limits.unacked_bytes:
                    break
            if batch:  # sent from now on (a broken send may deliver part): read more
                follower.cursor = cursor
                command.cond.notify_all()
            now = time.monotonic()
            if not batch and not lost and now < deadline:
                gone = not kept(command)
                if not gone:
                    command.cond.wait(max(0.0, min(deadline, last_sent + beat) - now))
                else:
                    lost = True
        if batch:
            yield b"".join(batch)
            last_sent = time.monotonic()
        if ended or lost or unacked >= limits.unacked_bytes:
            return  # enough sent unacknowledged: the client continues from its cursor
        now = time.monotonic()
        if now >= deadline:
            return
        if not batch and now - last_sent >= beat:
            yield _line({"type": "heartbeat", "seq": cursor, "data": ""})
            last_sent = now
