"""The runtime process's own lifetime: it dies with its parent, and what it started dies with it.

A runtime (and the fork server, and each sandbox's supervisor) is started by a parent it must
not outlive: ``PR_SET_PDEATHSIG`` (Linux) plus a thread that watches the parent's pid. When it
goes (``SIGTERM``, or its parent is gone) it first runs the cleanups registered with
:func:`at_exit` (the endpoints that start commands register the killing of their process
groups), then exits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

PARENT_PID_ENV = "AGENT_SANDBOX_RUNTIME_PARENT_PID"
"""The pid of the process a runtime dies with (set by whoever starts it: the local backend,
the fork server's supervisors)."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

_cleanups: list[Callable[[], None]] = []


def at_exit(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` when the process exits through :func:`exit_now` (or ``serve`` ends)."""
    if cleanup not in _cleanups:
        _cleanups.append(cleanup)


def run_cleanups() -> None:
    for cleanup in list(_cleanups):
        cleanup()


def exit_now(*_: object) -> None:
    """Run the cleanups and exit at once (a ``SIGTERM`` handler)."""
    run_cleanups()
    os._exit(0)


class ProcessGroups:
    """The process groups of commands that run now (each command is its own group's leader):
    killed when the runtime goes, so that nothing a command started outlives it."""

    def __init__(self) -> None:
        self._groups: set[int] = set()
        self._lock = threading.Lock()

    def add(self, pgid: int) -> None:
        with self._lock:
            self._groups.add(pgid)

    def discard(self, pgid: int) -> None:
        with self._lock:
            self._groups.discard(pgid)

    def kill_all(self) -> None:
        with self._lock:
            groups = list(self._groups)
        for pgid in groups:
            kill_group(pgid)


def proc_stats() -> Iterator[tuple[int, list[bytes]]]:
    """Each process's id and the fields of its ``/proc/PID/stat`` after its name (``state``,
    ``ppid``, ``pgrp``, ``session``, ...); nothing where there is no ``/proc``; a process
    gone meanwhile is left out."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        yield int(entry), stat.rsplit(b")", 1)[-1].split()


def kill_group(pgid: int) -> None:
    """SIGKILL the process group ``pgid`` (gone already, or not ours: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` on Linux; ``False`` where it is unavailable or fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return False


def set_pdeathsig() -> None:
    """Ask Linux to send SIGTERM when the parent (thread) that started us dies."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def become_subreaper() -> None:
    """Whatever this process's descendants leave behind (an orphan) comes to it (Linux)."""
    prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(parent_pid: int) -> None:
    """Exit when the parent goes away (PR_SET_PDEATHSIG where available, plus a watcher)."""
    set_pdeathsig()
    if os.getppid() != parent_pid:
        exit_now()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                exit_now()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
