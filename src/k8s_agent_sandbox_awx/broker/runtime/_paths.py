"""Paths in a sandbox: its roots, the rules a path follows, and the one way to open what it names.

Every endpoint that takes a path (the file API ``/fs/*``, the legacy ``/download``, ``/list``,
``/exists`` and ``/upload``, a managed command's ``cwd``) resolves it here:

- :class:`Roots`: ``/app`` (the sandbox's base directory, where commands run) and ``/workspace``
  (its persistent area: ``SANDBOX_WORKSPACE_DIR``, default ``<base dir>/workspace``), as they
  were when the runtime started. Each is kept open, and a root that a command removed, moved or
  replaced (by a link or another directory) is refused (``root_replaced``), never followed.
- :func:`open_dirs`: the one walk. A directory is opened one component at a time, each relative
  to the last, with ``O_NOFOLLOW``: a symbolic link on the way is met, never followed, and there
  is no window between a check and the use.
- The file API's rule (:func:`check_path` -> :class:`SandboxPath`): ``/app/...``,
  ``/workspace/...`` (``/app/workspace`` is an alias of it) or relative to ``/app``; no ``..``,
  no control characters, at most :data:`MAX_PATH_CHARS` characters; a link is never followed
  (an operation on a link acts on the link itself). Refusals are :class:`FsError`.
- The legacy endpoints' rule (:func:`resolve_legacy`, upstream's python-runtime semantics): a
  path relative to the base directory, its symbolic links followed as long as they stay inside
  it (``403`` when it escapes). The resolved path is then walked as above, so a link swapped in
  after the resolution is met, never followed: the path is resolved again (at most
  :data:`ATTEMPTS` times, then ``409``). Refusals are :class:`Refusal`.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

WORKSPACE_ENV = "SANDBOX_WORKSPACE_DIR"
MAX_PATH_CHARS = 4096
ATTEMPTS = 5
"""Resolutions of one legacy path before a request gives up on a path that keeps changing."""
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

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
"""The file API's refusal codes and their HTTP statuses (docs/broker-api.md, "Files")."""

T = TypeVar("T")


class FsError(Exception):
    """A file API refusal: ``code`` (one of :data:`ERROR_CODES`) and a detail naming the path
    and the rule."""

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


class Refusal(Exception):
    """A legacy endpoint's refusal: ``status`` and ``detail`` (and ``code``, for
    ``root_replaced``), answered ``{"detail"}`` as upstream's runtime does."""

    def __init__(self, status: int, detail: str, code: str | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.code = code

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"detail": self.detail}
        if self.code is not None:
            out["code"] = self.code
        return out


# -- the roots -----------------------------------------------------------------------------------
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
            fd = os.open(self.paths[root], DIR_FLAGS)
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


# -- the one walk --------------------------------------------------------------------------------
Failed = Callable[[OSError, int, int], BaseException]
"""``failed(exc, dir_fd, index)``: what to raise when component ``index`` of a walk, below the
directory open at ``dir_fd``, could not be opened (``exc``)."""


def open_dirs(fd: int, parts: Sequence[str], failed: Failed, *, create: bool = False) -> int:
    """A new descriptor of the directory ``parts`` below the directory open at ``fd`` (which
    stays the caller's), never through a link: one component at a time, each relative to the
    last, with ``O_NOFOLLOW``; ``create``: missing directories are made. A component that cannot
    be made or opened raises ``failed(...)``."""
    current = os.dup(fd)
    try:
        for index, name in enumerate(parts):
            try:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, dir_fd=current)
                next_fd = os.open(name, DIR_FLAGS, dir_fd=current)
            except OSError as exc:
                raise failed(exc, current, index) from None
            os.close(current)
            current = next_fd
    except BaseException:
        os.close(current)
        raise
    return current


def kind(fd: int, name: str) -> str | None:
    """``"link"``, ``"directory"`` or ``"other"`` for ``name`` below ``fd`` now; ``None``:
    missing (or it cannot be looked at)."""
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        return None
    return "link" if stat.S_ISLNK(mode) else "directory" if stat.S_ISDIR(mode) else "other"


