"""One code context's interpreter: its process, the socket to it, and the thread that reads it.

The process is the sandbox's own Python (``python3`` on the commands' ``PATH``, else the
runtime's interpreter) running :mod:`._kernel`'s source, started through
:func:`._command_process.spawn`: as a managed command is, with its user, working directory and
environment (the runtime's own plus the context's ``envs``), as the leader of a process group
and session of its own; never inside the runtime process. Its stdin is ``/dev/null``; its stdout
and stderr are pipes; the kernel's messages (JSON lines) come over one end of a socket pair.

One thread per interpreter reads all three as the bytes arrive and hands them to its
:class:`Sink` (the context: :mod:`._code`): output text as it comes, and each message once the
output written before it is read (so what a cell printed is the cell's). The thread also asks
the sink when its next deadline is (a cell's time limit, an interrupt's grace) and tells it the
time. When the process ends (its socket closes, or its pidfd says so) the thread kills what it
left in its group, reaps it and reports the exit status. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Protocol

from . import _command_process, _kernel, _process, _pty

READ_SIZE = 64 * 1024
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The longest line the kernel may send (a result; the kernel keeps results under the
execution's limit): a longer one is dropped (it is not the kernel's)."""
POLL_SECONDS = 0.5
"""How often the reader looks at the process where it has no pidfd of it."""
PYTHON = "python3"
"""The interpreter a context runs: the sandbox's ``python3``, found on the commands' ``PATH``."""


class Sink(Protocol):
    """What an interpreter's reader hands on (called from its thread)."""

    def output(self, kind: str, text: str) -> None:
        """``stdout`` or ``stderr`` text, as it arrives."""

    def message(self, message: dict[str, Any]) -> None:
        """A message of the kernel (``ready``, ``result``, ``error``, ``done``)."""

    def tick(self) -> float | None:
        """Act on the deadlines that passed; seconds until the next one (``None``: none)."""

    def exited(self, status: int) -> None:
        """The process ended (``status``: its exit code, or ``-signal``)."""


def kernel_source() -> str:
    """The program the interpreter runs (:mod:`._kernel`'s source)."""
    return Path(_kernel.__file__).read_text(encoding="utf-8")


def python_for(env: dict[str, str]) -> str:
    """``python3`` on ``env``'s ``PATH`` (what the context's commands run), else the runtime's
    own interpreter (which the sandbox has: it runs the runtime)."""
    return shutil.which(PYTHON, path=env.get("PATH", os.defpath)) or sys.executable


