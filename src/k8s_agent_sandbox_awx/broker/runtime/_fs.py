"""The local runtime's file endpoints (``/fs/*``), as the deployed runtimes speak them.

Standard library only (``python-multipart`` is imported on the first ``POST /fs/write``, as the
legacy ``/upload`` does). :mod:`._runtime` routes ``GET``/``POST`` requests for the paths in
:data:`GET_ROUTES` and :data:`POST_ROUTES` here; the contract is docs/broker-api.md ("Files").

Paths. Two roots: ``/app`` (the sandbox's base directory, where commands run) and ``/workspace``
(the sandbox's persistent area: ``SANDBOX_WORKSPACE_DIR``, default ``<base dir>/workspace``;
``/app/workspace`` is an alias of it). A relative path is relative to ``/app``. No ``..``, no
control characters, at most 4096 characters. Symbolic links are never followed: every
directory is opened relative to its parent with ``O_NOFOLLOW`` (no check-then-use race), and an
operation on a link acts on the link itself. The roots themselves are the directories they were
when the runtime started (:class:`Roots`): one that a command removed, moved or replaced (by a
link or another directory) is refused, never followed.

Refusals are JSON ``{"detail", "code", "path"}`` with the codes in :data:`ERROR_CODES`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from . import _tree

if TYPE_CHECKING:
    from ._runtime import _Handler

WORKSPACE_ENV = "SANDBOX_WORKSPACE_DIR"
READ_MAX_ENV = "SANDBOX_FS_READ_MAX_BYTES"
DEFAULT_READ_MAX_BYTES = 64 * 1024 * 1024
"""``GET /fs/read`` refuses larger files (as deployed runtimes do); ``/download/...`` has no cap."""
MAX_PATH_CHARS = 4096
MAX_LIST_ENTRIES = 2000
MAX_WATCH_ENTRIES = 10000
MAX_WATCH_SECONDS = 20.0
WATCH_POLL_SECONDS = 0.25
WATCH_HEARTBEAT_SECONDS = 5.0
CHUNK_SIZE = 256 * 1024
WRITE_TMP_PREFIX = ".fs-write-"
"""A write goes to ``WRITE_TMP_PREFIX`` + 16 hex digits in the target's directory, renamed over
the target at its end; listings and watches do not show such a name (a write in progress)."""

ERROR_CODES: dict[str, int] = {
    "invalid_argument": 400,  # malformed query or body (missing field, wrong type, bad duration)
    "path_invalid": 400,  # empty, too long, control characters, '..'
    "path_outside_root": 403,  # absolute, but not under /app or /workspace
    "path_is_root": 403,  # /app or /workspace cannot be moved or removed
    "root_replaced": 403,  # /app or /workspace is no longer the directory it was at start
    "symlink_not_followed": 400,  # a directory on the way is a symbolic link
    "path_not_found": 404,
    "path_exists": 400,  # the destination exists (move without overwrite, mkdir over a file)
    "not_a_directory": 400,
    "is_a_directory": 400,
    "not_a_file": 400,  # read of a device, socket or FIFO
    "not_empty": 400,  # remove of a non-empty directory without recursive
    "cross_root": 400,  # move between /app and /workspace
    "file_too_large": 400,  # read over the runtime's cap
    "too_many_entries": 400,  # list or watch of a directory over the limit
    "permission_denied": 403,
    "not_supported": 400,  # this platform cannot do it safely (a no-replace directory move)
    "io_error": 500,
}

GET_ROUTES = frozenset({"/fs/read", "/fs/list", "/fs/exists", "/fs/info", "/fs/watch"})
POST_ROUTES = frozenset({"/fs/write", "/fs/mkdir", "/fs/move", "/fs/remove"})

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class FsError(Exception):
    """A refusal: ``code`` (one of :data:`ERROR_CODES`) and a detail naming the path and rule."""

    def __init__(self, code: str, detail: str, path: str | None = None) -> None:
        super().__init__(detail)
        self.status = ERROR_CODES[code]
        self.code = code
        self.detail = detail
        self.path = path

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"detail": self.detail, "code": self.code}
        if self.path is not None:
            out["path"] = self.path
        return out


# -- paths ---------------------------------------------------------------------------------------
def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class Roots:
    """The host directories of ``/app`` (``base_dir``) and ``/workspace`` (``workspace``, else
    ``SANDBOX_WORKSPACE_DIR``, else ``<base dir>/workspace``; made if missing), as they are
    now: each is kept open (so that its identity cannot pass to another directory), and
    :meth:`open` refuses a root whose path no longer leads to that very directory."""

    def __init__(self, base_dir: str, workspace: str | None = None) -> None:
        workspace = (
            workspace or os.environ.get(WORKSPACE_ENV) or os.path.join(base_dir, "workspace")
        )
        self.paths = {"/app": os.path.realpath(base_dir), "/workspace": os.path.realpath(workspace)}
        os.makedirs(self.paths["/workspace"], exist_ok=True)
        self._held: dict[str, int] = {}
        self._idents: dict[str, tuple[int, int]] = {}
        for root, path in self.paths.items():
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._held[root] = fd
            self._idents[root] = _ident(fd)

    def open(self, root: str, given: str | None = None) -> int:
        """A new descriptor of ``root`` (``"/app"`` or ``"/workspace"``); FsError
        ``root_replaced`` when its path is no longer the directory it was."""
        try:
            fd = os.open(self.paths[root], _DIR_FLAGS)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise
            raise self._replaced(root, self._what_is_there(root), given) from None
        if _ident(fd) != self._idents[root]:
            os.close(fd)
            raise self._replaced(root, "another directory is in its place", given)
        return fd

    @classmethod
    def of(cls, base_dir: str) -> Roots:
        """The roots of ``base_dir`` in this process: made (and so recorded) on the first call,
        the same object after (the runtime makes them at its start)."""
        key = os.path.realpath(base_dir)
        roots = _SHARED_ROOTS.get(key)
        if roots is None:
            roots = _SHARED_ROOTS[key] = cls(key)
        return roots

    def check(self, root: str, given: str | None = None) -> None:
        """FsError ``root_replaced`` when ``root`` is no longer the directory it was."""
        os.close(self.open(root, given))

    def close(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    def _what_is_there(self, root: str) -> str:
        try:
            mode = os.lstat(self.paths[root]).st_mode
        except FileNotFoundError:
            return "it was removed"
        except OSError:
            return "its path no longer leads to it"
        return "it is now a symbolic link" if stat.S_ISLNK(mode) else "it is now a file"

    @staticmethod
    def _replaced(root: str, why: str, given: str | None) -> FsError:
        return FsError(
            "root_replaced",
            f"{root} is no longer the directory it was when the sandbox started ({why}); the "
            "file API never follows a replaced root. Leave the directory in place (empty it "
            "instead of removing it) or use a new sandbox",
            given,
        )


_SHARED_ROOTS: dict[str, Roots] = {}


@dataclass(frozen=True)
class Target:
    """A checked path: its root (``"/app"`` or ``"/workspace"``) and components below it."""

    given: str
    root: str
    roots: Roots = field(compare=False, repr=False)
    parts: tuple[str, ...]

    @property
    def display(self) -> str:
        """The canonical sandbox path (``/workspace/...`` also for the ``/app/workspace`` alias)."""
        return "/".join((self.root, *self.parts))

    @property
    def is_root(self) -> bool:
        return not self.parts

    @property
    def root_dir(self) -> str:
        """The root's host path (as it was at start: a path, not checked; the file operations
        open the root through :meth:`Roots.open`)."""
        return self.roots.paths[self.root]

    def child(self, name: str) -> Target:
        return Target(self.given, self.root, self.roots, (*self.parts, name))


def check_path(raw: Any, roots: Roots | str, field: str = "path") -> Target:
    """``raw`` checked against the path rules (see the module docstring); raises FsError.
    ``roots``: the roots, or the base directory (its :meth:`Roots.of`)."""
    if isinstance(roots, str):
        roots = Roots.of(roots)
    if not isinstance(raw, str):
        raise FsError("invalid_argument", f"field {field!r} must be a string path")
    shown = raw if len(raw) <= 200 else raw[:200] + "..."
    if not raw:
        raise FsError(
            "path_invalid",
            f"{field} is empty: give /app/..., /workspace/... or a relative path",
            raw,
        )
    if len(raw) > MAX_PATH_CHARS:
        raise FsError(
            "path_invalid",
            f"{field} {shown!r} is {len(raw)} characters long; at most {MAX_PATH_CHARS}",
            shown,
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in raw):
        raise FsError(
            "path_invalid", f"{field} {raw!r} contains control characters, which are refused", raw
        )
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise FsError(
            "path_invalid", f"{field} {raw!r} is not valid Unicode (a lone surrogate)", shown
        ) from None
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FsError(
            "path_invalid",
            f"{field} {raw!r} contains '..'; give the path without parent references",
            raw,
        )
    root = "/app"
    if raw.startswith("/"):
        if not parts or parts[0] not in ("app", "workspace"):
            raise FsError(
                "path_outside_root",
                f"{field} {raw!r} is outside the sandbox's roots: absolute paths must be under "
                "/app or /workspace (relative paths are relative to /app)",
                raw,
            )
        root = "/" + parts.pop(0)
    if root == "/app" and parts[:1] == ["workspace"]:  # /app/workspace is an alias
        root = "/workspace"
        parts.pop(0)
    return Target(raw, root, roots, tuple(parts))


def _refusal(exc: OSError, target: Target, what: str = "") -> FsError:
    """An OSError on ``target`` as the refusal it means."""
    shown = what or target.display
    code = {
        errno.ENOENT: "path_not_found",
        errno.ENOTDIR: "not_a_directory",
        errno.EISDIR: "is_a_directory",
        errno.EEXIST: "path_exists",
        errno.ENOTEMPTY: "not_empty",
        errno.ELOOP: "symlink_not_followed",
        errno.EACCES: "permission_denied",
        errno.EPERM: "permission_denied",
        errno.ENAMETOOLONG: "path_invalid",
    }.get(exc.errno or 0, "io_error")
    reason = {
        "path_not_found": "does not exist",
        "not_a_directory": "is not a directory (or a directory on its way is a file)",
        "is_a_directory": "is a directory",
        "path_exists": "already exists",
        "not_empty": "is a directory that is not empty",
        "symlink_not_followed": "is a symbolic link, which file operations never follow",
        "permission_denied": "is not accessible to the runtime (permission denied)",
        "path_invalid": "has a component longer than the file system allows",
    }.get(code, f"failed: {exc.strerror or exc}")
    return FsError(code, f"{shown} {reason}", target.given)


def _open_dir(target: Target, parts: tuple[str, ...], *, create: bool = False) -> int:
    """A descriptor of the directory ``parts`` below ``target``'s root, never through a link."""
    fd = target.roots.open(target.root, target.given)
    walked = target.root
    try:
        for name in parts:
            walked += "/" + name
            try:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, dir_fd=fd)
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    with contextlib.suppress(OSError):
                        if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                            exc = OSError(errno.ELOOP, "symbolic link")
                raise _refusal(exc, target, walked) from None
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _parent(target: Target, *, create: bool = False) -> Iterator[int]:
    """The parent directory of ``target`` (``target`` is not a root)."""
    fd = _open_dir(target, target.parts[:-1], create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def file_info(st: os.stat_result, name: str, path: str, link: str | None = None) -> dict[str, Any]:
    """A FileInfo from ``lstat`` results."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        kind = "file"
    elif stat.S_ISDIR(mode):
        kind = "directory"
    elif stat.S_ISLNK(mode):
        kind = "symlink"
    else:
        kind = "other"
    info: dict[str, Any] = {
        "name": name,
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mod_time": st.st_mtime,
        "modified_ns": st.st_mtime_ns,
        "permissions": stat.S_IMODE(mode),
    }
    if link is not None:
        info["symlink_target"] = link
    return info


def _entry_info(name: str, dir_fd: int, path: str) -> dict[str, Any] | None:
    st = _lstat(name, dir_fd)
    if st is None:
        return None
    link = None
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            link = os.readlink(name, dir_fd=dir_fd)
    return file_info(st, name, path, link)


def info_of(target: Target) -> dict[str, Any]:
    """``target``'s FileInfo (a link is described, not followed); FsError when missing."""
    if target.is_root:
        fd = target.roots.open(target.root, target.given)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return file_info(st, target.root.lstrip("/"), target.root)
    with _parent(target) as fd:
        info = _entry_info(target.parts[-1], fd, target.display)
    if info is None:
        raise FsError("path_not_found", f"{target.display} does not exist", target.given)
    return info


def _is_write_in_progress(name: str) -> bool:
    tail = name[len(WRITE_TMP_PREFIX) :]
    return (
        name.startswith(WRITE_TMP_PREFIX)
        and len(tail) == 16
        and all(c in "0123456789abcdef" for c in tail)
    )


def _children(fd: int, target: Target, limit: int) -> dict[str, dict[str, Any]]:
    """The direct children of the directory open at ``fd`` (refused beyond ``limit``)."""
    out: dict[str, dict[str, Any]] = {}
    with os.scandir(fd) as it:
        for entry in it:
            if len(out) >= limit:
                raise FsError(
                    "too_many_entries",
                    f"{target.display} has more than {limit} entries, the limit of this "
                    "operation; list a subdirectory or use a command",
                    target.given,
                )
            if _is_write_in_progress(entry.name):
                continue
            info = _entry_info(entry.name, fd, f"{target.display}/{entry.name}")
            if info is not None:
                out[entry.name] = info
    return out


# -- operations ----------------------------------------------------------------------------------
def list_dir(target: Target) -> list[dict[str, Any]]:
    fd = _open_dir(target, target.parts)
    try:
        entries = _children(fd, target, MAX_LIST_ENTRIES)
    finally:
        os.close(fd)
    return [entries[name] for name in sorted(entries)]


def exists(target: Target) -> bool:
    try:
        info_of(target)
    except FsError as exc:
        if exc.code in ("path_not_found", "not_a_directory"):
            return False
        raise
    return True


def make_dir(target: Target) -> bool:
    if target.is_root:
        return False
    with _parent(target, create=True) as fd:
        try:
            os.mkdir(target.parts[-1], dir_fd=fd)
        except FileExistsError:
            st = _lstat(target.parts[-1], fd)
            if st is not None and stat.S_ISDIR(st.st_mode):
                return False
            raise FsError(
                "path_exists", f"{target.display} exists and is not a directory", target.given
            ) from None
        except OSError as exc:
            raise _refusal(exc, target) from None
    return True


def _no_root(target: Target, verb: str) -> None:
    if target.is_root:
        raise FsError("path_is_root", f"{target.root} is a root and cannot be {verb}", target.given)


def move(source: Target, destination: Target, overwrite: bool) -> dict[str, Any]:
    _no_root(source, "moved")
    _no_root(destination, "replaced")
    if source.root != destination.root:
        raise FsError(
            "cross_root",
            f"cannot move {source.display} to {destination.display}: a move stays within one "
            "root (/app or /workspace); copy the data instead",
            source.given,
        )
    with _parent(source) as src_fd, _parent(destination) as dst_fd:
        src_name, dst_name = source.parts[-1], destination.parts[-1]
        st = _lstat(src_name, src_fd)
        if st is None:
            raise FsError("path_not_found", f"{source.display} does not exist", source.given)
        inside = destination.parts[: len(source.parts)] == source.parts
        if stat.S_ISDIR(st.st_mode) and inside and destination.parts != source.parts:
            raise _into_itself(source, destination)
        try:
            if overwrite:
                os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            else:
                _rename_no_replace(src_fd, dst_fd, source, destination, stat.S_ISDIR(st.st_mode))
        except OSError as exc:
            if exc.errno == errno.EEXIST and not overwrite:
                raise FsError(
                    "path_exists",
                    f"{destination.display} already exists; a move never replaces it unless "
                    "overwrite is true",
                    destination.given,
                ) from None
            if exc.errno == errno.EINVAL:
                raise _into_itself(source, destination) from None
            raise _refusal(exc, destination) from None
        info = _entry_info(dst_name, dst_fd, destination.display)
    if info is None:  # pragma: no cover - removed by a command in between
        raise FsError("path_not_found", f"{destination.display} vanished after the move")
    return info


def _into_itself(source: Target, destination: Target) -> FsError:
    return FsError(
        "invalid_argument",
        f"cannot move {source.display} into itself ({destination.display})",
        source.given,
    )


_RenameFn = Callable[[int, str, int, str], None]
_no_replace: list[_RenameFn | None] = []  # [the platform's no-replace rename], once looked up


def _load_no_replace() -> _RenameFn | None:
    """``renameat2(..., RENAME_NOREPLACE)`` (Linux >= 3.15, glibc >= 2.28) or
    ``renameatx_np(..., RENAME_EXCL)`` (macOS >= 10.12) from the C library, if it has it."""
    if sys.platform.startswith("linux"):
        name, flag = "renameat2", 1  # RENAME_NOREPLACE
    elif sys.platform == "darwin":
        name, flag = "renameatx_np", 4  # RENAME_EXCL
    else:
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        func = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    func.restype = ctypes.c_int

    def rename(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
        if func(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), flag) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    return rename


def _platform_no_replace() -> _RenameFn | None:
    if not _no_replace:
        _no_replace.append(_load_no_replace())
    return _no_replace[0]


_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


def _rename_no_replace(
    src_fd: int, dst_fd: int, source: Target, destination: Target, is_dir: bool
) -> None:
    """Rename ``source`` to ``destination`` (their parents open at ``src_fd`` and ``dst_fd``)
    atomically unless the destination exists (OSError ``EEXIST`` then): the platform's
    no-replace rename, else, for anything but a directory, a hard link then the removal of the
    old name; FsError ``not_supported`` where neither can be done."""
    src, dst = source.parts[-1], destination.parts[-1]
    rename = _platform_no_replace()
    if rename is not None:
        try:
            rename(src_fd, src, dst_fd, dst)
            return
        except OSError as exc:  # EINVAL: the file system lacks the flag ("into itself" is not
            if exc.errno not in _UNSUPPORTED:  # possible here: move() refused it before)
                raise
    if is_dir:
        raise FsError(
            "not_supported",
            f"cannot move {source.display} without overwrite: this platform cannot move a "
            "directory without the risk of replacing a destination created meanwhile (no "
            "renameat2 with RENAME_NOREPLACE); pass overwrite=true to allow replacing, or move "
            "it with a command",
            source.given,
        )
    try:
        os.link(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, *_UNSUPPORTED):
            raise  # EEXIST: the destination exists, nothing changed
        raise FsError(
            "not_supported",
            f"cannot move {source.display} without overwrite: this platform has no no-replace "
            f"rename and this file system no hard links ({exc.strerror}); pass overwrite=true "
            "to allow replacing, or move it with a command",
            source.given,
        ) from None
    try:
        os.unlink(src, dir_fd=src_fd)
    except FileNotFoundError:
        pass  # removed meanwhile: the move happened
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(dst, dir_fd=dst_fd)  # undo: the source stays where it was
        raise


def remove(target: Target, recursive: bool) -> bool:
    _no_root(target, "removed")
    try:
        parent = _open_dir(target, target.parts[:-1])
    except FsError as exc:
        if exc.code in ("path_not_found", "not_a_directory"):
            return False
        raise
    try:
        name = target.parts[-1]
        st = _lstat(name, parent)
        if st is None:
            return False
        try:
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=parent)
            elif recursive:  # iterative and fd-based: any depth, never follows a link
                return _tree.remove_tree(parent, name)
            else:
                os.rmdir(name, dir_fd=parent)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY and recursive:
                raise FsError(
                    "not_empty",
                    f"{target.display} kept being filled while it was removed (a command is "
                    "writing in it); try again",
                    target.given,
                ) from None
            if exc.errno == errno.ENOTEMPTY:
                raise FsError(
                    "not_empty",
                    f"{target.display} is a directory that is not empty; pass recursive=true "
                    "to remove it with its contents",
                    target.given,
                ) from None
            raise _refusal(exc, target) from None
    finally:
        os.close(parent)
    return True


