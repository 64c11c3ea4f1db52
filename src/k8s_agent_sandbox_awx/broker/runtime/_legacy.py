"""The runtime's legacy endpoints, with upstream's python-runtime semantics: ``POST /execute``,
``POST /upload``, ``GET /download/{path}``, ``GET /list/{path}`` and ``GET /exists/{path}``.

- ``POST /execute`` ``{"command", "timeout_seconds"?}`` splits the command with
  :func:`shlex.split` and runs it **without a shell**, in the base directory, in its own process
  group; at the time limit the group is killed (``timed_out: true``, ``exit_code`` 124); a
  command that cannot start is ``exit_code`` 1 with the reason in ``stderr``. The first
  :data:`OUTPUT_CAP` bytes of stdout and of stderr are kept, the rest is read and dropped
  (``output_truncated: true``).
- ``POST /upload``: the multipart field ``file``, its filename the destination path (parents
  created), streamed to a temporary file beside it and renamed over it at the part's end.
- The file endpoints take a path relative to the base directory (``/app``), resolved with its
  symbolic links inside it (the legacy rule of :mod:`._paths`: ``403`` when it escapes).
  Refusals are ``{"detail"}`` (and a ``code`` for ``root_replaced``), as upstream's runtime
  answers.

Standard library only (``python-multipart`` is imported on the first upload).
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import shlex
import signal
import stat
import subprocess
import time
import urllib.parse
from typing import Any

from . import _process
from ._env import command_environment, sandbox_environment
from ._http import CHUNK_SIZE, Exchange, body_chunks, read_json, send_file, send_json
from ._multipart import FileWriter, PartFile, boundary_of, read_form
from ._paths import READ_ONLY, PathChanged, Refusal, Roots, open_legacy_dirs, resolve_legacy

OUTPUT_CAP = 1024 * 1024
"""Bytes of a command's stdout, and of its stderr, that the runtime keeps (the rest is read and
dropped, and the answer says ``output_truncated: true``)."""
DEFAULT_EXEC_TIMEOUT = 300.0
TIMEOUT_EXIT_CODE = 124
UPLOAD_TMP_PREFIX = ".upload-"

_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_running = _process.ProcessGroups()
"""The process groups of the ``/execute`` commands that run now."""


def kill_running() -> None:
    """Kill the process group of every ``/execute`` command that runs now."""
    _running.kill_all()


# -- POST /execute -------------------------------------------------------------------------------
def execute(exchange: Exchange) -> None:
    try:
        body = read_json(exchange)
    except (ValueError, ConnectionError) as exc:
        detail = f"request body must be a JSON object: {exc}"
        send_json(exchange, 400, {"detail": detail}, close=True)
        return
    command = body.get("command") if isinstance(body, dict) else None
    if not isinstance(command, str):
        send_json(exchange, 400, {"detail": "field 'command' (a string) is required"})
        return
    timeout = body.get("timeout_seconds")
    if timeout is None:
        timeout = exchange.exec_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        send_json(exchange, 400, {"detail": "field 'timeout_seconds' must be a positive number"})
        return
    try:
        env = command_environment(os.environ, sandbox_environment(exchange.headers), {})
    except ValueError as exc:
        send_json(exchange, 400, {"detail": str(exc)})
        return
    send_json(exchange, 200, run_command(command, float(timeout), exchange.base_dir, env))


def run_command(
    command: str, timeout: float, cwd: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``command`` without a shell (in the environment ``env``; ``None``: the runtime's);
    the result as the runtime returns it."""
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
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return _result("", f"cannot start {argv[0]!r}: {exc.strerror or exc}", 1)
    except ValueError as exc:  # a NUL byte or a lone surrogate in an argument
        return _result("", f"cannot start {argv[0]!r}: {exc}", 1)
    _running.add(proc.pid)
    try:
        out, err, truncated, timed_out = _communicate(proc, timeout)
    finally:
        _process.kill_group(proc.pid)  # nothing the command started outlives it
        _running.discard(proc.pid)
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