def lstat(name: str, dir_fd: int) -> os.stat_result | None:
    """``name``'s own status below ``dir_fd`` (a link's, not its target's); ``None``: missing."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


# -- the file API's rule -------------------------------------------------------------------------
@dataclass(frozen=True)
class SandboxPath:
    """A checked file API path: its root (``"/app"`` or ``"/workspace"``) and the components
    below it."""

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

    def child(self, name: str) -> SandboxPath:
        return SandboxPath(self.given, self.root, self.roots, (*self.parts, name))


def check_path(raw: Any, roots: Roots | str, field: str = "path") -> SandboxPath:
    """``raw`` checked against the file API's path rules (see the module docstring); raises
    FsError. ``roots``: the roots, or the base directory (its :meth:`Roots.of`)."""
    if isinstance(roots, str):
        roots = Roots.of(roots)
    _check_text(raw, field)
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
    return SandboxPath(raw, root, roots, tuple(parts))


def _check_text(raw: Any, field: str) -> None:
    """FsError unless ``raw`` is a non-empty string of Unicode text, not too long, without
    control characters."""
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


READ_ONLY: Final = (
    "is on a read-only file system (a pod with readOnlyRootFilesystem writes only to its"
    " volumes: mount an emptyDir there)"
)
"""Why a write on a read-only file system is refused (the file API and the legacy endpoints)."""


def refusal(exc: OSError, target: SandboxPath, what: str = "") -> FsError:
    """An OSError on ``target`` as the file API refusal it means."""
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
        errno.EROFS: "permission_denied",  # a read-only root: the caller's to fix, not a fault
        errno.ENAMETOOLONG: "path_invalid",
    }.get(exc.errno or 0, "io_error")
    if exc.errno == errno.EROFS:
        return FsError(code, f"{shown} {READ_ONLY}", target.given)
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


def open_dir(target: SandboxPath, parts: tuple[str, ...], *, create: bool = False) -> int:
    """A descriptor of the directory ``parts`` below ``target``'s root, never through a link
    (FsError ``symlink_not_followed`` when one is on the way)."""

    def failed(exc: OSError, fd: int, index: int) -> FsError:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and kind(fd, parts[index]) == "link":
            exc = OSError(errno.ELOOP, "symbolic link")
        return refusal(exc, target, "/".join((target.root, *parts[: index + 1])))

    root = target.roots.open(target.root, target.given)
    try:
        return open_dirs(root, parts, failed, create=create)
    finally:
        os.close(root)


@contextlib.contextmanager
def parent_of(target: SandboxPath, *, create: bool = False) -> Iterator[int]:
    """The parent directory of ``target`` (``target`` is not a root), open while in use."""
    fd = open_dir(target, target.parts[:-1], create=create)
    try:
        yield fd
    finally:
        os.close(fd)


# -- the legacy endpoints' rule ------------------------------------------------------------------
class PathChanged(Exception):
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
        raise PathChanged() from None
    if full == base:
        return []
    if full is None or not full.startswith(base + os.sep):
        raise Refusal(403, f"path {relative!r} escapes the sandbox directory")
    return full[len(base) + 1 :].split(os.sep)


def open_legacy_dirs(base_fd: int, base: str, parts: list[str], *, create: bool = False) -> int:
    """:func:`open_dirs` for a resolved legacy path (``base``: the base directory's host path,
    open at ``base_fd``): PathChanged when a link is on the way, or the path changed."""

    def failed(exc: OSError, fd: int, index: int) -> BaseException:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            found = kind(fd, parts[index])
            if exc.errno == errno.ELOOP or found == "link":
                return PathChanged(os.path.join(base, *parts[: index + 1]))
            if found != "other":  # a directory, or gone, by now: it changed
                return PathChanged()
        elif exc.errno == errno.ENOENT and create:  # made, then removed before it was opened
            return PathChanged()
        return exc

    return open_dirs(base_fd, parts, failed, create=create)


def _loops(path: str) -> bool:
    """Whether the link at ``path`` does not resolve (a loop)."""
    try:
        os.path.realpath(path, strict=True)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def resolve_legacy(
    roots: Roots,
    relative: str,
    use: Callable[[int, list[str]], T],
    unresolvable: Callable[[], T],
) -> T:
    """``use(base_fd, parts)`` for ``relative`` resolved inside the base directory; resolved
    again when the path changed (``use`` met a link swapped in meanwhile: PathChanged);
    ``unresolvable()`` when the link it met does not resolve (a loop)."""
    base = roots.paths["/app"]
    for _ in range(ATTEMPTS):
        try:
            base_fd = roots.open("/app", relative)
        except FsError as exc:
            raise Refusal(exc.status, exc.detail, exc.code) from None
        try:
            return use(base_fd, _inside(base, relative))
        except PathChanged as changed:
            if changed.link is not None and _loops(changed.link):
                return unresolvable()
        finally:
            os.close(base_fd)
    raise Refusal(
        409,
        f"path {relative!r} kept changing while it was opened (a symbolic link on its way was "
        "replaced, again and again); try again",
    )