def _read_max() -> int:
    raw = os.environ.get(READ_MAX_ENV)
    return int(raw) if raw and raw.isdigit() else DEFAULT_READ_MAX_BYTES


def open_for_read(target: Target) -> tuple[int, int]:
    """An open descriptor of the regular file ``target`` and its size (checked against the cap)."""
    if target.is_root:
        raise FsError("is_a_directory", f"{target.display} is a directory", target.given)
    with _parent(target) as parent:
        try:  # O_NONBLOCK: opening a FIFO must not hang the request
            fd = os.open(
                target.parts[-1],
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=parent,
            )
        except OSError as exc:
            raise _refusal(exc, target) from None
    st = os.fstat(fd)
    problem: FsError | None = None
    if stat.S_ISDIR(st.st_mode):
        problem = FsError("is_a_directory", f"{target.display} is a directory", target.given)
    elif not stat.S_ISREG(st.st_mode):
        problem = FsError(
            "not_a_file", f"{target.display} is not a regular file (device, socket or FIFO)"
        )
    elif st.st_size > _read_max():
        problem = FsError(
            "file_too_large",
            f"{target.display} is {st.st_size} bytes, over this runtime's read limit of "
            f"{_read_max()} bytes ({READ_MAX_ENV}); use GET /download/... or a command",
            target.given,
        )
    if problem is not None:
        os.close(fd)
        raise problem
    return fd, st.st_size


