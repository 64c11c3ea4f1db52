"""``GET /fs/watch``: a directory's changes as NDJSON events, by polling it.

The first event is a ``snapshot`` of the entries (with ``recursive``, at any depth: an iterative
walk, see :mod:`._tree`); then, every :data:`WATCH_POLL_SECONDS`, one ``created``, ``removed``
or ``modified`` event per entry that changed, a ``heartbeat`` after
:data:`WATCH_HEARTBEAT_SECONDS` of silence, and an ``error`` event (then the end) when the
directory or its root is gone. Standard library only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from . import _tree
from ._files import MAX_LIST_ENTRIES, children
from ._http import Exchange, start_ndjson
from ._paths import FsError, SandboxPath, open_dir

MAX_WATCH_ENTRIES = 10000
MAX_WATCH_SECONDS = 20.0
WATCH_POLL_SECONDS = 0.25
WATCH_HEARTBEAT_SECONDS = 5.0


def _scan(fd: int, target: SandboxPath, recursive: bool) -> dict[str, Any]:
    """Entries below the directory at ``fd`` keyed by their path relative to it (with
    ``recursive``, at any depth: an iterative walk)."""
    if not recursive:
        return children(fd, target, MAX_LIST_ENTRIES)
    out: dict[str, Any] = {}

    def enter(dir_fd: int, parts: tuple[str, ...]) -> list[str]:
        below = "/".join(parts)
        here = target.child(below) if parts else target
        found = children(dir_fd, here, MAX_WATCH_ENTRIES)
        prefix = below + "/" if parts else ""
        out.update((prefix + name, info) for name, info in found.items())
        if len(out) > MAX_WATCH_ENTRIES:
            raise FsError(
                "too_many_entries",
                f"{target.display} has more than {MAX_WATCH_ENTRIES} entries below it; "
                "watch a subdirectory or without recursive",
                target.given,
            )
        return [name for name, info in found.items() if info["type"] == "directory"]

    try:  # a subdirectory removed or replaced meanwhile is skipped: the next poll sees it
        _tree.walk(fd, enter, skip_errors=True)
    except _tree.TreeChangedError:
        raise FsError(
            "io_error",
            f"{target.display}: a directory below it was moved while it was read; watch again",
            target.given,
        ) from None
    return out


def stream(exchange: Exchange, target: SandboxPath, recursive: bool, duration: float) -> None:
    """Answer ``GET /fs/watch``: the NDJSON events of ``target`` (a directory) for
    ``duration`` seconds (checked by the caller)."""
    fd = open_dir(target, target.parts)
    try:
        previous = _scan(fd, target, recursive)
        start_ndjson(exchange)
        emit = _chunk_writer(exchange)
        emit({"type": "snapshot", "path": target.display, "entries": previous})
        _watch_loop(fd, target, recursive, previous, time.monotonic() + duration, emit)
        exchange.wfile.write(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        exchange.close_connection = True  # the client went away
    finally:
        os.close(fd)


def _chunk_writer(exchange: Exchange) -> Callable[[dict[str, Any]], None]:
    def emit(event: dict[str, Any]) -> None:
        line = json.dumps(event).encode() + b"\n"
        exchange.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))

    return emit


def _watch_loop(
    fd: int,
    target: SandboxPath,
    recursive: bool,
    previous: dict[str, Any],
    deadline: float,
    emit: Callable[[dict[str, Any]], None],
) -> None:
    last_sent = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= deadline:
            return
        time.sleep(min(WATCH_POLL_SECONDS, deadline - now))
        try:
            target.roots.check(target.root, target.given)
        except FsError as exc:
            emit({"type": "error", "message": exc.detail})
            return
        if os.fstat(fd).st_nlink == 0:
            emit({"type": "error", "message": f"{target.display} was removed"})
            return
        try:
            current = _scan(fd, target, recursive)
        except FsError as exc:
            emit({"type": "error", "message": exc.detail})
            return
        for key in sorted(previous.keys() | current.keys()):
            old, new = previous.get(key), current.get(key)
            if old == new or _both_directories(old, new):
                continue  # a directory's own times change with its entries: not an event
            kind = "created" if old is None else "removed" if new is None else "modified"
            entry = new if new is not None else old
            emit({"type": kind, "path": f"{target.display}/{key}", "entry": entry})
            last_sent = time.monotonic()
        previous = current
        if time.monotonic() - last_sent >= WATCH_HEARTBEAT_SECONDS:
            emit({"type": "heartbeat"})
            last_sent = time.monotonic()


def _both_directories(old: dict[str, Any] | None, new: dict[str, Any] | None) -> bool:
    return bool(old and new and old["type"] == new["type"] == "directory")
