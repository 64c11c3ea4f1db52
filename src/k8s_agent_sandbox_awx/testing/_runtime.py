"""The local sandbox runtime: one process per sandbox, speaking the legacy python-runtime protocol.

Run as ``python -m k8s_agent_sandbox_awx.testing._runtime --port PORT --base-dir DIR``.
It uses the standard library only (``python-multipart`` is imported on the first upload), so it
starts in a few tens of milliseconds.

Semantics (as upstream's python-runtime-sandbox):

- ``GET /`` health; ``POST /execute`` ``{"command", "timeout_seconds"?}`` splits the command with
  :func:`shlex.split` and runs it **without a shell**, in the base directory, in its own process
  group; at the time limit the group is killed (``timed_out: true``, ``exit_code`` 124); a command
  that cannot start is ``exit_code`` 1 with the reason in ``stderr``.
- ``POST /upload`` multipart field ``file``, filename = destination path (parents created);
  ``GET /download/{path}``, ``GET /list/{path}``, ``GET /exists/{path}``.
- Every path is resolved inside the base directory; a path that escapes it is ``403``.
- The deployed runtimes' file endpoints ``/fs/*`` (``/app`` = the base directory, ``/workspace`` =
  ``SANDBOX_WORKSPACE_DIR``): see :mod:`._fs`.

The process dies with its parent: ``PR_SET_PDEATHSIG`` (Linux) plus a thread that watches the
parent pid. On ``SIGTERM`` it kills the process groups of running commands and exits.

NO ISOLATION: commands run as host processes with the user's privileges. Development and tests
only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import _fs, _managed

CHUNK_SIZE = 256 * 1024
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


def _set_pdeathsig() -> None:
    """Ask Linux to send SIGTERM when the parent (thread) that started us dies."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - exotic libc
            pass


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


def resolve_path(base_dir: str, relative: str) -> str | None:
    """The real path of ``relative`` inside ``base_dir``, or ``None`` when it escapes."""
    if "\x00" in relative:
        return None
    full = os.path.realpath(os.path.join(base_dir, relative))
    if full == base_dir or full.startswith(base_dir + os.sep):
        return full
    return None


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
    with _active_lock:
        _active_groups.add(proc.pid)
    timed_out = False
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # a detached grandchild holds the pipes
                proc.kill()
                out, err = b"", b""
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing the command started outlives it
        with _active_lock:
            _active_groups.discard(proc.pid)
    if timed_out:
        note = f"\ncommand timed out after {timeout:g} seconds and was killed"
        return _result(_text(out), _text(err) + note, TIMEOUT_EXIT_CODE, timed_out=True)
    return _result(_text(out), _text(err), proc.returncode)


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")


def _result(stdout: str, stderr: str, exit_code: int, *, timed_out: bool = False) -> dict[str, Any]:
    return {"stdout": stdout, "stderr": stderr, "exit_code": exit_code, "timed_out": timed_out}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # small replies are not held back by Nagle + delayed ACK
    server_version = "agent-sandbox-local-runtime"
    sys_version = ""
    base_dir: str = "/"
    exec_timeout: float = DEFAULT_EXEC_TIMEOUT
    commands: _managed.CommandManager

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

    def _path_arg(self, prefix: str) -> tuple[str, str | None]:
        raw = urllib.parse.urlsplit(self.path).path[len(prefix) :]
        relative = urllib.parse.unquote(raw)
        return relative, resolve_path(self.base_dir, relative)

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
        relative, full = self._path_arg("/download/")
        if full is None:
            self._error(403, f"path {relative!r} escapes the sandbox directory")
            return
        if not os.path.isfile(full):
            self._error(404, f"{relative!r} is not a file")
            return
        with open(full, "rb") as fh:
            _fs.send_file(self, fh, os.fstat(fh.fileno()).st_size)

    def _list(self) -> None:
        prefix = "/list/" if urllib.parse.urlsplit(self.path).path.startswith("/list/") else "/list"
        relative, full = self._path_arg(prefix)
        if full is None:
            self._error(403, f"path {relative!r} escapes the sandbox directory")
            return
        if not os.path.isdir(full):
            self._error(404, f"{relative!r} is not a directory")
            return
        entries = []
        with os.scandir(full) as it:
            for entry in sorted(it, key=lambda e: e.name):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                kind = "directory" if entry.is_dir() else "file"
                entries.append(
                    {"name": entry.name, "size": st.st_size, "type": kind, "mod_time": st.st_mtime}
                )
        self._send_json(200, entries)

    def _exists(self) -> None:
        relative, full = self._path_arg("/exists/")
        if full is None:
            self._error(403, f"path {relative!r} escapes the sandbox directory")
            return
        self._send_json(200, {"path": relative, "exists": os.path.exists(full)})

    def _upload(self) -> None:
        try:
            result = _receive_upload(self)
        except _UploadError as exc:
            self._error(exc.status, exc.detail, close=True)
            return
        self._send_json(200, result)


