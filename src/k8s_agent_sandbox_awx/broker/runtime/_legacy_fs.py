"""The local runtime's legacy file endpoints: ``GET /download/{path}``, ``GET /list/{path}``,
``GET /exists/{path}`` and ``POST /upload`` (upstream python-runtime semantics).

A path is relative to the base directory (``/app``) and resolved with its symbolic links; one
that resolves outside the base directory is ``403``. The resolution and the use have no window
between them: the resolved path is then opened one component at a time, relative to the base
directory's descriptor (checked to be the directory the runtime started with:
:class:`._fs.Roots`, ``403 root_replaced`` otherwise) and with ``O_NOFOLLOW``, so a link swapped
in after the resolution is met, never followed; the path is then resolved again (at most
:data:`ATTEMPTS` times, then ``409``). Refusals are ``{"detail"}`` (and a ``code`` for
``root_replaced``), as upstream's runtime answers.

Standard library only (``python-multipart`` is imported on the first upload).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from . import _fs

if TYPE_CHECKING:
    from ._runtime import _Handler

ATTEMPTS = 5
"""Resolutions of one path before a request gives up on a path that keeps changing."""
UPLOAD_TMP_PREFIX = ".upload-"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
T = TypeVar("T")


class Refusal(Exception):
    """An error answer: ``status`` and ``detail`` (and ``code``, for ``root_replaced``)."""

    def __init__(self, status: int, detail: str, code: str | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.code = code


class _Changed(Exception):
    """The path changed under the request (a link swapped in, a directory moved or replaced):
    resolve it again. ``link``: the host path of the link met, if one was."""

    def __init__(self, link: str | None = None) -> None:
        super().__init__(link)
        self.link = link


def _inside(base: str, relative: str) -> list[str]:
    """The components of ``relative``'s resolved path below ``base``; 403 when it escapes."""
    try:
        full = None if "\x00" in relative else os.path.realpath(os.path.join(base, relative))
    except OSError:  # a link changed while it was read (Python < 3.13 does not retry)
        raise _Changed() from None
    if full == base:
        return []
    if full is None or not full.startswith(base + os.sep):
        raise Refusal(403, f"path {relative!r} escapes the sandbox directory")
    return full[len(base) + 1 :].split(os.sep)


def _kind(fd: int, name: str) -> str | None:
    """``"link"``, ``"directory"`` or ``"other"`` for ``name`` below ``fd`` now; ``None``:
    missing."""
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        return None
    return "link" if stat.S_ISLNK(mode) else "directory" if stat.S_ISDIR(mode) else "other"


