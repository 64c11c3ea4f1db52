"""A managed command's process: its start (:func:`spawn`, the one way the runtime starts a
process for its caller), the reader thread that turns its pipes (or its terminal) into events
with backpressure, the kill of its process group at its leader's exit or its time limit, and
its end (:class:`CommandRunner`); the writes to its stdin (:func:`write_all`).

Standard library only (the runtime is forked per sandbox).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import selectors
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from . import _process, _pty
from ._command import Command, Limits
from ._env import command_environment

READ_SIZE = 128 * 1024
"""The most one read of a command's pipe takes (what is there now: a read never waits to fill),
and the capacity asked for its stdout and stderr pipes (Linux ``F_SETPIPE_SZ``; the default is
64 KiB): a fast command writes ahead while the last read is handed on, in fewer, larger events.
Both are at most an eighth of the live window (see ``_read_size``)."""
TIMEOUT_EXIT_CODE = 124
KILLED_EXIT_CODE = 128 + signal.SIGKILL
STDIN_WRITE_SECONDS = 30.0
KILL_WAIT_SECONDS = 10.0
DRAIN_SECONDS = 2.0


def spawn(argv: list[str], cwd: str, env: dict[str, str], **pipes: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` as every process the runtime runs for its caller starts (a managed
    command; a code context's interpreter, :mod:`._interpreter`): in ``cwd``, with ``env``
    (:func:`._env.command_environment`: the runtime's own, the sandbox's, the request's), the
    leader of a process group and session of its own; ``pipes``: the standard streams and
    descriptors it gets (``subprocess.Popen``'s)."""
    return subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True, **pipes)


