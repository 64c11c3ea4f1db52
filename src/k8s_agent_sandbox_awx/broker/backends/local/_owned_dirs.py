"""Temporary directories a broker process owns for its whole life (the runtimes' root, the
local broker's files), and the sweep that removes those of owners that died (a crashed test,
``kill -9``): an owner holds a ``flock`` on the directory's :data:`OWNER_FILE`, which the kernel
lets go of however the process ends.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile

from ...runtime import _tree

log = logging.getLogger("k8s_agent_sandbox_awx.broker")

RUNTIMES_DIR_PREFIX = "agent-sandbox-runtimes-"
OWNER_FILE = "broker.pid"

_OWNER_LOCKS: dict[str, int] = {}
"""Owned directory -> the open file descriptor of its :data:`OWNER_FILE`, on which this process
holds an exclusive ``flock`` for as long as it owns the directory (the kernel lets go of it when
the process dies, however it dies)."""


def owned_temp_dir(prefix: str) -> str:
    """A new private temporary directory owned by this process until
    :func:`release_owned_dir`: its :data:`OWNER_FILE` (this pid, for people) is locked
    (``flock``) for the owner's whole life, so :func:`sweep_dead_owners` of any process, in any
    PID namespace, leaves it alone."""
    path = tempfile.mkdtemp(prefix=prefix)
    staged = os.path.join(path, f".{OWNER_FILE}")
    fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
        os.write(fd, str(os.getpid()).encode())
        os.rename(staged, os.path.join(path, OWNER_FILE))  # it appears locked: no window
    except BaseException:
        os.close(fd)
        raise
    _OWNER_LOCKS[path] = fd
    return path


def release_owned_dir(path: str) -> None:
    """Let go of ``path`` (from :func:`owned_temp_dir`) once it is removed, or left for a sweep
    (idempotent)."""
    fd = _OWNER_LOCKS.pop(path, None)
    if fd is not None:
        os.close(fd)


def sweep_dead_owners(*prefixes: str) -> None:
    """Remove this user's temporary directories with one of ``prefixes`` whose owner process
    is gone (a crashed test, ``kill -9``): nothing else would ever remove them. Never raises
    (it runs as a broker starts): a leftover that cannot be removed is logged as a warning and
    left for the next start; trees of any depth are removed (see :mod:`..runtime._tree`)."""
    root = tempfile.gettempdir()
    try:
        entries = os.listdir(root)
    except OSError as exc:
        log.warning("could not look for dead brokers' leftovers in %s: %s", root, exc)
        return
    for entry in entries:
        if not entry.startswith(prefixes):
            continue
        path = os.path.join(root, entry)
        try:
            _sweep_if_dead(path)
        except Exception:  # a sweep never stops a broker from starting
            log.warning("could not sweep %s", path, exc_info=True)


def _sweep_if_dead(path: str) -> None:
    """Remove ``path`` if it is this user's and its owner is gone: nobody holds the lock on its
    :data:`OWNER_FILE` (the lock is held here while it is removed, so two sweeps never race)
    and, for a directory of an earlier version, which held no lock, the pid it names is not a
    process here. A directory without an owner file (one being made) is never removed."""
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if os.fstat(fd).st_uid != os.getuid() or os.stat(path).st_uid != os.getuid():
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # its owner lives (in this PID namespace or another)
        if _pid_lives(os.read(fd, 64)):
            return
        _tree.remove_quietly(path, "a dead broker's leftover directory")
    finally:
        os.close(fd)


def _pid_lives(recorded: bytes) -> bool:
    """Whether ``recorded`` names a process visible here (unreadable: taken as alive)."""
    try:
        os.kill(int(recorded.strip()), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True
    return True