# -- HTTP ----------------------------------------------------------------------------------------
def handle(handler: _Handler, route: str) -> None:
    """Serve ``route`` (in GET_ROUTES or POST_ROUTES) for ``handler``'s request."""
    if route == "/fs/write":  # the body is streamed to disk
        _write(handler)
        return
    try:
        if handler.command == "POST":
            try:
                body = handler._read_json()
            except (ValueError, ConnectionError) as exc:
                handler.close_connection = True
                raise FsError(
                    "invalid_argument", f"the body must be a JSON object: {exc}"
                ) from None
            if not isinstance(body, dict):
                raise FsError("invalid_argument", "the body must be a JSON object")
            _POST[route](handler, body)
        else:
            _GET[route](handler, _query(handler))
    except FsError as exc:
        _send_error(handler, exc)
    except (BrokenPipeError, ConnectionResetError):
        handler.close_connection = True  # the client went away
    except OSError as exc:  # an unexpected file-system failure: still a JSON answer
        handler.close_connection = True
        _send_error(handler, FsError("io_error", f"{route} failed: {exc.strerror or exc}"))


def _send_error(handler: _Handler, exc: FsError) -> None:
    data = json.dumps(exc.body()).encode()
    handler.send_response(exc.status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    if handler.close_connection:
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(data)


def _query(handler: _Handler) -> dict[str, str]:
    raw = urllib.parse.urlsplit(handler.path).query
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise FsError("path_invalid", "the query is not valid UTF-8 after URL decoding") from None
    out: dict[str, str] = {}
    for key, value in pairs:
        if key in out:
            raise FsError("invalid_argument", f"query parameter {key!r} is given twice")
        out[key] = value
    return out


def _target(handler: _Handler, args: dict[str, Any], field: str = "path") -> Target:
    if field not in args:
        raise FsError("invalid_argument", f"{field!r} is required")
    return check_path(args[field], handler.fs_roots, field)


def _flag(args: dict[str, Any], name: str) -> bool:
    value = args.get(name, False)
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("", "0", "false", "no"):
            return False
    elif isinstance(value, bool):
        return value
    raise FsError("invalid_argument", f"{name!r} must be a boolean (true or false), not {value!r}")


def _get_read(handler: _Handler, args: dict[str, str]) -> None:
    fd, size = open_for_read(_target(handler, args))
    with os.fdopen(fd, "rb", buffering=0) as fh:
        send_file(handler, fh, size)


def send_file(handler: _Handler, fh: BinaryIO, size: int) -> None:
    """Answer ``200`` with ``size`` bytes of ``fh``, streamed in chunks (also ``/download``)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/octet-stream")
    handler.send_header("Content-Length", str(size))
    handler.end_headers()
    remaining = size
    while remaining > 0:
        data = fh.read(min(CHUNK_SIZE, remaining))
        if not data:
            break
        handler.wfile.write(data)
        remaining -= len(data)
    if remaining:  # the file shrank while we sent it: the client sees a short body
        handler.close_connection = True


def _get_list(handler: _Handler, args: dict[str, str]) -> None:
    handler._send_json(200, list_dir(_target(handler, args)))


def _get_exists(handler: _Handler, args: dict[str, str]) -> None:
    handler._send_json(200, {"exists": exists(_target(handler, args))})


def _get_info(handler: _Handler, args: dict[str, str]) -> None:
    handler._send_json(200, info_of(_target(handler, args)))


def _post_mkdir(handler: _Handler, body: dict[str, Any]) -> None:
    handler._send_json(200, {"created": make_dir(_target(handler, body))})


def _post_move(handler: _Handler, body: dict[str, Any]) -> None:
    source = _target(handler, body, "source")
    destination = _target(handler, body, "destination")
    handler._send_json(200, move(source, destination, _flag(body, "overwrite")))


def _post_remove(handler: _Handler, body: dict[str, Any]) -> None:
    target = _target(handler, body)
    handler._send_json(200, {"removed": remove(target, _flag(body, "recursive"))})


# -- watch ---------------------------------------------------------------------------------------
def _scan(fd: int, target: Target, recursive: bool) -> dict[str, Any]:
    """Entries below the directory at ``fd`` keyed by their path relative to it (with
    ``recursive``, at any depth: an iterative walk)."""
    if not recursive:
        return _children(fd, target, MAX_LIST_ENTRIES)
    out: dict[str, Any] = {}

    def enter(dir_fd: int, parts: tuple[str, ...]) -> list[str]:
        below = "/".join(parts)
        here = target.child(below) if parts else target
        children = _children(dir_fd, here, MAX_WATCH_ENTRIES)
        prefix = below + "/" if parts else ""
        out.update((prefix + name, info) for name, info in children.items())
        if len(out) > MAX_WATCH_ENTRIES:
            raise FsError(
                "too_many_entries",
                f"{target.display} has more than {MAX_WATCH_ENTRIES} entries below it; "
                "watch a subdirectory or without recursive",
                target.given,
            )
        return [name for name, info in children.items() if info["type"] == "directory"]

    try:  # a subdirectory removed or replaced meanwhile is skipped: the next poll sees it
        _tree.walk(fd, enter, skip_errors=True)
    except _tree.TreeChangedError:
        raise FsError(
            "io_error",
            f"{target.display}: a directory below it was moved while it was read; watch again",
            target.given,
        ) from None
    return out


def _get_watch(handler: _Handler, args: dict[str, str]) -> None:
    target = _target(handler, args)
    recursive = _flag(args, "recursive")
    try:
        duration = float(args.get("duration", MAX_WATCH_SECONDS))
    except ValueError:
        duration = -1.0
    if not 0 < duration <= MAX_WATCH_SECONDS:
        raise FsError(
            "invalid_argument",
            f"duration must be a number of seconds, more than 0 and at most {MAX_WATCH_SECONDS:g}",
        )
    fd = _open_dir(target, target.parts)
    try:
        previous = _scan(fd, target, recursive)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/x-ndjson")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Cache-Control", "no-store")
        handler.end_headers()
        emit = _chunk_writer(handler)
        emit({"type": "snapshot", "path": target.display, "entries": previous})
        _watch_loop(fd, target, recursive, previous, time.monotonic() + duration, emit)
        handler.wfile.write(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        handler.close_connection = True  # the client went away
    finally:
        os.close(fd)


def _chunk_writer(handler: _Handler) -> Callable[[dict[str, Any]], None]:
    def emit(event: dict[str, Any]) -> None:
        line = json.dumps(event).encode() + b"\n"
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))

    return emit


def _watch_loop(
    fd: int,
    target: Target,
    recursive: bool,
    previous: dict[str, Any],
    deadline: float,
    emit: Callable[[dict[str, Any]], None],
) -> None:
    last_sent = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= deadline:
            return
        time.sleep(min(WATCH_POLL_SECONDS, deadline - now))
        try:
            target.roots.check(target.root, target.given)
        except FsError as exc:
            emit({"type": "error", "message": exc.detail})
            return
        if os.fstat(fd).st_nlink == 0:
            emit({"type": "error", "message": f"{target.display} was removed"})
            return
        try:
            current = _scan(fd, target, recursive)
        except FsError as exc:
            emit({"type": "error", "message": exc.detail})
            return
        for key in sorted(previous.keys() | current.keys()):
            old, new = previous.get(key), current.get(key)
            if old == new or _both_directories(old, new):
                continue  # a directory's own times change with its entries: not an event
            kind = "created" if old is None else "removed" if new is None else "modified"
            entry = new if new is not None else old
            emit({"type": kind, "path": f"{target.display}/{key}", "entry": entry})
            last_sent = time.monotonic()
        previous = current
        if time.monotonic() - last_sent >= WATCH_HEARTBEAT_SECONDS:
            emit({"type": "heartbeat"})
            last_sent = time.monotonic()


def _both_directories(old: dict[str, Any] | None, new: dict[str, Any] | None) -> bool:
    return bool(old and new and old["type"] == new["type"] == "directory")


# -- write ---------------------------------------------------------------------------------------
class _Write:
    """The state of one ``POST /fs/write``: the ``path`` field, then the ``file`` part."""

    def __init__(self, roots: Roots) -> None:
        self.roots = roots
        self.headers: dict[str, bytes] = {}
        self.field = b""
        self.value = b""
        self.part: str | None = None
        self.path_value = bytearray()
        self.target: Target | None = None
        self.parent: int | None = None
        self.tmp_name: str | None = None
        self.out: int | None = None
        self.result: dict[str, Any] | None = None

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def on_header_end(self) -> None:
        self.headers[self.field.decode("latin-1").lower()] = self.value
        self.field, self.value = b"", b""

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self.data(data[start:end])

    def begin_part(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, disp = parse_options_header(self.headers.get("content-disposition", b""))
        name = disp.get(b"name", b"").decode("utf-8", "replace")
        self.headers = {}
        if name == "path":
            if self.path_value:
                raise FsError("invalid_argument", "the 'path' field is given twice")
            self.part = "path"
        elif name == "file":
            if self.result is not None or self.out is not None:
                raise FsError("invalid_argument", "one 'file' part per request")
            if not self.path_value:
                raise FsError(
                    "invalid_argument",
                    "the 'path' field must come before the 'file' part (multipart order)",
                )
            self._open_destination()
            self.part = "file"
        else:
            self.part = None  # unknown parts are read and ignored

    def _open_destination(self) -> None:
        try:
            raw = self.path_value.decode("utf-8")
        except UnicodeDecodeError:
            raise FsError("path_invalid", "the 'path' field is not UTF-8") from None
        target = check_path(raw, self.roots)
        if target.is_root:
            raise FsError("is_a_directory", f"{target.display} is a directory", raw)
        self.target = target
        self.parent = _open_dir(target, target.parts[:-1], create=True)
        st = _lstat(target.parts[-1], self.parent)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise FsError("is_a_directory", f"{target.display} is a directory", raw)
        self.tmp_name = f"{WRITE_TMP_PREFIX}{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.out = os.open(self.tmp_name, flags, 0o666, dir_fd=self.parent)
        if st is not None and stat.S_ISREG(st.st_mode):  # a replaced file keeps its mode
            os.fchmod(self.out, stat.S_IMODE(st.st_mode))

    def data(self, data: bytes) -> None:
        if self.part == "path":
            self.path_value += data
            if len(self.path_value) > MAX_PATH_CHARS * 4:
                raise FsError("path_invalid", f"the 'path' field is over {MAX_PATH_CHARS} chars")
        elif self.part == "file" and self.out is not None:
            view = memoryview(data)
            while view:
                view = view[os.write(self.out, view) :]

    def end_part(self) -> None:
        if self.part == "file" and self.out is not None:
            assert self.target is not None and self.parent is not None and self.tmp_name
            os.close(self.out)
            self.out = None
            name = self.target.parts[-1]
            os.rename(self.tmp_name, name, src_dir_fd=self.parent, dst_dir_fd=self.parent)
            self.tmp_name = None
            self.result = _entry_info(name, self.parent, self.target.display)
        self.part = None

    def cleanup(self) -> None:
        if self.out is not None:
            os.close(self.out)
            self.out = None
        if self.tmp_name is not None and self.parent is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp_name, dir_fd=self.parent)
        if self.parent is not None:
            os.close(self.parent)
            self.parent = None


def _write(handler: _Handler) -> None:
    from python_multipart.multipart import MultipartParser, parse_options_header

    ctype, options = parse_options_header(handler.headers.get("Content-Type", ""))
    boundary = options.get(b"boundary")
    state = _Write(handler.fs_roots)
    failure: FsError | None = None
    if ctype != b"multipart/form-data" or not boundary:
        failure = FsError(
            "invalid_argument",
            "fs/write takes multipart/form-data with a 'path' field and a 'file' part",
        )

    parser = MultipartParser(
        boundary or b"-",
        {
            "on_header_field": state.on_header_field,
            "on_header_value": state.on_header_value,
            "on_header_end": state.on_header_end,
            "on_headers_finished": state.begin_part,
            "on_part_data": state.on_part_data,
            "on_part_end": state.end_part,
        },
    )
    try:
        for chunk in handler._body_chunks():
            if failure is not None:
                continue  # read the rest, so the client gets our answer, not a reset
            try:
                parser.write(chunk)
            except FsError as exc:
                failure = exc
            except OSError as exc:
                failure = (
                    _refusal(exc, state.target) if state.target else FsError("io_error", str(exc))
                )
            except ValueError as exc:
                failure = FsError("invalid_argument", f"malformed multipart body: {exc}")
        if failure is None:
            parser.finalize()
            if state.result is None:
                failure = FsError("invalid_argument", "the body has no 'file' part")
    except (ConnectionError, ValueError) as exc:
        failure = FsError("invalid_argument", f"the body ended early: {exc}")
        handler.close_connection = True
    finally:
        state.cleanup()
    if failure is not None:
        handler.close_connection = True
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # client may be gone
            _send_error(handler, failure)
        return
    handler._send_json(200, state.result)


_GET: dict[str, Callable[[_Handler, dict[str, str]], None]] = {
    "/fs/read": _get_read,
    "/fs/list": _get_list,
    "/fs/exists": _get_exists,
    "/fs/info": _get_info,
    "/fs/watch": _get_watch,
}
_POST: dict[str, Callable[[_Handler, dict[str, Any]], None]] = {
    "/fs/mkdir": _post_mkdir,
    "/fs/move": _post_move,
    "/fs/remove": _post_remove,
}
