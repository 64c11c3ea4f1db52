"""The fork server and the per-sandbox supervisors the local backend runs runtimes under.

Starting a Python process per sandbox costs ~60 ms of CPU and ~20 MiB; forking a warm,
single-threaded template process costs ~2 ms and shares its memory copy-on-write. The broker
starts one fork server and sends it one JSON line per sandbox:
  {"id": N, "host": ..., "port": ..., "base_dir": ..., "env": {...}, "log": path,
   "port_file": path or null, "argv": [...] or null}
and reads back {"id": N, "pid": PID} or {"id": N, "error": "..."}, and {"exited": PID,
"id": N, "status": CODE} whenever the runtime of request N has ended and everything it started
is gone. An exit names its request: a PID can be used again (by the next sandbox's runtime)
before the exit of the runtime that had it is reported.

Process tree (Linux): fork server -> one supervisor per sandbox -> the runtime (its own process
group; the built-in one is forked, ``argv`` is exec'd) -> commands. The supervisor is a session
leader and a child subreaper (PR_SET_CHILD_SUBREAPER): whatever the runtime or a command
starts stays below it, even after a double fork, a setsid or the death of its parent. When the
runtime exits (or is killed), or the supervisor gets SIGTERM, it kills every process left
below it and exits. The fork server is a subreaper too: what a killed supervisor leaves
behind comes to it and is killed at once. The fork server dies with the broker
(PR_SET_PDEATHSIG plus a parent watch), each supervisor with the fork server, each built-in
runtime with its supervisor.

Standard library only (``python-multipart`` is imported ahead for the runtimes' first upload).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import sys
import time
from collections.abc import Container
from typing import Any

from . import _process, _server
from ._process import PARENT_PID_ENV

_WATCHED = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT)


class _Stop(Exception):
    pass


def _raise_stop(*_: object) -> None:
    raise _Stop


def _children() -> list[int]:
    """The processes whose parent is this one (from /proc; empty where there is no /proc)."""
    me = os.getpid()
    return [
        pid for pid, fields in _process.proc_stats() if len(fields) > 1 and fields[1] == b"%d" % me
    ]


def _kill_children(keep: Container[int] = ()) -> None:
    """SIGKILL and reap every child but ``keep``, round after round: a subreaper inherits the
    children of what it kills, so this ends when nothing but ``keep`` is left below it."""
    for _ in range(1000):
        victims = [pid for pid in _children() if pid not in keep]
        if not victims:
            return
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in victims:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def fork_server() -> int:
    """Serve spawn requests (JSON lines on stdin) until stdin ends, a signal stops it or the
    parent (the broker) is gone; then stop every sandbox's supervisor (2 s) and kill what is
    left."""
    parent = int(os.environ.get(PARENT_PID_ENV) or os.getppid())
    _process.set_pdeathsig()
    if os.getppid() != parent:
        return 0
    _process.become_subreaper()
    with contextlib.suppress(ImportError):  # warm for the children's first upload
        import python_multipart.multipart  # noqa: F401
    server = _ForkServer(parent)
    try:
        server.run()
    except (_Stop, BrokenPipeError):
        pass
    finally:
        server.stop()
    return 0


class _ForkServer:
    """The fork server's state: the supervisors it forked (one per sandbox) and what it knows
    of their runtimes."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self.supervisors: dict[int, tuple[int, Any]] = {}  # pid -> (runtime pid, request id)
        # a supervisor reports its runtime's pid (or why it could not start it) on a pipe,
        # read here without blocking so that the next fork need not wait: report fd ->
        # (supervisor pid, request id, data so far); and the exit codes of supervisors reaped
        # before their report
        self.starting: dict[int, tuple[int, Any, bytes]] = {}
        self.early: dict[int, int] = {}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, _raise_stop)
        signal.signal(signal.SIGINT, _raise_stop)
        self.selector = selectors.DefaultSelector()
        self.selector.register(0, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.pending = b""

    def run(self) -> None:
        """Until stdin ends (``_Stop``) or the parent is gone."""
        while True:
            events = self.selector.select(timeout=0.5)
            if os.getppid() != self.parent:
                return
            for key, _ in events:
                if key.fd == self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 4096):
                            pass
                elif key.fd in self.starting:
                    self._read_report(key.fd)
                else:
                    self._read_requests()
            self._reap()

    def _reply(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\n"
        while data:
            data = data[os.write(1, data) :]

    def _read_requests(self) -> None:
        data = os.read(0, 65536)
        if not data:
            raise _Stop
        self.pending += data
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            self._spawn(json.loads(line))

    def _spawn(self, request: dict[str, Any]) -> None:
        try:
            supervisor, report = _fork_supervisor(
                request, (self.wake_r, self.wake_w, *self.starting)
            )
        except OSError as exc:
            self._reply({"id": request.get("id"), "error": f"fork failed: {exc}"})
            return
        self.starting[report] = (supervisor, request.get("id"), b"")
        self.selector.register(report, selectors.EVENT_READ)

    def _read_report(self, fd: int) -> None:
        supervisor, ident, data = self.starting[fd]
        chunk = os.read(fd, 65536)
        if chunk:
            self.starting[fd] = (supervisor, ident, data + chunk)
            return
        del self.starting[fd]
        self.selector.unregister(fd)
        os.close(fd)
        started = json.loads(data) if data else {"error": "the sandbox supervisor exited early"}
        self._reply({"id": ident, **started})
        if "pid" not in started:
            self.early.pop(supervisor, None)
        elif supervisor in self.early:  # the runtime has already ended, and its supervisor too
            code = self.early.pop(supervisor)
            self._reply({"exited": started["pid"], "id": ident, "status": code})
        else:
            self.supervisors[supervisor] = (int(started["pid"]), ident)

    def _reap(self) -> None:
        orphans = False
        reporting = {entry[0] for entry in self.starting.values()}
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            runtime = self.supervisors.pop(pid, None)
            if runtime is not None:
                self._reply({"exited": runtime[0], "id": runtime[1], "status": code})
            elif pid in reporting:
                self.early[pid] = code
            # not a supervisor (an orphan), or a supervisor killed before it could clean up
            orphans = orphans or (runtime is None and pid not in reporting) or code < 0
        if orphans:  # only a dead supervisor's processes come to us: kill them all
            _kill_children(keep={*self.supervisors, *reporting})

    def stop(self) -> None:
        """Stop every supervisor (each stops its runtime and kills what is left), then kill
        whatever remains below the fork server."""
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        alive = {*self.supervisors, *(entry[0] for entry in self.starting.values())}
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while alive and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                pid, _status = os.waitpid(-1, os.WNOHANG)
                if pid:
                    alive.discard(pid)
                    continue
            time.sleep(0.01)
        _kill_children()


def _fork_supervisor(request: dict[str, Any], close_fds: tuple[int, ...]) -> tuple[int, int]:
    """Fork the supervisor of one sandbox; return its pid and the read end of the pipe on which
    it reports ``{"pid": runtime}`` or ``{"error": reason}`` (then closes it)."""
    report_r, report_w = os.pipe()
    # The supervisor takes these signals with sigtimedwait: blocked across the fork, so that
    # none reaches the fork server's handlers in the child.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WATCHED)
        os.close(report_r)
        os.close(report_w)
        raise
    if pid:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WATCHED)
    else:  # the supervisor: never returns into the fork server's loop
        try:
            os.close(report_r)
            _supervise(request, report_w, close_fds)
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        os._exit(1)
    os.close(report_w)
    return pid, report_r


