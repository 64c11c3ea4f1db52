"""Pseudo-terminals for managed commands (``POST /commands`` with ``"pty"``).

A command started with a pty runs with a new pseudo-terminal as its stdin, stdout and stderr
and as the controlling terminal of its own session: the runtime opens the pair, sets its size
(``TIOCSWINSZ``), and starts the command through a tiny exec shim (``_EXEC``: the system's
``setsid`` from ``start_new_session``, then ``TIOCSCTTY`` on its stdin, then ``execvp``), so that
no Python code runs between ``fork`` and ``exec`` in the threaded runtime. The line discipline
then does what a terminal does: a ``\\x03`` written to the master is ``SIGINT`` to the
foreground process group, a resize is ``SIGWINCH`` to it, job control works.

The runtime reads the master as it reads a pipe; its bytes become ``stdout`` events whose text
is decoded incrementally (a character split between two reads waits for its rest), and whose
exact bytes ride along as ``data_base64`` when they are not valid UTF-8 (:class:`ExactText`).

Standard library only.
"""

from __future__ import annotations

import base64
import codecs
import contextlib
import fcntl
import os
import signal
import struct
import subprocess
import sys
import termios

from . import _process

DEFAULT_TERM = "xterm-256color"
"""``TERM`` of a pty command unless its ``envs`` give one."""
DEFAULT_SIZE = (80, 24)
MAX_SIDE = 65535
"""The largest number of columns or rows (the kernel's ``winsize`` holds unsigned shorts)."""
SIZE_FIELDS = frozenset({"cols", "rows"})

_EXEC = (
    "import fcntl, os, sys, termios\n"
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"
    "try:\n"
    "    os.execvp(sys.argv[1], sys.argv[1:])\n"
    "except OSError as exc:\n"
    "    reason = 'cannot start %r: %s\\r\\n' % (sys.argv[1], exc.strerror or exc)\n"
    "    os.write(2, reason.encode())\n"
    "    os._exit(126 if isinstance(exc, PermissionError) else 127)\n"
)
"""The command's first program: it makes the pty (its stdin) its controlling terminal, then
replaces itself with the command (a program that cannot start exits 127, or 126, with the
reason on the terminal, as a shell reports it)."""


def parse_size(value: object, field: str, *, defaults: bool) -> tuple[int, int]:
    """``{"cols": C, "rows": R}`` as ``(cols, rows)``; ``defaults``: a missing side is 80 x 24.
    A ``ValueError`` names the field and the rule."""
    rule = (
        f'field {field!r} must be an object {{"cols": C, "rows": R}} of integers from 1 to '
        f"{MAX_SIDE}"
    )
    if not isinstance(value, dict) or not set(value) <= SIZE_FIELDS:
        raise ValueError(rule + (f", not {value!r}" if not isinstance(value, dict) else ""))
    sides = []
    for name, default in zip(("cols", "rows"), DEFAULT_SIZE, strict=True):
        side = value.get(name, default if defaults else None)
        if isinstance(side, bool) or not isinstance(side, int) or not 1 <= side <= MAX_SIDE:
            raise ValueError(f"{rule}; {name} is {side!r}")
        sides.append(side)
    return sides[0], sides[1]


def set_size(fd: int, size: tuple[int, int]) -> None:
    """Set the terminal's size (``TIOCSWINSZ``): its foreground process group gets
    ``SIGWINCH``."""
    cols, rows = size
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def spawn(
    argv: list[str], cwd: str, env: dict[str, str], size: tuple[int, int]
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``argv`` on a new pty of ``size`` in its own session, the pty its controlling
    terminal; the process and the master's descriptor (non-blocking, not inherited)."""
    master, slave = os.openpty()
    try:
        set_size(slave, size)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _EXEC, *argv],
            cwd=cwd,
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)  # the command holds it now: the master reads EIO once it closes it
    os.set_blocking(master, False)
    return proc, master


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (Linux ``/proc``; elsewhere nothing): what a
    terminal's shell started in other process groups (its jobs) ends with it."""
    for pid, fields in _process.proc_stats():
        if len(fields) > 3 and fields[3] == b"%d" % sid:
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours
                os.kill(pid, signal.SIGKILL)


class ExactText:
    """A terminal's output as event text: UTF-8, decoded incrementally (a character split
    between two reads waits for its rest), U+FFFD for invalid bytes; and, when the bytes are
    not valid UTF-8, the bytes themselves (base64) as the event's ``data_base64``."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def decode(self, data: bytes, final: bool) -> tuple[str, dict[str, str]]:
        held = self._decoder.getstate()[0]
        text = self._decoder.decode(data, final)
        if "\ufffd" not in text:  # nothing replaced: the text is the bytes
            return text, {}
        rest = self._decoder.getstate()[0]
        raw = (held + data)[: len(held) + len(data) - len(rest)]
        if text.encode() == raw:  # a U+FFFD that was in the output itself
            return text, {}
        return text, {"data_base64": base64.b64encode(raw).decode("ascii")}


class PlainText:
    """A pipe's output as event text (UTF-8, incrementally, U+FFFD for invalid bytes)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def decode(self, data: bytes, final: bool) -> tuple[str, dict[str, str]]:
        return self._decoder.decode(data, final), {}


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