class _UploadError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _receive_upload(handler: _Handler) -> dict[str, Any]:
    """Stream a multipart upload to its destination (a temp file renamed into place)."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    ctype, options = parse_options_header(handler.headers.get("Content-Type", ""))
    boundary = options.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise _UploadError(400, "upload must be multipart/form-data with a boundary")

    state: dict[str, Any] = {"headers": {}, "field": b"", "value": b"", "out": None}
    done: dict[str, Any] = {}
    base = handler.base_dir

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["field"].decode("latin-1").lower()] = state["value"]
        state["field"], state["value"] = b"", b""

    def on_headers_finished() -> None:
        _, disp = parse_options_header(state["headers"].get("content-disposition", b""))
        if disp.get(b"name") != b"file" or done:
            return
        raw_name = disp.get(b"filename")
        if not raw_name:
            raise _UploadError(400, "the 'file' part needs a filename (the destination path)")
        relative = raw_name.decode("utf-8", errors="strict")
        full = resolve_path(base, relative)
        if full is None:
            raise _UploadError(403, f"path {relative!r} escapes the sandbox directory")
        if full == base or os.path.isdir(full):
            raise _UploadError(400, f"destination {relative!r} is a directory")
        os.makedirs(os.path.dirname(full), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".upload-", dir=os.path.dirname(full))
        state["out"] = (os.fdopen(fd, "wb"), tmp, full, relative)
        state["size"] = 0

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["out"] is not None:
            state["out"][0].write(data[start:end])
            state["size"] += end - start

    def on_part_end() -> None:
        if state["out"] is not None:
            fh, tmp, full, relative = state["out"]
            fh.close()
            os.replace(tmp, full)
            done.update(path=relative, size=state["size"])
            state["out"] = None
        state["headers"] = {}

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    failure: _UploadError | None = None
    try:
        for chunk in handler._body_chunks():
            if failure is not None:
                continue  # read the rest, so the client gets our answer, not a reset
            try:
                parser.write(chunk)
            except _UploadError as exc:
                failure = exc
            except (ValueError, OSError) as exc:
                failure = _UploadError(400, f"malformed upload: {exc}")
        if failure is None:
            parser.finalize()
    except _UploadError:
        raise
    except (ConnectionError, ValueError, OSError) as exc:
        raise _UploadError(400, f"malformed upload: {exc}") from exc
    finally:
        if state["out"] is not None:
            state["out"][0].close()
            with contextlib.suppress(OSError):
                os.unlink(state["out"][1])
    if failure is not None:
        raise failure
    if not done:
        raise _UploadError(400, "multipart body has no 'file' part")
    return done


def serve(host: str, port: int, base_dir: str) -> None:
    """Serve the protocol on ``host:port`` for ``base_dir`` until killed."""
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
        {"base_dir": base_dir, "exec_timeout": exec_timeout, "commands": commands},
    )
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        _kill_active_groups()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8888")))
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
    serve(args.host, args.port, args.base_dir)
    return 0


# -- fork server -------------------------------------------------------------------------------
# Starting a Python process per sandbox costs ~60 ms of CPU and ~20 MiB; forking a warm,
# single-threaded template process costs ~2 ms and shares its memory copy-on-write. The broker
# starts one fork server and sends it one JSON line per sandbox:
#   {"id": N, "host": ..., "port": ..., "base_dir": ..., "env": {...}, "log": path}
# and reads back {"id": N, "pid": PID} or {"id": N, "error": "..."}, and {"exited": PID,
# "status": CODE} whenever a runtime ends. Each runtime is a session leader (its own process
# group), dies with the fork server, and the fork server dies with the broker.


class _Stop(Exception):
    pass


def _raise_stop(*_: object) -> None:
    raise _Stop


def fork_server() -> int:
    import selectors

    parent = int(os.environ.get(PARENT_PID_ENV) or os.getppid())
    _set_pdeathsig()
    if os.getppid() != parent:
        return 0
    with contextlib.suppress(ImportError):  # warm for the children's first upload
        import python_multipart.multipart  # noqa: F401
    children: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    pending = b""

    def reply(message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\n"
        while data:
            data = data[os.write(1, data) :]

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            reply({"exited": pid, "status": os.waitstatus_to_exitcode(status)})

    try:
        while True:
            events = selector.select(timeout=0.5)
            if os.getppid() != parent:
                break
            for key, _ in events:
                if key.fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 4096):
                            pass
                    continue
                data = os.read(0, 65536)
                if not data:
                    raise _Stop
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    try:
                        pid = _fork_runtime(request, (wake_r, wake_w))
                    except OSError as exc:
                        reply({"id": request.get("id"), "error": f"fork failed: {exc}"})
                        continue
                    children.add(pid)
                    reply({"id": request.get("id"), "pid": pid})
            reap()
    except (_Stop, BrokenPipeError):
        pass
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while children and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                pid, _status = os.waitpid(-1, os.WNOHANG)
                if pid:
                    children.discard(pid)
                    continue
            time.sleep(0.01)
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    return 0


def _fork_runtime(request: dict[str, Any], close_fds: tuple[int, ...]) -> int:
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: never returns into the fork server's loop
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for fd in close_fds:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["base_dir"])
        _die_with_parent(zygote)
        serve(request["host"], int(request["port"]), request["base_dir"])
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