# -- the file endpoints --------------------------------------------------------------------------
def _path_arg(exchange: Exchange, prefix: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(exchange.path).path[len(prefix) :])


def download_endpoint(exchange: Exchange) -> None:
    try:
        download(exchange, _path_arg(exchange, "/download/"))
    except Refusal as exc:
        send_json(exchange, exc.status, exc.body())


def list_endpoint(exchange: Exchange) -> None:
    path = urllib.parse.urlsplit(exchange.path).path
    prefix = "/list/" if path.startswith("/list/") else "/list"
    try:
        entries = list_dir(exchange, _path_arg(exchange, prefix))
    except Refusal as exc:
        send_json(exchange, exc.status, exc.body())
        return
    send_json(exchange, 200, entries)


def exists_endpoint(exchange: Exchange) -> None:
    relative = _path_arg(exchange, "/exists/")
    try:
        found = exists(exchange, relative)
    except Refusal as exc:
        send_json(exchange, exc.status, exc.body())
        return
    send_json(exchange, 200, {"path": relative, "exists": found})


def upload_endpoint(exchange: Exchange) -> None:
    try:
        result = receive_upload(exchange)
    except Refusal as exc:
        send_json(exchange, exc.status, exc.body(), close=True)
        return
    send_json(exchange, 200, result)