class Interpreter:
    """The process of one context (started by :meth:`start`) and its reader thread."""

    def __init__(self, context_id: str, cwd: str, env: dict[str, str], sink: Sink) -> None:
        """``env``: the whole environment of the process (the commands' one:
        :func:`._env.command_environment`)."""
        self.context_id = context_id
        self.cwd = cwd
        self.env = env
        self.sink = sink
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._send_lock = threading.Lock()
        self._watched = False
        """Whether the reader has a pidfd of the process (else it polls it)."""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Start the process and its reader thread (``OSError``: it could not be started)."""
        ours, theirs = socket.socketpair()
        try:
            argv = [
                python_for(self.env),
                "-c",
                kernel_source(),
                _kernel.ARGV_MARKER,
                self.context_id,
                str(theirs.fileno()),
            ]
            self.proc = _command_process.spawn(
                argv,
                self.cwd,
                self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            self._close_wake()
            raise
        finally:
            theirs.close()
        self._sock = ours
        name = f"code-context-{self.context_id}"
        threading.Thread(target=self._guarded_read, name=name, daemon=True).start()

    def send(self, message: dict[str, Any]) -> bool:
        """Send ``message`` to the kernel; ``False`` when it is gone (its exit is reported)."""
        sock = self._sock
        if sock is None:
            return False
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        try:
            with self._send_lock:
                sock.sendall(data)
        except OSError:
            return False
        return True

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the interpreter's process group (what a cell started too, as a
        terminal's Ctrl-C does)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signum)

    def kill(self) -> None:
        """SIGKILL the process group; the reader reports the exit."""
        if self.proc is not None:
            _process.kill_group(self.proc.pid)

    def wake(self) -> None:
        """Make the reader ask the sink for its deadlines again (one was set)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # -- the reader thread ---------------------------------------------------------------------
    def _guarded_read(self) -> None:
        try:
            self._read()
        except Exception:  # logged to the runtime's log; the process is ended and reported
            traceback.print_exc()
            self.kill()
            self._reap()

    def _read(self) -> None:
        proc, sock = self.proc, self._sock
        assert proc is not None and sock is not None and proc.stdout and proc.stderr
        pipes = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        decoders = {kind: _pty.PlainText() for kind in pipes.values()}
        selector = selectors.DefaultSelector()
        for fd, kind in pipes.items():
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ, kind)
        selector.register(sock, selectors.EVENT_READ, "control")
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        pidfd = _pidfd(proc.pid)
        self._watched = pidfd is not None
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ, "exit")
        lines = _Lines()
        try:
            while self._serve(selector, pipes, decoders, lines, sock):
                pass
        finally:
            selector.close()
            if pidfd is not None:
                os.close(pidfd)
        self._reap()

    def _serve(
        self,
        selector: selectors.BaseSelector,
        pipes: dict[int, str],
        decoders: dict[str, _pty.PlainText],
        lines: _Lines,
        sock: socket.socket,
    ) -> bool:
        """One round of the reader: ``False`` once the process ended (or closed its socket)."""
        wait = self.sink.tick()
        if not self._watched:  # no pidfd: look at the process twice a second
            wait = POLL_SECONDS if wait is None else min(wait, POLL_SECONDS)
        for key, _ in selector.select(None if wait is None else max(0.0, wait)):
            if key.data == "wake":
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            elif key.data in ("stdout", "stderr"):
                self._output(key.fd, key.data, decoders[key.data])
            elif key.data == "control" and not self._control(sock, lines, pipes, decoders):
                return False
            elif key.data == "exit":
                sock.setblocking(False)  # what it sent before it ended is still read
                while self._control(sock, lines, pipes, decoders):
                    pass
                return False
        return self._watched or self.proc is None or self.proc.poll() is None

    def _control(
        self,
        sock: socket.socket,
        lines: _Lines,
        pipes: dict[int, str],
        decoders: dict[str, _pty.PlainText],
    ) -> bool:
        """Read the kernel's messages that arrived; ``False`` at the socket's end (or when
        nothing more is there, on a socket made non-blocking)."""
        try:
            data = sock.recv(READ_SIZE)
        except OSError:  # BlockingIOError included: nothing more to read
            data = b""
        for message in lines.feed(data):
            self._drain(pipes, decoders)  # what it printed before this is the cell's
            self.sink.message(message)
        if not data:
            self._drain(pipes, decoders)
        return bool(data)

    def _output(self, fd: int, kind: str, decoder: _pty.PlainText) -> bool:
        """Hand on what the pipe holds now; ``False`` when it is empty or closed."""
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        text, _ = decoder.decode(data, not data)
        if text:
            self.sink.output(kind, text)
        return bool(data)

    def _drain(self, pipes: dict[int, str], decoders: dict[str, _pty.PlainText]) -> None:
        for fd, kind in pipes.items():
            while self._output(fd, kind, decoders[kind]):
                pass

    def _reap(self) -> None:
        """The process ended (or its socket closed): what it left in its group ends with it,
        then the exit status is reported and the pipes, socket and wake pipe are closed."""
        proc = self.proc
        assert proc is not None
        _process.kill_group(proc.pid)
        status = proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        self._close_wake()
        self.sink.exited(status)

    def _close_wake(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


class _Lines:
    """The kernel's JSON lines, split from what the socket delivers (a line longer than
    :data:`MAX_MESSAGE_BYTES` is skipped whole)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        messages: list[dict[str, Any]] = []
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            if self._skipping:
                self._skipping = False
                continue
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict):
                    messages.append(message)
        if len(self._buffer) > MAX_MESSAGE_BYTES:
            self._buffer.clear()
            self._skipping = True
        return messages


def _pidfd(pid: int) -> int | None:
    """A descriptor readable once ``pid`` exits (Linux 5.3+), else ``None`` (polled)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def describe_status(status: int) -> str:
    """How a process ended, in words (``-9``: killed by SIGKILL)."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by {name}"
    return f"exited with code {status}"
