"""The local sandbox runtime: one process per sandbox, speaking the legacy python-runtime protocol.

Run as ``python -m k8s_agent_sandbox_awx.broker.runtime --port PORT --base-dir DIR``.
It uses the standard library only (``python-multipart`` is imported on the first upload), so it
starts in a few tens of milliseconds.

Semantics (as upstream's python-runtime-sandbox):

- ``GET /`` health; ``POST /execute`` ``{"command", "timeout_seconds"?}`` splits the command with
  :func:`shlex.split` and runs it **without a shell**, in the base directory, in its own process
  group; at the time limit the group is killed (``timed_out: true``, ``exit_code`` 124); a command
  that cannot start is ``exit_code`` 1 with the reason in ``stderr``. The first
  :data:`OUTPUT_CAP` bytes of stdout and of stderr are kept, the rest is read and dropped
  (``output_truncated: true``).
- ``POST /upload`` multipart field ``file``, filename = destination path (parents created);
  ``GET /download/{path}``, ``GET /list/{path}``, ``GET /exists/{path}``: see
  :mod:`._legacy_fs`.
- Every path is resolved inside the base directory; a path that escapes it is ``403``.
- The deployed runtimes' file endpoints ``/fs/*`` (``/app`` = the base directory, ``/workspace`` =
  ``SANDBOX_WORKSPACE_DIR``): see :mod:`._fs`.

The process dies with its parent: ``PR_SET_PDEATHSIG`` (Linux) plus a thread that watches the
parent pid. On ``SIGTERM`` it kills the process groups of running commands and exits. The module
also holds the fork server and the per-sandbox supervisors the local backend runs runtimes
under (see "fork server and supervisors" below).

NO ISOLATION: commands run as host processes with the user's privileges. Development and tests
only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Container, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import _fs, _legacy_fs, _managed

CHUNK_SIZE = 256 * 1024
OUTPUT_CAP = 1024 * 1024
"""Bytes of a command's stdout, and of its stderr, that the runtime keeps (the rest is read and
dropped, and the answer says ``output_truncated: true``)."""
MAX_JSON_BODY = 1024 * 1024
DEFAULT_EXEC_TIMEOUT = 300.0
TIMEOUT_EXIT_CODE = 124
PARENT_PID_ENV = "AGENT_SANDBOX_RUNTIME_PARENT_PID"

_active_groups: set[int] = set()
_active_lock = threading.Lock()


def _kill_active_groups() -> None:
    with _active_lock:
        groups = list(_active_groups)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    _managed.kill_all()


def _exit_now(*_: object) -> None:
    _kill_active_groups()
    os._exit(0)


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` on Linux; ``False`` where it is unavailable or fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return False


def _set_pdeathsig() -> None:
    """Ask Linux to send SIGTERM when the parent (thread) that started us dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the parent goes away (PR_SET_PDEATHSIG where available, plus a watcher)."""
    _set_pdeathsig()
    if os.getppid() != parent_pid:
        _exit_now()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                _exit_now()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_command(command: str, timeout: float, cwd: str) -> dict[str, Any]:
    """Run ``command`` without a shell; the result as the runtime returns it."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        return _result("", f"cannot parse command {command!r}: {exc}", 1)
    if not argv:
        return _result("", "empty command: nothing to run", 1)
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return _result("", f"cannot start {argv[0]!r}: {exc.strerror or exc}", 1)
    except ValueError as exc:  # a NUL byte or a lone surrogate in an argument
        return _result("", f"cannot start {argv[0]!r}: {exc}", 1)
    with _active_lock:
        _active_groups.add(proc.pid)
    try:
        out, err, truncated, timed_out = _communicate(proc, timeout)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing the command started outlives it
        with _active_lock:
            _active_groups.discard(proc.pid)
    if timed_out:
        note = f"\ncommand timed out after {timeout:g} seconds and was killed"
        return _result(
            _text(out), _text(err) + note, TIMEOUT_EXIT_CODE, timed_out=True, truncated=truncated
        )
    return _result(_text(out), _text(err), proc.returncode, truncated=truncated)