def _supervise(request: dict[str, Any], report_fd: int, close_fds: tuple[int, ...]) -> None:
    fork_server_pid = os.getppid()
    os.setsid()
    _process.set_pdeathsig()
    if os.getppid() != fork_server_pid:
        return
    _process.become_subreaper()
    signal.set_wakeup_fd(-1)
    for fd in close_fds:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    runtime, error = _start_runtime(request, report_fd)
    with contextlib.suppress(OSError):  # the fork server is gone: _watch stops the runtime
        os.write(report_fd, json.dumps({"error": error} if error else {"pid": runtime}).encode())
    os.close(report_fd)
    code = 1 if error else _watch(runtime, fork_server_pid)
    _kill_children()
    os._exit(code)


def _start_runtime(request: dict[str, Any], report_fd: int) -> tuple[int, str | None]:
    """Fork the runtime (exec ``argv``, or serve the built-in one); ``(pid, error)``."""
    argv: list[str] | None = request.get("argv")
    env = {**request["env"], PARENT_PID_ENV: str(os.getpid())}
    supervisor = os.getpid()
    failed_r, failed_w = os.pipe()  # close-on-exec: stays empty when exec succeeds
    pid = os.fork()
    if pid == 0:  # the runtime: its own process group, default signal handling
        try:
            os.close(failed_r)
            os.close(report_fd)  # the fork server reads the report until EOF
            os.setpgid(0, 0)
            for sig in _WATCHED:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, ())
            os.chdir(request["base_dir"])
            if argv:
                _process.set_pdeathsig()
                if os.getppid() == supervisor:
                    try:
                        os.execvpe(argv[0], argv, env)  # noqa: S606 - the configured runtime
                    except OSError as exc:
                        reason = f"cannot start runtime {argv[0]!r}: {exc.strerror or exc}"
                        os.write(failed_w, reason.encode())
                os._exit(127)
            os.close(failed_w)
            os.environ.clear()
            os.environ.update(env)
            _process.die_with_parent(supervisor)
            _server.serve(
                request["host"], int(request["port"]), request["base_dir"], request.get("port_file")
            )
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    with contextlib.suppress(OSError):  # also here: no race with a signal to the group
        os.setpgid(pid, pid)
    os.close(failed_w)
    failure = b""
    while chunk := os.read(failed_r, 65536):
        failure += chunk
    os.close(failed_r)
    if failure:
        return pid, failure.decode("utf-8", errors="replace")
    return pid, None


def _next_signal(timeout: float) -> int | None:
    """Take the next of the (blocked) watched signals, waiting up to ``timeout`` seconds."""
    if hasattr(signal, "sigtimedwait"):
        info = signal.sigtimedwait(_WATCHED, timeout)
        return None if info is None else int(info.si_signo)
    time.sleep(min(timeout, 0.05))  # no sigtimedwait (macOS): poll the pending set
    pending = signal.sigpending() & set(_WATCHED)
    return int(signal.sigwait(pending)) if pending else None


def _watch(runtime: int, fork_server_pid: int) -> int:
    """Reap children until the runtime exits; on SIGTERM/SIGINT (or when the fork server is
    gone) stop the runtime (SIGTERM, 1 s). The supervisor's exit code: the runtime's (128 +
    signal number when it was killed)."""
    stop_at: float | None = None
    while True:
        signo = _next_signal(0.5)
        asked = signo is not None and signo != signal.SIGCHLD
        if stop_at is None and (asked or os.getppid() != fork_server_pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(runtime, signal.SIGTERM)
            stop_at = time.monotonic() + 1.0
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return 1
            if pid == 0:
                break
            if pid == runtime:
                code = os.waitstatus_to_exitcode(status)
                return code if code >= 0 else 128 - code
        if stop_at is not None and time.monotonic() > stop_at:
            return 128 + signal.SIGKILL  # the sweep kills it
