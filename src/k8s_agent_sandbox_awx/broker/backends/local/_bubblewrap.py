"""Isolated local sandboxes: each sandbox's runtime in namespaces of its own, with bubblewrap.

:func:`choose` decides a backend's isolation from ``isolation="auto"|"bwrap"|"none"`` (default:
``$AGENT_SANDBOX_LOCAL_ISOLATION``, else ``"auto"``): ``bwrap`` when the ``bwrap`` program
(Debian's ``bubblewrap`` package) is installed and works here (:func:`probe_bwrap`, run once per
process), else ``none``. :class:`Layout` makes the ``bwrap`` command line of one sandbox:

- a root of its own (a tmpfs, read-only once made) with every top-level entry of the host's
  root bound read-only (symbolic links such as ``/bin -> usr/bin`` made again), except
  ``/proc`` (a new one: the sandbox's PID namespace), ``/dev`` (a minimal one), ``/tmp`` and
  ``/run`` (each a private tmpfs), ``/app`` and ``/workspace`` (the sandbox's base and workspace
  directories, bound read-write at those very paths);
- the broker's own directories hidden (the temporary directory, the runtimes' root, the
  directories of the files its configuration names: a tmpfs over each, so that a sandbox sees
  neither the broker's key, tokens, configuration and audit log nor another sandbox's files;
  such a file in a directory the system shares, alone: :func:`hiding_of`), and what must stay
  visible under what is hidden bound again read-only (this interpreter and its packages;
  ``/etc/resolv.conf``'s target under ``/run``);
- the runtime's control directory (its Unix socket, a custom runtime's port file) bound at
  :data:`CONTROL_DIR`;
- new PID, IPC, UTS (hostname: the sandbox's name) and cgroup namespaces, a new session, every
  capability dropped, ``--die-with-parent``; a new network namespace (loopback only) when the
  sandbox's policy turns its network off, and then also the places where the host's Unix
  sockets live hidden (:func:`offline_dirs`).

Namespaces are not a virtual machine: see ``ISOLATION_TEXTS`` in ``testing._messages`` and
docs/local-broker.md ("Isolation") for what this does and does not protect against.
"""

from __future__ import annotations

import compileall
import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...runtime._process import PARENT_PID_ENV

__all__ = [
    "BWRAP_PACKAGE",
    "CONTROL_DIR",
    "ISOLATIONS",
    "ISOLATION_ENV",
    "Isolation",
    "IsolationUnavailable",
    "Layout",
    "Probe",
    "choose",
    "probe_bwrap",
]

ISOLATION_ENV = "AGENT_SANDBOX_LOCAL_ISOLATION"
"""The default of ``isolation`` (``LocalProcessLauncher``, ``LocalBroker``, ``dev``, ``demo``)."""
ISOLATIONS = ("auto", "bwrap", "none")
BWRAP_PACKAGE = "bubblewrap"
INSTALL_HINT = (
    f"install the {BWRAP_PACKAGE} package (Debian, Ubuntu: apt-get install {BWRAP_PACKAGE}; "
    f"Fedora: dnf install {BWRAP_PACKAGE})"
)
CONTROL_DIR = "/run/agent-sandbox"
"""Inside an isolated sandbox: the directory of its runtime's socket (and port file)."""
SOCKET_NAME = "runtime.sock"
PORT_FILE_NAME = "runtime.port"
SANDBOX_ROOTS = ("/app", "/workspace")
_PRIVATE = ("/tmp", "/run")  # noqa: S108 - paths inside a sandbox: a tmpfs of its own
_NEW = ("/proc", "/dev")
PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
"""The directory this package is imported from (an isolated runtime imports it from there)."""
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes, NUL included
_PROBE_SECONDS = 10.0


class IsolationUnavailable(Exception):
    """``isolation="bwrap"`` was asked for, and bubblewrap is missing or does not work here."""


@dataclass(frozen=True)
class Probe:
    """Whether ``bwrap`` works here: its path, and its version or why it does not work."""

    works: bool
    path: str | None
    detail: str


@dataclass(frozen=True)
class Isolation:
    """The isolation a backend's sandboxes run with: ``mode`` ``"bwrap"`` or ``"none"``,
    ``requested`` (``"auto"``, ``"bwrap"`` or ``"none"``) and ``reason`` (bwrap's version, or
    why there is none)."""

    mode: str
    requested: str
    reason: str
    bwrap: str | None = None

    def describe(self) -> str:
        """One line for people: the mode and why (what ``dev``, ``demo`` and ``doctor`` say)."""
        if self.mode == "bwrap":
            return f"bwrap ({self.reason}): each sandbox in namespaces of its own"
        return f"none ({self.reason}): sandboxes are host processes"


