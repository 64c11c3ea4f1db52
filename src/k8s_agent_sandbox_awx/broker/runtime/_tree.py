"""Walking and removing directory trees that a sandbox made: iteratively, relative to directory
descriptors, never through a symbolic link.

A command in a sandbox can make a tree of any depth (``mkdir d && cd d`` in a loop): deeper than
Python's recursion limit (``shutil.rmtree`` before Python 3.13 and any recursive walk raise
``RecursionError`` on it) and with paths longer than ``PATH_MAX`` (so no path string names its
deepest files). :func:`walk` goes down and up such a tree without recursion, by names relative
to the directory it is in, holding at most :data:`KEEP_OPEN` descriptors; it climbs back above
them through ``..``, checking that it arrives in the very directory it left.

Standard library only: the local runtime uses it too.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("k8s_agent_sandbox_awx.broker")

KEEP_OPEN = 64
"""Directory descriptors a walk keeps open (the top ones); deeper directories are re-entered
through ``..``."""
ATTEMPTS = 3
"""Walks :func:`remove_tree` makes before it gives up on a directory that keeps being filled."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Enter = Callable[[int, tuple[str, ...]], list[str]]
"""``enter(fd, parts)``: called once per directory (open at ``fd``, ``parts`` below the top);
returns the names of the subdirectories to walk into."""
Leave = Callable[[int, str], None]
"""``leave(fd, name)``: called once the subdirectory ``name`` of the directory open at ``fd``
has been walked."""


class TreeChangedError(OSError):
    """A directory of the tree was moved while the walk was below it: the walk cannot find its
    way back up (``..`` is no longer the directory it came from)."""


@dataclass
class _Frame:
    name: str
    parts: tuple[str, ...]
    fd: int | None
    pending: list[str]
    ident: tuple[int, int] | None = field(default=None)


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _open_subdir(fd: int, name: str, skip_errors: bool = False) -> int | None:
    """``name`` below ``fd`` opened as a directory, or ``None`` when it is no longer one (gone,
    or replaced by a file or a link meanwhile) or, with ``skip_errors``, cannot be opened."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if skip_errors or exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise


def _climb(fd: int, ident: tuple[int, int] | None) -> int:
    """The parent of the directory open at ``fd``, checked to be the one left (``ident``)."""
    parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
    if _ident(parent) != ident:
        os.close(parent)
        raise TreeChangedError(
            errno.ESTALE,
            "a directory of the tree was moved while it was walked; try again",
        )
    return parent


def walk(top: int, enter: Enter, leave: Leave | None = None, *, skip_errors: bool = False) -> None:
    """Walk the tree below the directory open at ``top`` depth first (see :data:`Enter` and
    :data:`Leave`), without recursion and without following a link. ``top`` stays open (it is
    the caller's). A subdirectory that is gone or no longer a directory when its turn comes is
    skipped (with ``skip_errors`` also one that cannot be opened, e.g. for its permissions).
    Raises what ``enter``/``leave`` raise, OSError, TreeChangedError."""
    stack = [_Frame("", (), top, enter(top, ())[::-1])]
    try:
        while stack:
            frame = stack[-1]
            assert frame.fd is not None
            if frame.pending:
                _descend(stack, frame, frame.fd, enter, skip_errors)
                continue
            stack.pop()
            if not stack:
                return
            parent = stack[-1]
            try:
                if parent.fd is None:
                    parent.fd = _climb(frame.fd, parent.ident)
            finally:
                os.close(frame.fd)
            if leave is not None:
                leave(parent.fd, frame.name)
    finally:
        for frame in stack[1:]:
            if frame.fd is not None:
                os.close(frame.fd)


def _descend(stack: list[_Frame], frame: _Frame, fd: int, enter: Enter, skip_errors: bool) -> None:
    name = frame.pending.pop()
    child = _open_subdir(fd, name, skip_errors)
    if child is None:
        return
    parts = (*frame.parts, name)
    try:
        pending = enter(child, parts)[::-1]
    except BaseException:
        os.close(child)
        raise
    if len(stack) >= KEEP_OPEN and len(stack) > 1:  # deep: re-entered through '..' later
        frame.ident = _ident(fd)
        os.close(fd)
        frame.fd = None
    stack.append(_Frame(name, parts, child, pending))


# -- removal -------------------------------------------------------------------------------------
def _clear(fd: int, parts: tuple[str, ...]) -> list[str]:
    """Unlink everything in the directory at ``fd`` but its subdirectories; return those."""
    with os.scandir(fd) as it:
        entries = list(it)
    subdirs: list[str] = []
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if is_dir:
            subdirs.append(entry.name)
            continue
        try:
            os.unlink(entry.name, dir_fd=fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:  # became a directory meanwhile
            subdirs.append(entry.name)
    return subdirs


def _rmdir(fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=fd)


def remove_tree(dir_fd: int, name: str) -> bool:
    """Remove ``name`` below the directory open at ``dir_fd``, and everything below it when it
    is a directory, at any depth; a link is removed, never followed. ``False`` when ``name``
    did not exist. Raises OSError (a directory that keeps being filled: ``ENOTEMPTY`` after
    :data:`ATTEMPTS` walks)."""
    for _ in range(ATTEMPTS):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                return False
            except IsADirectoryError:  # became a directory meanwhile
                continue
            return True
        fd = _open_subdir(dir_fd, name)
        if fd is None:
            continue  # replaced meanwhile: look again
        try:
            walk(fd, _clear, _rmdir)
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
            continue
        finally:
            os.close(fd)
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
            continue
        return True
    raise OSError(errno.ENOTEMPTY, f"{name} kept being filled while it was removed")


def remove_path(path: str) -> bool:
    """:func:`remove_tree` for a host path (its parent directories are the caller's own)."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return remove_tree(fd, name)
    finally:
        os.close(fd)


def remove_quietly(path: str, what: str) -> bool:
    """:func:`remove_path` for cleanup, which never raises: a failure is logged as a warning
    naming ``what`` and ``path``, and ``False`` returned."""
    try:
        remove_path(path)
    except OSError as exc:
        log.warning("could not remove %s %s: %s", what, path, exc)
        return False
    return True
