"""``agent-sandbox-awx shell NAME`` / ``shell --new``: an interactive terminal in a sandbox.

The local terminal is put in raw mode (every key, Ctrl-C included, is a byte for the remote
terminal: Ctrl-C reaches the remote program as ``SIGINT`` through its terminal's line
discipline, not this process), keys are sent as they are typed (what piles up while a request
is in flight goes in the next one), the output is written to standard output as bytes from a
reader thread, and a local window resize (``SIGWINCH``) resizes the remote terminal. The CLI
exits when the remote program does, with its exit code; the local terminal's attributes are
restored on every exit path, and a remote terminal left running (an error, ``SIGTERM`` or
``SIGHUP``: then the exit code is ``128 + signal``) is killed.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import threading
import tty
from typing import Any

from .._upstream import SandboxNotFoundError
from ._common import PROG

__all__ = ["ShellUsageError", "interactive_shell"]

READ_SIZE = 65536
"""The most bytes of typed input one stdin request carries."""


class ShellUsageError(Exception):
    """The shell cannot start here (standard input or output is not a terminal)."""


def terminal_fds() -> tuple[int, int]:
    """The local terminal's input and output descriptors; :class:`ShellUsageError` when either
    is not a terminal."""
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    for name, fd in (("standard input", fd_in), ("standard output", fd_out)):
        if not os.isatty(fd):
            raise ShellUsageError(
                f"shell needs a terminal, and its {name} is not one; run it from an "
                "interactive terminal, or use `run -- COMMAND` for a command without one."
            )
    return fd_in, fd_out


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 80, 24
    return size.columns or 80, size.lines or 24  # 0: a terminal whose size was never set


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _Session:
    """One terminal session: the reader thread (output → ``fd_out``) and the wake-up pipe that
    its end and ``SIGWINCH`` write to."""

    def __init__(self, term: Any, fd_in: int, fd_out: int) -> None:
        self.term, self.fd_in, self.fd_out = term, fd_in, fd_out
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.ended = threading.Event()
        self.winched = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="shell-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _read(self) -> None:
        try:
            for chunk in self.term:
                _write_all(self.fd_out, chunk)
        except BaseException as exc:  # raised in the main thread (after the terminal is reset)
            self.error = exc
        finally:
            self.ended.set()
            self.wake()

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.wake_w, b"!")

    def on_winch(self, signum: int, frame: Any) -> None:
        self.winched.set()
        self.wake()

    def pump(self) -> None:
        """Forward keys and resizes until the remote program ended (or the input did)."""
        while not self.ended.is_set():
            ready, _, _ = select.select([self.fd_in, self.wake_r], [], [])
            if self.wake_r in ready:
                os.read(self.wake_r, 512)
            if self.winched.is_set():  # before the keys typed after the resize
                self.winched.clear()
                self.term.resize(*_size(self.fd_in))
            if self.fd_in in ready and not self.ended.is_set():
                data = os.read(self.fd_in, READ_SIZE)
                if not data:  # the local terminal hung up
                    return
                self.term.send_stdin(data)

    def close(self) -> None:
        """Close the wake-up pipe once the reader thread is done with it (it ends when the
        terminal's output does: at once after an end or a kill)."""
        if self._thread.ident is not None:
            self._thread.join(5.0)
        if not self._thread.is_alive():
            os.close(self.wake_r)
            os.close(self.wake_w)


def _exit(signum: int, frame: Any) -> None:
    """``SIGTERM``/``SIGHUP``: exit ``128 + signum`` the way every other exit goes (the local
    terminal restored, the remote terminal killed, a ``--new`` sandbox deleted)."""
    raise SystemExit(128 + signum)


def _exit_code(sandbox: Any, code: int) -> int:
    """The remote program's exit code; :class:`SandboxNotFoundError` when a signal ended it
    because the sandbox itself ended (deleted, or its lifetime ran out): the runtime may report
    the program's end before the sandbox is gone, and a bare ``137`` would say nothing."""
    if (code >= 128 or code < 0) and not sandbox.is_running():
        raise SandboxNotFoundError(
            f"sandbox {sandbox.name!r} ended during the session (deleted, or its lifetime ran "
            f"out), and the terminal's program with it (exit code {code}); check with "
            f"`{PROG} ls`, and start a new one with `{PROG} shell --new`"
        )
    return code


def interactive_shell(sandbox: Any, fd_in: int, fd_out: int, command: Any = None) -> int:
    """Open a terminal of the local one's size in ``sandbox`` running ``command`` (default:
    the sandbox's login shell), attach the local terminal to it until it ends; its exit code."""
    saved = termios.tcgetattr(fd_in)
    term = sandbox.pty.create(*_size(fd_in), command=command)
    session = _Session(term, fd_in, fd_out)
    handlers = {signal.SIGWINCH: session.on_winch, signal.SIGTERM: _exit, signal.SIGHUP: _exit}
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        try:
            tty.setraw(fd_in, termios.TCSANOW)
            session.start()
            session.pump()
        finally:
            termios.tcsetattr(fd_in, termios.TCSAFLUSH, saved)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if session.error is not None:
            raise session.error
        if not session.ended.is_set():  # the local terminal hung up: as at SIGHUP
            raise SystemExit(128 + signal.SIGHUP)
        return _exit_code(sandbox, int(term.wait().exit_code))
    except BaseException:
        with contextlib.suppress(Exception):  # the error in hand says more than this
            if term.status().running:
                term.kill()
        raise
    finally:
        session.close()
