"""What the file API does to files: the operations behind ``/fs/*`` on checked sandbox paths.

Each operation takes :class:`._paths.SandboxPath` values (checked by :func:`._paths.check_path`)
and opens what they name through :func:`._paths.open_dir` (never through a symbolic link: an
operation on a link acts on the link itself). Refusals are :class:`._paths.FsError`. The HTTP
side (query and body parsing, answers) is :mod:`._file_api`; watching a directory is
:mod:`._watch`. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Callable
from typing import Any

from . import _tree
from ._paths import FsError, SandboxPath, lstat, open_dir, parent_of, refusal

READ_MAX_ENV = "SANDBOX_FS_READ_MAX_BYTES"
DEFAULT_READ_MAX_BYTES = 64 * 1024 * 1024
"""``GET /fs/read`` refuses larger files (as deployed runtimes do); ``/download/...`` has no cap."""
MAX_LIST_ENTRIES = 2000
WRITE_TMP_PREFIX = ".fs-write-"
"""A write goes to ``WRITE_TMP_PREFIX`` + 16 hex digits in the target's directory, renamed over
the target at its end; listings and watches do not show such a name (a write in progress)."""


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


def entry_info(name: str, dir_fd: int, path: str) -> dict[str, Any] | None:
    st = lstat(name, dir_fd)
    if st is None:
        return None
    link = None
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            link = os.readlink(name, dir_fd=dir_fd)
    return file_info(st, name, path, link)


def info_of(target: SandboxPath) -> dict[str, Any]:
    """``target``'s FileInfo (a link is described, not followed); FsError when missing."""
    if target.is_root:
        fd = target.roots.open(target.root, target.given)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return file_info(st, target.root.lstrip("/"), target.root)
    with parent_of(target) as fd:
        info = entry_info(target.parts[-1], fd, target.display)
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


def children(fd: int, target: SandboxPath, limit: int) -> dict[str, dict[str, Any]]:
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
            info = entry_info(entry.name, fd, f"{target.display}/{entry.name}")
            if info is not None:
                out[entry.name] = info
    return out


# -- operations ----------------------------------------------------------------------------------
def list_dir(target: SandboxPath) -> list[dict[str, Any]]:
    fd = open_dir(target, target.parts)
    try:
        entries = children(fd, target, MAX_LIST_ENTRIES)
    finally:
        os.close(fd)
    return [entries[name] for name in sorted(entries)]


def exists(target: SandboxPath) -> bool:
    try:
        info_of(target)
    except FsError as exc:
        if exc.code in ("path_not_found", "not_a_directory"):
            return False
        raise
    return True


def make_dir(target: SandboxPath) -> bool:
    if target.is_root:
        return False
    with parent_of(target, create=True) as fd:
        try:
            os.mkdir(target.parts[-1], dir_fd=fd)
        except FileExistsError:
            st = lstat(target.parts[-1], fd)
            if st is not None and stat.S_ISDIR(st.st_mode):
                return False
            raise FsError(
                "path_exists", f"{target.display} exists and is not a directory", target.given
            ) from None
        except OSError as exc:
            raise refusal(exc, target) from None
    return True


def _no_root(target: SandboxPath, verb: str) -> None:
    if target.is_root:
        raise FsError("path_is_root", f"{target.root} is a root and cannot be {verb}", target.given)


def move(source: SandboxPath, destination: SandboxPath, overwrite: bool) -> dict[str, Any]:
    _no_root(source, "moved")
    _no_root(destination, "replaced")
    if source.root != destination.root:
        raise FsError(
            "cross_root",
            f"cannot move {source.display} to {destination.display}: a move stays within one "
            "root (/app or /workspace); copy the data instead",
            source.given,
        )
    with parent_of(source) as src_fd, parent_of(destination) as dst_fd:
        src_name, dst_name = source.parts[-1], destination.parts[-1]
        st = lstat(src_name, src_fd)
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
            raise refusal(exc, destination) from None
        info = entry_info(dst_name, dst_fd, destination.display)
    if info is None:  # pragma: no cover - removed by a command in between
        raise FsError("path_not_found", f"{destination.display} vanished after the move")
    return info


def _into_itself(source: SandboxPath, destination: SandboxPath) -> FsError:
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
    src_fd: int, dst_fd: int, source: SandboxPath, destination: SandboxPath, is_dir: bool
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


def remove(target: SandboxPath, recursive: bool) -> bool:
    _no_root(target, "removed")
    try:
        parent = open_dir(target, target.parts[:-1])
    except FsError as exc:
        if exc.code in ("path_not_found", "not_a_directory"):
            return False
        raise
    try:
        name = target.parts[-1]
        st = lstat(name, parent)
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
            raise refusal(exc, target) from None
    finally:
        os.close(parent)
    return True


def _read_max() -> int:
    raw = os.environ.get(READ_MAX_ENV)
    return int(raw) if raw and raw.isdigit() else DEFAULT_READ_MAX_BYTES


def open_for_read(target: SandboxPath) -> tuple[int, int]:
    """An open descriptor of the regular file ``target`` and its size (checked against the cap)."""
    if target.is_root:
        raise FsError("is_a_directory", f"{target.display} is a directory", target.given)
    with parent_of(target) as parent:
        try:  # O_NONBLOCK: opening a FIFO must not hang the request
            fd = os.open(
                target.parts[-1],
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=parent,
            )
        except OSError as exc:
            raise refusal(exc, target) from None
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