_probe_lock = threading.Lock()
_probe: Probe | None = None


def probe_bwrap() -> Probe:
    """Whether ``bwrap`` is installed and can make a sandbox as :class:`Layout` makes them (run
    once per process, then cached): a container that forbids user namespaces, a kernel without
    them or a too old bubblewrap does not work, and the detail says why."""
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = _run_probe()
        return _probe


def forget_probe() -> None:
    """Forget the cached probe (the next :func:`probe_bwrap` runs it again)."""
    global _probe
    with _probe_lock:
        _probe = None


def _run_probe() -> Probe:
    path = shutil.which("bwrap")
    if path is None:
        return Probe(False, None, f"bwrap is not installed ({INSTALL_HINT})")
    version = _version(path)
    with tempfile.TemporaryDirectory(prefix="agent-sandbox-bwrap-probe-") as tmp:
        dirs = [os.path.join(tmp, d) for d in ("app", "workspace", "control")]
        for directory in dirs:
            os.mkdir(directory)
        true = shutil.which("true") or sys.executable
        argv = Layout(path, hidden=(tmp,)).argv(
            name="probe", dirs=(dirs[0], dirs[1], dirs[2]), network=False, command=[true]
        )
        try:
            done = subprocess.run(argv, capture_output=True, timeout=_PROBE_SECONDS, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Probe(False, path, f"{path} ({version}) could not be run: {exc}")
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        why = said[-1] if said else f"exit status {done.returncode}"
        return Probe(
            False,
            path,
            f"{path} ({version}) is installed but cannot make a sandbox here: {why} (a "
            "container that forbids user namespaces, or a bubblewrap older than 0.5)",
        )
    return Probe(True, path, f"{version} at {path}")


def _version(path: str) -> str:
    try:
        done = subprocess.run(
            [path, "--version"], capture_output=True, timeout=_PROBE_SECONDS, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "version unknown"
    return done.stdout.decode("utf-8", "replace").strip() or "version unknown"


def choose(isolation: str | None) -> Isolation:
    """The isolation for ``isolation`` (``None``: ``$AGENT_SANDBOX_LOCAL_ISOLATION``, else
    ``"auto"``). ValueError for another value; IsolationUnavailable for ``"bwrap"`` without a
    working bwrap."""
    source = "isolation"
    if isolation is None:
        isolation = os.environ.get(ISOLATION_ENV) or "auto"
        source = ISOLATION_ENV if os.environ.get(ISOLATION_ENV) else source
    if isolation not in ISOLATIONS:
        raise ValueError(
            f"{source}={isolation!r} is not an isolation of local sandboxes: give "
            f"{' or '.join(repr(i) for i in ISOLATIONS)} (auto: bubblewrap when it works here, "
            "else none)"
        )
    if isolation == "none":
        return Isolation("none", isolation, f"{source}='none' was asked for")
    probe = probe_bwrap()
    if probe.works:
        return Isolation("bwrap", isolation, probe.detail, probe.path)
    if isolation == "bwrap":
        raise IsolationUnavailable(
            f"{source}='bwrap' needs bubblewrap: {probe.detail}. Install it, or give "
            "isolation='auto' (bubblewrap when it works, else none) or 'none'"
        )
    return Isolation("none", isolation, probe.detail)


class Layout:
    """The ``bwrap`` command lines of one backend's sandboxes. ``hidden``: directories of the
    broker a sandbox must not see (a tmpfs over each); ``secrets``: files of the broker's (its
    configuration's, see :func:`hiding_of`: the directory of each is hidden, or the file alone
    in a directory the system shares). The host's top-level entries are read once, here, and
    the runtime's modules compiled (inside, the package is read-only: without its ``.pyc``
    files each start would compile it again). A sandbox without network also has the places
    where the host's Unix sockets live hidden (:func:`offline_dirs`)."""

    def __init__(
        self, bwrap: str, *, hidden: Iterable[str] = (), secrets: Iterable[str] = ()
    ) -> None:
        self.bwrap = bwrap
        _compile_runtime()
        secret_dirs, self._covered = hiding_of(secrets)
        self._own = _real_dirs((*hidden, *secret_dirs))
        secret = _real_dirs((*self._own, tempfile.gettempdir()))
        masked = [*_PRIVATE, *(d for d in secret if not _under(d, _PRIVATE))]
        offline = [*masked, *(d for d in _real_dirs(offline_dirs()) if not _under(d, masked))]
        self._masked, self._offline_masked = masked, offline
        self._kept, self._offline_kept = _kept(masked, secret), _kept(offline, secret)
        root = _root_args()
        self._base = [*root, *_private_args(masked), *_ro_binds(self._kept)]
        self._offline = [*root, *_private_args(offline), *_ro_binds(self._offline_kept)]

    @property
    def hidden(self) -> list[str]:
        """What every sandbox of this layout has hidden (for people): directories, then files."""
        return [*self._masked, *self._covered]

    def argv(
        self,
        *,
        name: str,
        dirs: tuple[str, str, str],
        network: bool,
        command: Sequence[str],
    ) -> list[str]:
        """``command`` in a sandbox named ``name`` whose ``/app``, ``/workspace`` and
        :data:`CONTROL_DIR` are the host directories ``dirs``; ``network``: the host's network
        namespace, else one of its own (loopback only)."""
        base_dir, workspace_dir, control_dir = dirs
        masked = self._masked if network else self._offline_masked
        kept = self._kept if network else self._offline_kept
        return [
            self.bwrap,
            *(self._base if network else self._offline),
            *_cover_args(self._covered, masked),
            *("--bind", base_dir, "/app", "--bind", workspace_dir, "/workspace"),
            *("--bind", control_dir, CONTROL_DIR, "--chdir", "/app"),
            *("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"),
            *(() if network else ("--unshare-net",)),
            *("--hostname", name, "--die-with-parent", "--new-session", "--cap-drop", "ALL"),
            *("--unsetenv", PARENT_PID_ENV),  # its parent inside is the namespace's init
            *named_files(command, masked, kept, self._own),
            *("--remount-ro", "/", "--"),
            *command,
        ]


def _compile_runtime() -> None:
    """Write the ``.pyc`` files of the runtime's modules where they are missing or stale (where
    the package's directory is writable; an installed package has them already)."""
    package = os.path.join(PACKAGE_PARENT, "k8s_agent_sandbox_awx")
    with contextlib.suppress(OSError):
        compileall.compile_dir(os.path.join(package, "broker", "runtime"), quiet=2)
        for init in ("__init__.py", os.path.join("broker", "__init__.py")):
            compileall.compile_file(os.path.join(package, init), quiet=2)


def control_paths(control_dir: str) -> tuple[str, str]:
    """The host paths of a sandbox's runtime socket and port file (in ``control_dir``)."""
    return os.path.join(control_dir, SOCKET_NAME), os.path.join(control_dir, PORT_FILE_NAME)


def socket_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a Unix socket's path (too long), or ``None``."""
    size = len(os.fsencode(path))
    if size <= _UNIX_PATH_MAX:
        return None
    return (
        f"the runtime's socket path {path!r} is {size} bytes long, more than a Unix socket's "
        f"{_UNIX_PATH_MAX}: give LocalProcessLauncher a shorter root_dir (or set a shorter TMPDIR)"
    )


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _real_dirs(paths: Iterable[str]) -> list[str]:
    """The directories among ``paths``, as real paths, once each (``/`` left out)."""
    found: list[str] = []
    for path in paths:
        real = os.path.realpath(path)
        if os.path.isdir(real) and real != "/" and real not in found:
            found.append(real)
    return found


def _root_args() -> list[str]:
    """The host's top-level entries, read-only (links made again), but what is the sandbox's."""
    args: list[str] = []
    own = {*_NEW, *_PRIVATE, *SANDBOX_ROOTS}
    for entry in sorted(os.listdir("/")):
        path = "/" + entry
        if path in own:
            continue
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind", path, path]
    return args


def _shared(directory: str) -> bool:
    """Whether hiding ``directory`` would hide what sandboxes need of the host: ``/``, a
    top-level directory (``/etc``, ``/home``, ``/usr``, ...) or the user's home directory."""
    real = os.path.realpath(directory)
    home = os.path.realpath(os.path.expanduser("~"))
    return real == "/" or os.path.dirname(real) == "/" or real == home


def hiding_of(paths: Iterable[str]) -> tuple[list[str], list[str]]:
    """How to hide the broker's files ``paths`` from sandboxes: ``(directories, files)``. The
    directory that holds a file is hidden whole (a tmpfs: a file renamed into it later, as a
    rotation writes it, is hidden too), as given and as its links resolve, unless it is one the
    system shares (:func:`_shared`): there the file alone is hidden (an empty file bound over
    it, which a rename over that path would undo: keep the broker's files in a directory of
    their own). A directory in ``paths`` is hidden whole unless shared."""
    dirs: list[str] = []
    files: list[str] = []
    for path in paths:
        for seen in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
            folder = seen if os.path.isdir(seen) else os.path.dirname(seen)
            if not _shared(folder):
                dirs.append(folder)
            elif folder != seen:
                files.append(seen)
    return list(dict.fromkeys(dirs)), list(dict.fromkeys(files))


def offline_dirs() -> list[str]:
    """Where the host's Unix sockets live outside ``/run`` and ``/tmp`` (which a sandbox has
    of its own), hidden from a sandbox without network (its network namespace covers abstract
    sockets; a path socket is reached through the file system): the home directory, ``/home``,
    ``/root``, ``/var`` (``/var/tmp``, ``/var/lib``, ``/var/spool``, ``/var/snap``), ``/srv``,
    ``/mnt`` and ``/media``."""
    home = os.path.expanduser("~")
    return [home, "/home", "/root", "/var", "/srv", "/mnt", "/media"]


def _cover_args(files: Sequence[str], masked: Sequence[str]) -> list[str]:
    """An empty file bound over each of the broker's ``files`` that is still there (and not in
    a directory hidden already)."""
    args: list[str] = []
    for path in files:
        if os.path.isfile(path) and not os.path.islink(path) and not _under(path, masked):
            args += ["--ro-bind", os.devnull, path]
    return args


def _private_args(masked: Sequence[str]) -> list[str]:
    args = ["--dev", "/dev", "--proc", "/proc"]
    for path in masked:
        args += ["--tmpfs", path]
    return args


def import_paths() -> list[str]:
    """Where the built-in runtime imports this package and the one third-party module it uses
    from (found, not imported): an isolated runtime (``python -I``, which reads no
    ``PYTHONPATH``) puts them on its import path itself."""
    paths = [PACKAGE_PARENT]
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("python_multipart")
        if spec is not None and spec.origin:
            paths.append(os.path.dirname(os.path.dirname(spec.origin)))
    return paths


def _runtime_paths() -> list[str]:
    """What the built-in runtime imports from: this interpreter, this package, the one
    third-party module it uses."""
    interpreter = [sys.prefix, sys.base_prefix, sys.exec_prefix]
    return [*interpreter, os.path.dirname(os.path.realpath(sys.executable)), *import_paths()]


def named_files(
    command: Sequence[str], masked: Sequence[str], kept: Sequence[str], own: Sequence[str]
) -> list[str]:
    """Read-only binds of the files a runtime's command names by absolute path (a template's
    ``python /tmp/x/runtime.py``: the template is the operator's) where a private directory
    would hide them (``/tmp``): the host is readable inside, and a command must see what it
    names; never a directory (only the file), never one in the broker's own directories
    (``own``: its key, its CA, other sandboxes). ``kept``: what stays visible below the hidden
    directories (:func:`_kept`). A named path that is hidden gets the file it leads to bound
    there; a named path that is seen but links to a hidden file (a venv's ``python`` whose
    interpreter is under a hidden home) gets that file bound where the link leads, never over
    the link itself (it may lie in a read-only bind: a venv kept under ``/tmp``)."""
    args: list[str] = []
    for arg in command:
        if not arg.startswith("/") or not os.path.isfile(arg):
            continue
        real = os.path.realpath(arg)
        if _under(real, own):
            continue
        path = os.path.abspath(arg)
        if _under(path, masked) and not _under(path, kept):
            args += ["--ro-bind-try", real, path]
        elif real != path and _under(real, masked) and not _under(real, kept):
            args += ["--ro-bind-try", real, real]
    return args


def _kept(masked: Sequence[str], secret: Sequence[str]) -> list[str]:
    """What must stay visible below a hidden directory (real paths): what the runtime imports
    (:func:`_runtime_paths`), the resolver's configuration; never one that holds (or is) a
    directory that must stay hidden (``/tmp`` itself, the broker's own)."""
    wanted = [*_runtime_paths(), os.path.realpath("/etc/resolv.conf")]
    keep: list[str] = []
    for path in wanted:
        real = os.path.realpath(path) if path else ""
        if not real or real in keep or not os.path.exists(real) or not _under(real, masked):
            continue
        if not any(_under(hidden, (real,)) for hidden in (*masked, *secret)):
            keep.append(real)
    return keep


def _ro_binds(paths: Sequence[str]) -> list[str]:
    """A read-only bind of each of ``paths`` at its own place."""
    args: list[str] = []
    for path in paths:
        args += ["--ro-bind-try", path, path]
    return args