def _met(exc: OSError, fd: int, name: str, path: str, create: bool) -> BaseException:
    """What opening the directory ``name`` (host ``path``) below ``fd`` failing with ``exc``
    means: ``_Changed`` when the path changed (or is a link), else ``exc``."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        kind = _kind(fd, name)
        if exc.errno == errno.ELOOP or kind == "link":
            return _Changed(path)
        if kind != "other":  # a directory, or gone, by now: it changed
            return _Changed()
    elif exc.errno == errno.ENOENT and create:  # made, then removed before it was opened
        return _Changed()
    return exc


def _open_dirs(base_fd: int, base: str, parts: list[str], *, create: bool = False) -> int:
    """A new descriptor of the directory ``parts`` below ``base_fd``, never through a link
    (``_Changed`` when one is on the way); ``create``: missing directories are made."""
    fd = os.dup(base_fd)
    try:
        for i, name in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=fd)
            try:
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _met(exc, fd, name, os.path.join(base, *parts[: i + 1]), create) from None
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _loops(path: str) -> bool:
    """Whether the link at ``path`` does not resolve (a loop)."""
    try:
        os.path.realpath(path, strict=True)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def _resolved(
    roots: _fs.Roots,
    relative: str,
    use: Callable[[int, list[str]], T],
    unresolvable: Callable[[], T],
) -> T:
    """``use(base_fd, parts)`` for ``relative`` resolved inside the base directory; resolved
    again when the path changed (``use`` met a link swapped in meanwhile); ``unresolvable()``
    when the link it met does not resolve (a loop)."""
    base = roots.paths["/app"]
    for _ in range(ATTEMPTS):
        try:
            base_fd = roots.open("/app", relative)
        except _fs.FsError as exc:
            raise Refusal(exc.status, exc.detail, exc.code) from None
        try:
            return use(base_fd, _inside(base, relative))
        except _Changed as changed:
            if changed.link is not None and _loops(changed.link):
                return unresolvable()
        finally:
            os.close(base_fd)
    raise Refusal(
        409,
        f"path {relative!r} kept changing while it was opened (a symbolic link on its way was "
        "replaced, again and again); try again",
    )


def _os_refusal(exc: OSError, relative: str, kind: str) -> Refusal:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return Refusal(404, f"{relative!r} is not a {kind}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return Refusal(403, f"{relative!r} is not accessible to the runtime (permission denied)")
    return Refusal(500, f"{relative!r} failed: {exc.strerror or exc}")


def send_refusal(handler: _Handler, refusal: Refusal, *, close: bool = False) -> None:
    body: dict[str, Any] = {"detail": refusal.detail}
    if refusal.code is not None:
        body["code"] = refusal.code
    data = json.dumps(body).encode()
    if close:
        handler.close_connection = True
    handler.send_response(refusal.status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    if close:
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(data)


# -- GET -----------------------------------------------------------------------------------------
def download(handler: _Handler, relative: str) -> None:
    """``GET /download/{relative}``: the regular file's bytes, streamed; 404 if not a file."""
    base = handler.fs_roots.paths["/app"]

    def use(base_fd: int, parts: list[str]) -> int:
        if not parts:
            raise Refusal(404, f"{relative!r} is not a file")
        parent = _open_dirs(base_fd, base, parts[:-1])
        try:
            return os.open(parts[-1], _FILE_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Changed(os.path.join(base, *parts)) from None
            raise
        finally:
            os.close(parent)

    def not_a_file() -> int:
        raise Refusal(404, f"{relative!r} is not a file")

    try:
        fd = _resolved(handler.fs_roots, relative, use, not_a_file)
    except OSError as exc:
        raise _os_refusal(exc, relative, "file") from None
    with os.fdopen(fd, "rb", buffering=0) as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Refusal(404, f"{relative!r} is not a file")
        _fs.send_file(handler, fh, st.st_size)


def list_dir(handler: _Handler, relative: str) -> list[dict[str, Any]]:
    """``GET /list/{relative}``: the directory's entries (links described by their target, as
    upstream's runtime does); 404 if not a directory."""
    base = handler.fs_roots.paths["/app"]

    def use(base_fd: int, parts: list[str]) -> list[dict[str, Any]]:
        fd = _open_dirs(base_fd, base, parts)
        try:
            return _entries(fd)
        finally:
            os.close(fd)

    def not_a_directory() -> list[dict[str, Any]]:
        raise Refusal(404, f"{relative!r} is not a directory")

    try:
        return _resolved(handler.fs_roots, relative, use, not_a_directory)
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


def exists(handler: _Handler, relative: str) -> bool:
    """``GET /exists/{relative}``: whether the path exists (a link: its target)."""
    base = handler.fs_roots.paths["/app"]

    def use(base_fd: int, parts: list[str]) -> bool:
        if not parts:
            return True
        try:
            parent = _open_dirs(base_fd, base, parts[:-1])
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        finally:
            os.close(parent)
        if stat.S_ISLNK(st.st_mode):
            raise _Changed(os.path.join(base, *parts))
        return True

    try:
        return _resolved(handler.fs_roots, relative, use, lambda: False)
    except OSError as exc:
        raise _os_refusal(exc, relative, "path") from None


# -- POST /upload --------------------------------------------------------------------------------
class _Upload:
    """One ``POST /upload``: the first ``file`` part streamed to a temporary file beside its
    destination (the part's filename), renamed over it at the part's end."""

    def __init__(self, roots: _fs.Roots) -> None:
        self.roots = roots
        self.headers: dict[str, bytes] = {}
        self.field = b""
        self.value = b""
        self.parent: int | None = None
        self.tmp: str | None = None
        self.out: int | None = None
        self.name = ""
        self.relative = ""
        self.size = 0
        self.done: dict[str, Any] = {}

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def on_header_end(self) -> None:
        self.headers[self.field.decode("latin-1").lower()] = self.value
        self.field, self.value = b"", b""

    def on_headers_finished(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, disp = parse_options_header(self.headers.get("content-disposition", b""))
        if disp.get(b"name") != b"file" or self.done or self.out is not None:
            return
        raw_name = disp.get(b"filename")
        if not raw_name:
            raise Refusal(400, "the 'file' part needs a filename (the destination path)")
        self.relative = raw_name.decode("utf-8", errors="strict")
        self.parent, self.tmp, self.out = _resolved(
            self.roots, self.relative, self._open, self._unresolvable
        )

    def _open(self, base_fd: int, parts: list[str]) -> tuple[int, str, int]:
        """The destination's directory (made if missing), after checking the destination, and
        a new temporary file in it: ``(directory, temporary name, its descriptor)``."""
        if not parts:
            raise Refusal(400, f"destination {self.relative!r} is a directory")
        parent = _open_dirs(base_fd, self.roots.paths["/app"], parts[:-1], create=True)
        try:
            try:
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise Refusal(400, f"destination {self.relative!r} is a directory")
            tmp = f"{UPLOAD_TMP_PREFIX}{secrets.token_hex(8)}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                out = os.open(tmp, flags, 0o600, dir_fd=parent)
            except FileNotFoundError:  # the directory was removed since it was opened
                raise _Changed() from None
        except BaseException:
            os.close(parent)
            raise
        self.name = parts[-1]
        return parent, tmp, out

    def _unresolvable(self) -> tuple[int, str, int]:
        raise Refusal(
            400, f"destination {self.relative!r}: a symbolic link on its way does not resolve"
        )

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.out is not None:
            view = memoryview(data)[start:end]
            self.size += len(view)
            while view:
                view = view[os.write(self.out, view) :]

    def on_part_end(self) -> None:
        if self.out is not None:
            assert self.parent is not None and self.tmp is not None
            os.close(self.out)
            self.out = None
            try:
                os.rename(self.tmp, self.name, src_dir_fd=self.parent, dst_dir_fd=self.parent)
            except FileNotFoundError:
                raise Refusal(
                    409,
                    f"the directory of {self.relative!r} was removed or replaced while the "
                    "upload was written; try again",
                ) from None
            self.tmp = None
            self.done.update(path=self.relative, size=self.size)
        self.headers = {}

    def cleanup(self) -> None:
        if self.out is not None:
            os.close(self.out)
            self.out = None
        if self.tmp is not None and self.parent is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.parent)
        if self.parent is not None:
            os.close(self.parent)
            self.parent = None


def receive_upload(handler: _Handler) -> dict[str, Any]:
    """Stream a multipart upload to its destination; ``{"path", "size"}``. Raises Refusal."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    ctype, options = parse_options_header(handler.headers.get("Content-Type", ""))
    boundary = options.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise Refusal(400, "upload must be multipart/form-data with a boundary")
    state = _Upload(handler.fs_roots)
    parser = MultipartParser(
        boundary,
        {
            "on_header_field": state.on_header_field,
            "on_header_value": state.on_header_value,
            "on_header_end": state.on_header_end,
            "on_headers_finished": state.on_headers_finished,
            "on_part_data": state.on_part_data,
            "on_part_end": state.on_part_end,
        },
    )
    failure: Refusal | None = None
    try:
        for chunk in handler._body_chunks():
            if failure is not None:
                continue  # read the rest, so the client gets our answer, not a reset
            try:
                parser.write(chunk)
            except Refusal as exc:
                failure = exc
            except (ValueError, OSError) as exc:
                failure = Refusal(400, f"malformed upload: {exc}")
        if failure is None:
            parser.finalize()
    except (ConnectionError, ValueError, OSError) as exc:
        raise Refusal(400, f"malformed upload: {exc}") from exc
    finally:
        state.cleanup()
    if failure is not None:
        raise failure
    if not state.done:
        raise Refusal(400, "multipart body has no 'file' part")
    return state.done