class CommandRunner:
    """Starts the commands of one runtime and reads their output into events (``limits``:
    the runtime's; ``kept``: whether a command is still the manager's, not forgotten)."""

    def __init__(self, limits: Limits, kept: Callable[[Command], bool]) -> None:
        self.limits = limits
        self.kept = kept

    def launch(self, command: Command, sandbox: Mapping[str, str], envs: dict[str, str]) -> None:
        """Start ``command``'s process: its environment the runtime's, the sandbox's
        (``sandbox``), then its own ``envs`` (a terminal's ``TERM`` under the last two)."""
        own: Mapping[str, str] = os.environ
        if command.pty is not None:
            own = {**os.environ, "TERM": _pty.DEFAULT_TERM}
        env = command_environment(own, sandbox, envs)
        try:
            if command.pty is not None:
                proc, command.master_fd = _pty.spawn(command.argv, command.cwd, env, command.pty)
            else:
                proc = spawn(
                    command.argv,
                    command.cwd,
                    env,
                    stdin=subprocess.PIPE if command.stdin_requested else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
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
                self.finish(command, code, "exited")
            return
        for pipe in (proc.stdout, proc.stderr):  # None on a pty
            with contextlib.suppress(AttributeError, OSError):  # not Linux, or above the maximum
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, self._read_size())  # type: ignore[union-attr]
        command.proc = proc
        command.stdin_open = command.stdin_requested
        threading.Thread(
            target=self._read_output_or_end,
            args=(command,),
            name=f"command-{command.command_id}",
            daemon=True,
        ).start()

    # -- the per-command thread ----------------------------------------------------------------
    def _read_output_or_end(self, command: Command) -> None:
        """``_read_output``, and if it fails: kill the group and end the command visibly anyway."""
        try:
            self._read_output(command)
        except Exception:  # logged to the runtime's log (stderr), and the command ends below
            traceback.print_exc()
        finally:
            if not command.done.is_set() and command.proc is not None:
                kill_processes(command)
                try:
                    rc = command.proc.wait(KILL_WAIT_SECONDS)
                except subprocess.TimeoutExpired:
                    rc = -int(signal.SIGKILL)
                with command.cond:
                    note = (
                        "\nthe runtime failed while reading this command's output; it was killed\n"
                    )
                    command.append("stderr", note, len(note), self.limits)
                    self.finish(command, rc if rc >= 0 else 128 - rc, "exited")

    def _read_output(self, command: Command) -> None:
        """Read the command's pipes into events until both end (or, once its leader exited,
        for at most DRAIN_SECONDS), killing its group at the leader's exit or its timeout;
        then record the end."""
        proc = command.proc
        assert proc is not None
        pipes = _Pipes(command)
        try:
            while pipes.open or not pipes.leader_done:
                if self._held_back_by_a_follower(command, pipes):
                    continue  # the pipe fills and the command blocks on its writes
                for key, _ in pipes.selector.select(pipes.wait(command)):
                    if key.data == "exit":
                        pipes.selector.unregister(pipes.pidfd)
                    elif not self._read_into_events(
                        command, key.fd, key.data, pipes.decoders[key.data]
                    ):
                        pipes.selector.unregister(key.fd)
                        pipes.open -= 1
                if pipes.after_select(command):
                    break  # a process that left the group holds the pipes: stop reading
        finally:
            pipes.close()
        rc = proc.wait()
        with command.cond:
            if rc < 0 and command.killed_by == "cancel":
                self.finish(command, KILLED_EXIT_CODE, "cancelled")
            elif rc < 0 and command.killed_by == "timeout":
                self.finish(command, TIMEOUT_EXIT_CODE, "timed_out")
            else:
                self.finish(command, rc if rc >= 0 else 128 - rc, "exited")
        self._trim_window_after_exit(command)

    def _held_back_by_a_follower(self, command: Command, pipes: _Pipes) -> bool:
        """Backpressure: whether a follower has not been sent the window yet (the pipes are
        then not read, for at most 0.1 s at a time, while the command runs)."""
        if pipes.leader_done or command.killed_by is not None:
            return False
        with command.cond:
            full = command.evict(self.limits)
            if full:
                command.cond.wait(0.1)
        assert command.proc is not None
        return full and not leader_exited(command.proc.pid) and time.monotonic() < pipes.deadline

    def _trim_window_after_exit(self, command: Command) -> None:
        """After the exit: bring the window back to its size once its followers acknowledged
        what they were sent or their grace time ended (nothing else would drop it now)."""
        while True:
            with command.cond:
                command.evict(self.limits)
                if (
                    command.window_size <= self.limits.window_bytes
                    or not command.followers
                    or not self.kept(command)
                ):
                    return
                command.cond.wait(self.limits.follower_grace_seconds)

    def _read_into_events(self, command: Command, fd: int, kind: str, decoder: _Decoder) -> bool:
        """Read what the pipe (or pty) holds now into events; ``False`` at its end (a pty's
        master reads ``EIO`` once every holder of its terminal closed it)."""
        try:
            data = os.read(fd, self._read_size())
        except BlockingIOError:  # a pty's master is non-blocking (its writers share it)
            return True
        except OSError:
            data = b""
        text, extra = decoder.decode(data, not data)  # a split character waits for its rest
        if text:
            size = len(text) if text.isascii() else len(text.encode())
            with command.cond:
                command.append(kind, text, size, self.limits, **extra)
        return bool(data)

    def _read_size(self) -> int:
        """``READ_SIZE``, or an eighth of the live window if less: the window keeps several
        events, and what a command wrote ahead into its pipe stays small beside it."""
        return max(4096, min(READ_SIZE, self.limits.window_bytes // 8))

    def finish(self, command: Command, exit_code: int, state: str) -> None:
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


class _Decoder(Protocol):
    def decode(self, data: bytes, final: bool) -> tuple[str, dict[str, str]]: ...


class _Pipes:
    """A running command's stdout and stderr, or its pty's master (and its pidfd, readable when
    its leader exits, where the platform has one) in one selector, and where their reading
    stands."""

    def __init__(self, command: Command) -> None:
        proc = command.proc
        assert proc is not None
        self.command = command
        self.proc = proc
        self.selector = selectors.DefaultSelector()
        self.decoders: dict[str, _Decoder] = {}
        if command.master_fd is not None:  # one stream: the terminal, its bytes kept exact
            streams: list[tuple[int, str, _Decoder]] = [
                (command.master_fd, "stdout", _pty.ExactText())
            ]
        else:
            assert proc.stdout is not None and proc.stderr is not None
            streams = [
                (proc.stdout.fileno(), "stdout", _pty.PlainText()),
                (proc.stderr.fileno(), "stderr", _pty.PlainText()),
            ]
        for fd, kind, decoder in streams:
            self.selector.register(fd, selectors.EVENT_READ, kind)
            self.decoders[kind] = decoder
        self.pidfd = -1
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(proc.pid)  # readable when the leader exits
            self.selector.register(self.pidfd, selectors.EVENT_READ, "exit")
        self.deadline = time.monotonic() + command.timeout  # inf: a pty without a time limit
        self.open = len(streams)
        self.leader_done = False
        self.drain_until: float | None = None

    def wait(self, command: Command) -> float | None:
        """How long the next select may wait (``None``: until a pipe is readable)."""
        now = time.monotonic()
        waits = []
        if not self.leader_done:
            if command.killed_by is None and math.isfinite(self.deadline):
                waits.append(self.deadline - now)
            if self.pidfd < 0:
                waits.append(0.05)
        if self.drain_until is not None:
            waits.append(self.drain_until - now)
        return max(0.0, min(waits)) if waits else None

    def after_select(self, command: Command) -> bool:
        """Kill the group (and a pty's session) once the leader exited (what it left there ends
        with it) or at the timeout; ``True`` when the pipes have been drained for
        DRAIN_SECONDS after the exit."""
        if not self.leader_done and leader_exited(self.proc.pid):
            self.leader_done = True
            kill_processes(command)  # what the command left in its group ends with it
            self.drain_until = time.monotonic() + DRAIN_SECONDS
        elif not self.leader_done and time.monotonic() >= self.deadline:
            with command.cond:
                if command.killed_by is None:
                    command.killed_by = "timeout"
            kill_processes(command)
        return self.drain_until is not None and time.monotonic() >= self.drain_until

    def close(self) -> None:
        self.selector.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
        command = self.command
        with command.cond:  # its users hold duplicates: closing it never pulls one away
            master, command.master_fd = command.master_fd, None
        if master is not None:
            _pty.close_quietly(master)
            return
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()


def kill_processes(command: Command) -> None:
    """SIGKILL the command's process group, and for a pty its whole session (the jobs its
    shell put in groups of their own)."""
    assert command.proc is not None
    _process.kill_group(command.proc.pid)
    if command.pty is not None:
        _pty.kill_session(command.proc.pid)


def duplicate_fd(fd: int | None) -> int | None:
    """A duplicate of ``fd`` (the caller closes it), ``None`` when there is none."""
    if fd is None:
        return None
    try:
        return os.dup(fd)
    except OSError:
        return None


def leader_exited(pid: int) -> bool:
    """Whether process ``pid`` has exited, without reaping it (its pgid stays valid)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def write_all(fd: int, data: bytes) -> None:
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