def _communicate(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes, bool, bool]:
    """``Popen.communicate`` with a memory bound: ``(stdout, stderr, truncated, timed_out)``.

    Both pipes are read until they close; the first :data:`OUTPUT_CAP` bytes of each are kept
    and the rest is read and dropped (the command never blocks on a full pipe). At the time
    limit the process group is killed and the pipes are read for up to 5 more seconds (a
    detached grandchild may hold them open); then the command is reaped.
    """
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    kept = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    truncated = timed_out = False
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if timed_out:
                    break  # the pipes are still open 5 s after the kill: give up on them
                timed_out = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 5.0
                continue
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, CHUNK_SIZE)
                if not data:
                    selector.unregister(key.fd)
                    continue
                buf = kept[key.fd]
                room = OUTPUT_CAP - len(buf)
                if len(data) > room:
                    truncated = True
                if room > 0:
                    buf += data[:room]
    proc.stdout.close()
    proc.stderr.close()
    if not timed_out:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:  # it closed its output but kept running
            timed_out = True
    if timed_out:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
    return bytes(out), bytes(err), truncated, timed_out


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")


def _result(
    stdout: str, stderr: str, exit_code: int, *, timed_out: bool = False, truncated: bool = False
) -> dict[str, Any]:
    return {
        "stdout": stdout,
        "stderr": stderr,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "output_truncated": truncated,
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # small replies are not held back by Nagle + delayed ACK
    server_version = "agent-sandbox-local-runtime"
    sys_version = ""
    base_dir: str = "/"
    exec_timeout: float = DEFAULT_EXEC_TIMEOUT
    commands: _managed.CommandManager
    fs_roots: _fs.Roots

    def log_message(self, format: str, *args: Any) -> None:
        return  # quiet: the broker logs requests

    # -- helpers ---------------------------------------------------------------------------
    def _send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, detail: str, *, close: bool = False) -> None:
        if close:
            self.close_connection = True
        data = json.dumps({"detail": detail}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _body_chunks(self) -> Iterator[bytes]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise ConnectionError("connection closed inside a chunked body")
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                remaining = size
                while remaining:
                    data = self.rfile.read(min(remaining, CHUNK_SIZE))
                    if not data:
                        raise ConnectionError("connection closed inside a chunk")
                    remaining -= len(data)
                    yield data
                self.rfile.readline(3)
        else:
            remaining = int(self.headers.get("Content-Length") or 0)
            while remaining > 0:
                data = self.rfile.read(min(remaining, CHUNK_SIZE))
                if not data:
                    raise ConnectionError("connection closed inside the body")
                remaining -= len(data)
                yield data

    def _read_json(self) -> Any:
        buf = bytearray()
        for chunk in self._body_chunks():
            buf += chunk
            if len(buf) > MAX_JSON_BODY:
                raise ValueError(f"body larger than {MAX_JSON_BODY} bytes")
        return json.loads(buf or b"{}")

    def _path_arg(self, prefix: str) -> str:
        return urllib.parse.unquote(urllib.parse.urlsplit(self.path).path[len(prefix) :])

    # -- routes ----------------------------------------------------------------------------
    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/":
            self._send_json(200, {"status": "ok", "message": "local sandbox runtime"})
        elif path.startswith("/download/"):
            self._download()
        elif path.startswith("/list/") or path == "/list":
            self._list()
        elif path.startswith("/exists/"):
            self._exists()
        elif path == "/commands" or path.startswith("/commands/"):
            self.commands.handle(self, "GET")
        elif path in _fs.GET_ROUTES:
            _fs.handle(self, path)
        else:
            self._error(404, f"no route for GET {path}")

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/execute":
            self._execute()
        elif path == "/upload":
            self._upload()
        elif path == "/commands" or path.startswith("/commands/"):
            self.commands.handle(self, "POST")
        elif path in _fs.POST_ROUTES:
            _fs.handle(self, path)
        else:
            self._drain()
            self._error(404, f"no route for POST {path}")

    def _drain(self) -> None:
        try:
            for _ in self._body_chunks():
                pass
        except (ConnectionError, ValueError):
            self.close_connection = True

    def _execute(self) -> None:
        try:
            body = self._read_json()
        except (ValueError, ConnectionError) as exc:
            self._error(400, f"request body must be a JSON object: {exc}", close=True)
            return
        command = body.get("command") if isinstance(body, dict) else None
        if not isinstance(command, str):
            self._error(400, "field 'command' (a string) is required")
            return
        timeout = body.get("timeout_seconds")
        if timeout is None:
            timeout = self.exec_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            self._error(400, "field 'timeout_seconds' must be a positive number")
            return
        self._send_json(200, run_command(command, float(timeout), self.base_dir))

    def _download(self) -> None:
        try:
            _legacy_fs.download(self, self._path_arg("/download/"))
        except _legacy_fs.Refusal as exc:
            _legacy_fs.send_refusal(self, exc)

    def _list(self) -> None:
        prefix = "/list/" if urllib.parse.urlsplit(self.path).path.startswith("/list/") else "/list"
        try:
            entries = _legacy_fs.list_dir(self, self._path_arg(prefix))
        except _legacy_fs.Refusal as exc:
            _legacy_fs.send_refusal(self, exc)
            return
        self._send_json(200, entries)

    def _exists(self) -> None:
        relative = self._path_arg("/exists/")
        try:
            found = _legacy_fs.exists(self, relative)
        except _legacy_fs.Refusal as exc:
            _legacy_fs.send_refusal(self, exc)
            return
        self._send_json(200, {"path": relative, "exists": found})

    def _upload(self) -> None:
        try:
            result = _legacy_fs.receive_upload(self)
        except _legacy_fs.Refusal as exc:
            _legacy_fs.send_refusal(self, exc, close=True)
            return
        self._send_json(200, result)


def serve(host: str, port: int, base_dir: str, port_file: str | None = None) -> None:
    """Serve the protocol on ``host:port`` for ``base_dir`` until killed. ``port`` 0: a port the
    system picks, written (once the socket listens) to ``port_file``, which the broker reads:
    no other process can take it between the choice and the bind."""
    signal.signal(signal.SIGTERM, _exit_now)
    base_dir = os.path.realpath(base_dir)
    os.makedirs(base_dir, exist_ok=True)
    exec_timeout = float(os.environ.get("SANDBOX_EXEC_TIMEOUT_SECONDS") or DEFAULT_EXEC_TIMEOUT)
    commands = _managed.CommandManager(
        base_dir, _managed.Limits.from_environ(os.environ, exec_timeout)
    )
    handler = type(
        "Handler",
        (_Handler,),
        {
            "base_dir": base_dir,
            "exec_timeout": exec_timeout,
            "commands": commands,
            "fs_roots": _fs.Roots.of(base_dir),  # the file API's roots, as they are at start
        },
    )
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    if port_file:
        _report_port(port_file, int(server.server_address[1]))
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        _kill_active_groups()


def _report_port(path: str, port: int) -> None:
    """Write ``port`` to ``path`` atomically: a reader sees no file or the whole number."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="ascii") as fh:
        fh.write(f"{port}\n")
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default: $PORT, else 8888")
    parser.add_argument(
        "--port-file",
        default=os.environ.get("SANDBOX_PORT_FILE") or None,
        help="listen on a port the system picks (unless --port) and write it to this file",
    )
    parser.add_argument("--base-dir", default=os.environ.get("SANDBOX_BASE_DIR", os.getcwd()))
    parser.add_argument(
        "--fork-server",
        action="store_true",
        help="read spawn requests (JSON lines) on stdin and fork one runtime per request",
    )
    args = parser.parse_args(argv)
    if args.fork_server:
        return fork_server()
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        _die_with_parent(int(parent))
    port = args.port
    if port is None:
        port = 0 if args.port_file else int(os.environ.get("PORT") or "8888")
    serve(args.host, port, args.base_dir, args.port_file)
    return 0


# -- fork server and supervisors -----------------------------------------------------------------
# Starting a Python process per sandbox costs ~60 ms of CPU and ~20 MiB; forking a warm,
# single-threaded template process costs ~2 ms and shares its memory copy-on-write. The broker
# starts one fork server and sends it one JSON line per sandbox:
#   {"id": N, "host": ..., "port": ..., "base_dir": ..., "env": {...}, "log": path,
#    "port_file": path or null, "argv": [...] or null}
# and reads back {"id": N, "pid": PID} or {"id": N, "error": "..."}, and {"exited": PID,
# "id": N, "status": CODE} whenever the runtime of request N has ended and everything it started
# is gone. An exit names its request: a PID can be used again (by the next sandbox's runtime)
# before the exit of the runtime that had it is reported.
#
# Process tree (Linux): fork server -> one supervisor per sandbox -> the runtime (its own process
# group; the built-in one is forked, ``argv`` is exec'd) -> commands. The supervisor is a session
# leader and a child subreaper (PR_SET_CHILD_SUBREAPER): whatever the runtime or a command
# starts stays below it, even after a double fork, a setsid or the death of its parent. When the
# runtime exits (or is killed), or the supervisor gets SIGTERM, it kills every process left
# below it and exits. The fork server is a subreaper too: what a killed supervisor leaves
# behind comes to it and is killed at once. The fork server dies with the broker
# (PR_SET_PDEATHSIG plus a parent watch), each supervisor with the fork server, each built-in
# runtime with its supervisor.

_WATCHED = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT)


class _Stop(Exception):
    pass


def _raise_stop(*_: object) -> None:
    raise _Stop


def _children() -> list[int]:
    """The processes whose parent is this one (from /proc; empty where there is no /proc)."""
    me = os.getpid()
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == me:
            found.append(int(entry))
    return found


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
    parent = int(os.environ.get(PARENT_PID_ENV) or os.getppid())
    _set_pdeathsig()
    if os.getppid() != parent:
        return 0
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    with contextlib.suppress(ImportError):  # warm for the children's first upload
        import python_multipart.multipart  # noqa: F401
    server = _ForkServerLoop(parent)
    try:
        server.serve()
    except (_Stop, BrokenPipeError):
        pass
    finally:
        server.stop_all()
    return 0


class _ForkServerLoop:
    """The fork server's loop (see above): requests on stdin, replies on stdout."""

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

    def serve(self) -> None:
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
                    self.read_report(key.fd)
                else:
                    self.read_requests()
            self.reap()

    def read_requests(self) -> None:
        data = os.read(0, 65536)
        if not data:
            raise _Stop
        self.pending += data
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            self.spawn(json.loads(line))

    @staticmethod
    def reply(message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\n"
        while data:
            data = data[os.write(1, data) :]

    def spawn(self, request: dict[str, Any]) -> None:
        try:
            supervisor, report = _fork_supervisor(
                request, (self.wake_r, self.wake_w, *self.starting)
            )
        except OSError as exc:
            self.reply({"id": request.get("id"), "error": f"fork failed: {exc}"})
            return
        self.starting[report] = (supervisor, request.get("id"), b"")
        self.selector.register(report, selectors.EVENT_READ)

    def read_report(self, fd: int) -> None:
        supervisor, ident, data = self.starting[fd]
        chunk = os.read(fd, 65536)
        if chunk:
            self.starting[fd] = (supervisor, ident, data + chunk)
            return
        del self.starting[fd]
        self.selector.unregister(fd)
        os.close(fd)
        started = json.loads(data) if data else {"error": "the sandbox supervisor exited early"}
        self.reply({"id": ident, **started})
        if "pid" not in started:
            self.early.pop(supervisor, None)
        elif supervisor in self.early:  # the runtime has already ended, and its supervisor too
            status = self.early.pop(supervisor)
            self.reply({"exited": started["pid"], "id": ident, "status": status})
        else:
            self.supervisors[supervisor] = (int(started["pid"]), ident)

    def reap(self) -> None:
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
                self.reply({"exited": runtime[0], "id": runtime[1], "status": code})
            elif pid in reporting:
                self.early[pid] = code
            # not a supervisor (an orphan), or a supervisor killed before it could clean up
            orphans = orphans or (runtime is None and pid not in reporting) or code < 0
        if orphans:  # only a dead supervisor's processes come to us: kill them all
            _kill_children(keep={*self.supervisors, *reporting})

    def stop_all(self) -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        alive = {*self.supervisors, *(entry[0] for entry in self.starting.values())}
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)  # each stops its runtime and kills what is left
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
    _set_pdeathsig()
    if os.getppid() != fork_server_pid:
        return
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
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
                _set_pdeathsig()
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
            _die_with_parent(supervisor)
            serve(
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