def _os_refusal(exc: OSError, relative: str, kind: str) -> Refusal:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return Refusal(404, f"{relative!r} is not a {kind}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return Refusal(403, f"{relative!r} is not accessible to the runtime (permission denied)")
    if exc.errno == errno.EROFS:
        return Refusal(403, f"{relative!r} {READ_ONLY}")
    return Refusal(500, f"{relative!r} failed: {exc.strerror or exc}")


# -- GET -----------------------------------------------------------------------------------------
def download(exchange: Exchange, relative: str) -> None:
    """``GET /download/{relative}``: the regular file's bytes, streamed; 404 if not a file."""
    base = exchange.fs_roots.paths["/app"]

    def use(base_fd: int, parts: list[str]) -> int:
        if not parts:
            raise Refusal(404, f"{relative!r} is not a file")
        parent = open_legacy_dirs(base_fd, base, parts[:-1])
        try:
            return os.open(parts[-1], _FILE_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PathChanged(os.path.join(base, *parts)) from None
            raise
        finally:
            os.close(parent)

    def not_a_file() -> int:
        raise Refusal(404, f"{relative!r} is not a file")

    try:
        fd = resolve_legacy(exchange.fs_roots, relative, use, not_a_file)
    except OSError as exc:
        raise _os_refusal(exc, relative, "file") from None
    with os.fdopen(fd, "rb", buffering=0) as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Refusal(404, f"{relative!r} is not a file")
        send_file(exchange, fh, st.st_size)


def list_dir(exchange: Exchange, relative: str) -> list[dict[str, Any]]:
    """``GET /list/{relative}``: the directory's entries (links described by their target, as
    upstream's runtime does); 404 if not a directory."""
    base = exchange.fs_roots.paths["/app"]

    def use(base_fd: int, parts: list[str]) -> list[dict[str, Any]]:
        fd = open_legacy_dirs(base_fd, base, parts)
        try:
            return _entries(fd)
        finally:
            os.close(fd)

    def not_a_directory() -> list[dict[str, Any]]:
        raise Refusal(404, f"{relative!r} is not a directory")

    try:
        return resolve_legacy(exchange.fs_roots, relative, use, not_a_directory)
    except OSError as exc:
        raise _os_refusal(exc, relative, "directory") from None


def _entries(fd: int) -> list[dict[str, Any]]:
    out = []
    with os.scandir(fd) as it:
        for entry in sorted(it, key=lambda e: e.name):
            try:
                st = entry.stat()
            except OSError:
                continue
            kind = "directory" if entry.is_dir() else "file"
            out.append(
                {"name": entry.name, "size": st.st_size, "type": kind, "mod_time": st.st_mtime}
            )
    return out


def exists(exchange: Exchange, relative: str) -> bool:
    """``GET /exists/{relative}``: whether the path exists (a link: its target)."""
    base = exchange.fs_roots.paths["/app"]

    def use(base_fd: int, parts: list[str]) -> bool:
        if not parts:
            return True
        try:
            parent = open_legacy_dirs(base_fd, base, parts[:-1])
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        finally:
            os.close(parent)
        if stat.S_ISLNK(st.st_mode):
            raise PathChanged(os.path.join(base, *parts))
        return True

    try:
        return resolve_legacy(exchange.fs_roots, relative, use, lambda: False)
    except OSError as exc:
        raise _os_refusal(exc, relative, "path") from None


# -- POST /upload -------------------------------------------------------------------------------
class _Upload(FileWriter):
    """One ``POST /upload`` (a :class:`._multipart.Form`): the first ``file`` part streamed to
    a temporary file beside its destination (the part's filename), renamed over it at the
    part's end."""

    def __init__(self, roots: Roots) -> None:
        super().__init__()
        self.roots = roots
        self.name = ""
        self.relative = ""
        self.done: dict[str, Any] = {}

    def begin(self, disposition: dict[bytes, bytes]) -> None:
        if disposition.get(b"name") != b"file" or self.done or self.file is not None:
            return
        raw_name = disposition.get(b"filename")
        if not raw_name:
            raise Refusal(400, "the 'file' part needs a filename (the destination path)")
        self.relative = raw_name.decode("utf-8", errors="strict")
        self.parent, self.file = resolve_legacy(
            self.roots, self.relative, self._open, self._unresolvable
        )

    def _open(self, base_fd: int, parts: list[str]) -> tuple[int, PartFile]:
        """The destination's directory (made if missing), after checking the destination, and
        a new temporary file in it."""
        if not parts:
            raise Refusal(400, f"destination {self.relative!r} is a directory")
        parent = open_legacy_dirs(base_fd, self.roots.paths["/app"], parts[:-1], create=True)
        try:
            try:
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise Refusal(400, f"destination {self.relative!r} is a directory")
            try:
                file = PartFile(parent, UPLOAD_TMP_PREFIX, 0o600)
            except FileNotFoundError:  # the directory was removed since it was opened
                raise PathChanged() from None
        except BaseException:
            os.close(parent)
            raise
        self.name = parts[-1]
        return parent, file

    def _unresolvable(self) -> tuple[int, PartFile]:
        raise Refusal(
            400, f"destination {self.relative!r}: a symbolic link on its way does not resolve"
        )

    def data(self, data: memoryview) -> None:
        if self.file is not None:
            self.file.write(data)

    def end(self) -> None:
        if self.file is not None:
            try:
                self.file.commit(self.name)
            except FileNotFoundError:
                raise Refusal(
                    409,
                    f"the directory of {self.relative!r} was removed or replaced while the "
                    "upload was written; try again",
                ) from None
            self.done.update(path=self.relative, size=self.file.size)
            self.file = None


def receive_upload(exchange: Exchange) -> dict[str, Any]:
    """Stream a multipart upload to its destination; ``{"path", "size"}``. Raises Refusal."""
    boundary = boundary_of(exchange.headers.get("Content-Type", ""))
    if boundary is None:
        raise Refusal(400, "upload must be multipart/form-data with a boundary")
    state = _Upload(exchange.fs_roots)
    try:
        failure = read_form(boundary, body_chunks(exchange), state, _upload_failure)
    except (ConnectionError, ValueError, OSError) as exc:
        raise Refusal(400, f"malformed upload: {exc}") from exc
    finally:
        state.cleanup()
    if failure is not None:
        raise failure
    if not state.done:
        raise Refusal(400, "multipart body has no 'file' part")
    return state.done


def _upload_failure(exc: Exception) -> Refusal:
    """The refusal an exception raised while a chunk of an upload was parsed means."""
    if isinstance(exc, Refusal):
        return exc
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return Refusal(403, f"the upload's destination {READ_ONLY}")
    if isinstance(exc, ValueError | OSError):
        return Refusal(400, f"malformed upload: {exc}")
    raise exc
