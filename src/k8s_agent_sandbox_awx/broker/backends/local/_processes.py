"""The local backend's runtimes as host processes.

:class:`LocalProcessLauncher` (a :class:`~._launcher.RuntimeLauncher`) starts one process per
sandbox from a command line template, so any server that speaks the legacy python-runtime
protocol can be plugged in, under a supervisor that kills every process the sandbox started when
the runtime ends (see ``runtime._forkserver``; the broker's side of the fork server:
:mod:`._fork_server`; the runtimes' root directory: :mod:`._owned_dirs`).

NO ISOLATION: local runtimes and the commands they run are ordinary host processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ...runtime import _tree
from ...runtime._env import runtime_settings
from .._interface import RUNTIME_PORT
from . import _bubblewrap
from ._fork_server import ForkServer, inherited_environment
from ._launcher import RuntimeHandle, RuntimeStartError, SandboxSpec
from ._owned_dirs import RUNTIMES_DIR_PREFIX, owned_temp_dir, release_owned_dir

log = logging.getLogger("k8s_agent_sandbox_awx.broker")

DEFAULT_RUNTIME_COMMAND = (
    "{python} -m k8s_agent_sandbox_awx.broker.runtime "
    "--host {host} --port-file {port_file} --base-dir {base_dir}"
)
"""The default runtime command line. Placeholders: ``{python}`` (this interpreter), ``{host}``,
``{port_file}`` and ``{port}`` (see below), ``{base_dir}`` (the sandbox's own directory),
``{name}``, ``{namespace}``, ``{template}``. The environment also carries ``PORT``,
``SANDBOX_BASE_DIR``, ``SANDBOX_WORKSPACE_DIR`` (the sandbox's persistent area, ``/workspace`` of
the file API) and the sandbox's ``env``.

The port: a command that names ``{port_file}`` listens on a port the system picks (port 0) and
writes its number to that file once it listens (``PORT`` is then ``0`` and ``SANDBOX_PORT_FILE``
the file), so that no two runtimes can get the same port, however many start at once. A command
without it gets ``{port}``: a free loopback port the broker chose just before, which another
process can take before the runtime binds it (the start is then retried with another port)."""


_BOOT = (
    "import os, sys; sys.path[:0] = sys.argv.pop(1).split(os.pathsep); "
    "from k8s_agent_sandbox_awx.broker.runtime._main import main; sys.exit(main())"
)
"""The built-in runtime in an isolated sandbox: a new interpreter, isolated (``-I``: no
``PYTHON*`` variable, no user site, no working directory on its path), that imports this very
package and the one module it needs beyond the standard library from the directories this
broker found them in (its first argument), without changing the commands' environment."""


def _free_port(host: str) -> int:
    """A port free now (for a runtime command without ``{port_file}``): racy, see
    :data:`DEFAULT_RUNTIME_COMMAND`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class LocalProcessLauncher:
    """One runtime process per sandbox, on loopback, in its own process group and directory.

    ``command``: a command line template (string, split with shell-like rules, or a list) with
    the placeholders of :data:`DEFAULT_RUNTIME_COMMAND`. It runs without a shell. Runtimes get
    ``AGENT_SANDBOX_RUNTIME_PARENT_PID`` so the default runtime dies with its supervisor.

    Every runtime runs under a supervisor of its sandbox (Linux: a child subreaper) that kills
    every process the sandbox started when the runtime exits, is killed or is stopped, and the
    supervisors run under a fork server (see ``runtime._forkserver``).

    ``fork_server``: ``True`` (default where the platform can fork): one warm fork server for all
    sandboxes; the built-in runtime (the default command) is forked from it instead of starting
    a new interpreter (about 2 ms instead of 60 ms of CPU, memory shared copy-on-write), a custom
    command is exec'd from it. ``False``: a fresh fork server (a new interpreter) per sandbox,
    which starts the runtime command as a new process.

    ``hide``: files (or directories) of the broker's that sandboxes must not read (its
    configuration's, see ``_bubblewrap.hiding_of``), isolated sandboxes only.

    ``isolation``: ``"auto"`` (bubblewrap when it works here, else none), ``"bwrap"`` (each
    sandbox in namespaces of its own; IsolationUnavailable, naming the package to install, when
    bwrap is missing or does not work) or ``"none"`` (host processes); default
    ``$AGENT_SANDBOX_LOCAL_ISOLATION``, else ``"auto"`` (see ``_bubblewrap``). Isolated, a
    runtime is ``bwrap ... -- command`` exec'd by its supervisor (the built-in one is a new
    interpreter that listens on a Unix socket); ``isolation_info`` says which and why.
    """

    def __init__(
        self,
        command: str | Sequence[str] | None = None,
        *,
        root_dir: str | None = None,
        host: str = "127.0.0.1",
        startup_timeout: float = 20.0,
        fork_server: bool | None = None,
        isolation: str | None = None,
        hide: Sequence[str] = (),
    ) -> None:
        self.isolation_info = _bubblewrap.choose(isolation)  # first: may refuse
        self.command = command or DEFAULT_RUNTIME_COMMAND
        self.host = host
        self.startup_timeout = startup_timeout
        self._own_root = root_dir is None
        self.root_dir = root_dir or owned_temp_dir(RUNTIMES_DIR_PREFIX)
        os.makedirs(self.root_dir, exist_ok=True)
        bwrap = self.isolation_info.bwrap
        self._layout = (
            _bubblewrap.Layout(bwrap, hidden=(self.root_dir,), secrets=hide) if bwrap else None
        )
        if fork_server is None:
            fork_server = hasattr(os, "fork")
        self._fork: ForkServer | None = (
            ForkServer(os.path.join(self.root_dir, "fork-server.log")) if fork_server else None
        )
        self._own_forks: dict[str, ForkServer] = {}  # sandbox name -> its own fork server
        self._handles: dict[str, RuntimeHandle] = {}
        self._stopping: dict[str, asyncio.Future[None]] = {}
        self._http: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(  # readiness probes: never queue behind a pool limit
                timeout=httpx.Timeout(2.0),
                trust_env=False,
                follow_redirects=False,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            )
        return self._http

    def _argv(self, command: str | Sequence[str], values: Mapping[str, str]) -> list[str]:
        parts = shlex.split(command) if isinstance(command, str) else list(command)
        try:
            return [part.format_map(values) for part in parts]
        except (KeyError, IndexError, ValueError) as exc:
            raise RuntimeStartError(
                "InvalidRuntimeCommand",
                f"runtime command {command!r} has an unknown placeholder ({exc}); use "
                "{python} {host} {port} {port_file} {socket} {base_dir} {name} {namespace} "
                "{template}",
            ) from exc

    def _fork_server_of(self, name: str) -> ForkServer | None:
        return self._fork or self._own_forks.get(name)

    @property
    def isolation(self) -> str:
        """How this backend's sandboxes are isolated: ``"bwrap"`` or ``"none"``."""
        return self.isolation_info.mode

    def describe_isolation(self) -> str:
        """The isolation in force, for people: bubblewrap and what it hides from every sandbox,
        or host processes and why."""
        info = self.isolation_info
        if self._layout is None:
            return f"as host processes with NO isolation ({info.reason})"
        hidden = ", ".join(self._layout.hidden)
        return (
            f"in bubblewrap ({info.reason}): each in namespaces of its own, the host's files "
            f"read-only, these hidden: {hidden}"
        )

    async def start(self, spec: SandboxSpec) -> RuntimeHandle:
        root = os.path.join(self.root_dir, spec.name)
        plan = self._plan(spec, root)
        fork = self._fork or self._own_forks.setdefault(
            spec.name, ForkServer(os.path.join(root, "fork-server.log"))
        )
        last_error = ""
        try:
            for _attempt in range(3):
                handle = await self._spawn(spec, plan, fork)
                try:
                    await self._wait_ready(handle, plan)
                    return handle
                except RuntimeStartError as exc:
                    await self._terminate(handle, remove=False)
                    last_error = exc.message
                    if not plan.free_port or "Address already in use" not in last_error:
                        raise
            raise RuntimeStartError("RuntimeStartFailed", last_error)
        except BaseException:
            self._handles.pop(spec.name, None)
            await self._close_own_fork(spec.name)
            _tree.remove_quietly(root, f"the directory of sandbox {spec.name}")
            raise

    def _plan(self, spec: SandboxSpec, root: str) -> _Plan:
        """How ``spec``'s runtime starts and is reached; makes its directories. RuntimeStartError
        for what this backend cannot do (a network it cannot cut off, a socket path too long)."""
        command = spec.command or self.command
        isolated = self._layout is not None
        if not spec.network and not isolated:
            raise RuntimeStartError(
                "NetworkNotIsolated",
                f"the policy of sandbox {spec.name!r} turns its network off, which needs "
                f"isolated sandboxes (isolation here: {self.isolation_info.describe()}); "
                f"{_bubblewrap.INSTALL_HINT}, or give the policy network=True",
            )
        plan = _Plan(root, command, builtin=command == DEFAULT_RUNTIME_COMMAND)
        socket_path, port_file = _bubblewrap.control_paths(plan.control_dir)
        if (plan.builtin and isolated) or _names(command, "{socket}"):
            plan.uds = socket_path
        elif _names(command, "{port_file}"):  # the runtime picks its own port and reports it
            plan.port_file = port_file if isolated else os.path.join(root, "runtime.port")
        if plan.uds is None and not spec.network:
            raise RuntimeStartError(
                "NetworkNotIsolated",
                f"the policy of sandbox {spec.name!r} turns its network off, and its runtime "
                f"command {command!r} listens on a TCP port, which the broker cannot reach in a "
                "network of the sandbox's own: name {socket} in the command (the runtime listens "
                "on that Unix socket), or give the policy network=True",
            )
        problem = _bubblewrap.socket_path_problem(plan.uds) if plan.uds else None
        if problem:
            raise RuntimeStartError("RuntimeStartFailed", problem)
        for directory in (plan.base_dir, plan.workspace_dir, plan.control_dir):
            os.makedirs(directory, exist_ok=True)
        return plan

    async def _spawn(self, spec: SandboxSpec, plan: _Plan, fork: ForkServer) -> RuntimeHandle:
        """Have ``fork`` start ``spec``'s runtime as ``plan`` says; its handle (not ready yet)."""
        for stale in (plan.port_file, plan.uds, plan.pinned):
            if stale:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
        port = 0 if plan.port_file or plan.uds else _free_port(self.host)
        ident, pid = await fork.spawn(self._spawn_request(spec, plan, port))
        host = "localhost" if plan.uds else self.host
        port = RUNTIME_PORT if plan.uds else port
        handle = RuntimeHandle(
            spec.name, host, port, plan.base_dir, pid, root=plan.root, runtime_id=ident
        )
        self._handles[spec.name] = handle
        return handle

    def _spawn_request(self, spec: SandboxSpec, plan: _Plan, port: int) -> dict[str, Any]:
        """What the fork server is asked to start for ``spec`` (see ``runtime._forkserver``):
        the built-in runtime forked, or a command line exec'd (in bwrap, when isolated)."""
        inside = _Inside.of(plan) if self._layout is not None else _Inside.host(plan)
        env = {
            **inherited_environment(),
            **runtime_settings(spec.env),
            "PORT": str(port),
            "SANDBOX_BASE_DIR": inside.base_dir,
            "SANDBOX_WORKSPACE_DIR": inside.workspace_dir,
            **({"SANDBOX_PORT_FILE": inside.port_file} if inside.port_file else {}),
        }
        argv: list[str] | None = None
        if self._layout is not None:
            argv = self._layout.argv(
                name=spec.name,
                dirs=(plan.base_dir, plan.workspace_dir, plan.control_dir),
                network=spec.network,
                command=self._command_argv(spec, plan, inside, port),
            )
        elif not (plan.builtin and self._fork is not None):
            argv = self._command_argv(spec, plan, inside, port)
        return {
            "host": self.host,
            "port": port,
            "port_file": plan.port_file,
            "base_dir": plan.base_dir,
            "env": env,
            "log": plan.log,
            "argv": argv,
        }

    def _command_argv(
        self, spec: SandboxSpec, plan: _Plan, inside: _Inside, port: int
    ) -> list[str]:
        """The runtime's command line (paths as the runtime sees them)."""
        if plan.builtin and plan.uds:
            return [
                sys.executable,
                "-I",  # no PYTHON* variable, never the working directory (/app) on sys.path
                "-c",
                _BOOT,
                os.pathsep.join(_bubblewrap.import_paths()),
                "--unix-socket",
                inside.socket,
            ]
        values = {
            "python": sys.executable,
            "host": self.host,
            "port": str(port),
            "port_file": inside.port_file or "",
            "socket": inside.socket,
            "base_dir": inside.base_dir,
            "name": spec.name,
            "namespace": spec.namespace,
            "template": spec.template,
        }
        return self._argv(plan.command, values)

    def _exit_status(self, handle: RuntimeHandle) -> int | None:
        fork = self._fork_server_of(handle.name)
        if handle.runtime_id is None or fork is None:
            return -1
        return fork.status(handle.runtime_id)

    def _exit_reported(self, handle: RuntimeHandle) -> bool:
        fork = self._fork_server_of(handle.name)
        return fork is not None and handle.runtime_id in fork.exited

    async def _wait_ready(self, handle: RuntimeHandle, plan: _Plan) -> None:
        """Wait until the runtime answers ``GET /``: first, with a port file, until it has
        written the port it listens on (``handle.port`` is set from it); with a Unix socket,
        until its socket is there, which is then pinned (:func:`_pin_socket`: ``handle.uds``)."""
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.002
        port_file = plan.port_file
        while True:
            code = self._exit_status(handle)
            if code is not None:
                tail = _tail(plan.log)
                raise RuntimeStartError(
                    "RuntimeExited",
                    f"the runtime exited with status {code} before it was ready"
                    + (f": {tail}" if tail else ""),
                )
            if port_file is not None and not handle.port:
                handle.port = _reported_port(port_file)
            if plan.uds is not None and handle.uds is None and _pin_socket(plan.uds, plan.pinned):
                handle.uds = plan.pinned
            if await self._answers(handle, plan):
                return
            if time.monotonic() > deadline:
                raise RuntimeStartError(
                    "RuntimeStartTimeout",
                    f"the runtime did not {_waited_for(handle, plan)} within "
                    f"{self.startup_timeout:g} s",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.05)

    async def _answers(self, handle: RuntimeHandle, plan: _Plan) -> bool:
        """Whether the runtime answers ``GET /`` with 200 now (one on a Unix socket: on the
        socket pinned, never by the path the sandbox can change)."""
        if plan.uds is not None:
            return handle.uds is not None and await _unix_get_ok(handle.uds)
        if not handle.port:
            return False
        try:
            resp = await self._client().get(f"http://{handle.host}:{handle.port}/")
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def is_alive(self, handle: RuntimeHandle) -> bool:
        return self._exit_status(handle) is None

    async def _terminate(self, handle: RuntimeHandle, *, remove: bool = True) -> None:
        """SIGTERM the runtime's group, SIGKILL it after 2 s; return once its supervisor has
        killed everything the sandbox started (the fork server's exit report)."""
        fork = self._fork_server_of(handle.name)
        ident, pid = handle.runtime_id, handle.pid
        if fork is not None and ident is not None and pid is not None:
            if fork.status(ident) is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGTERM)
                if not await fork.wait_exit(ident, 2.0):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                    await fork.wait_exit(ident, 3.0)
            if fork.status(ident) is not None:
                fork.forget(ident)
        if remove:
            self._handles.pop(handle.name, None)
            await self._close_own_fork(handle.name)
            if handle.root:
                _tree.remove_quietly(handle.root, f"the directory of sandbox {handle.name}")

    async def _close_own_fork(self, name: str) -> None:
        fork = self._own_forks.pop(name, None)
        if fork is not None:
            await fork.close()

    async def stop(self, handle: RuntimeHandle) -> None:
        """Stop ``handle``'s runtime once: a stop while one is under way waits for it, and a
        stop of a runtime already stopped returns (its exit is forgotten by then, and its
        process group's number may be another's: never signalled again)."""
        stopping = self._stopping.get(handle.name)
        if stopping is None:
            if self._handles.get(handle.name) is not handle:
                return
            stopping = asyncio.ensure_future(self._terminate(handle))
            self._stopping[handle.name] = stopping
            stopping.add_done_callback(lambda _: self._stopping.pop(handle.name, None))
        await asyncio.shield(stopping)

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(h) for h in list(self._handles.values())))
        await asyncio.gather(*(self._close_own_fork(name) for name in list(self._own_forks)))
        if self._fork is not None:
            await self._fork.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._own_root:
            _tree.remove_quietly(self.root_dir, "the runtimes directory")
            release_owned_dir(self.root_dir)

    def kill_all_now(self) -> None:
        for handle in list(self._handles.values()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if handle.pid is not None and not self._exit_reported(handle):
                    os.killpg(handle.pid, signal.SIGKILL)  # never a pid used again
        self._handles.clear()
        forks = [*self._own_forks.values(), *([self._fork] if self._fork is not None else [])]
        self._own_forks.clear()
        for fork in forks:  # each supervisor kills what its sandbox started, then they exit
            fork.terminate()
        for fork in forks:
            fork.kill_now()
        if self._own_root:
            _tree.remove_quietly(self.root_dir, "the runtimes directory")
            release_owned_dir(self.root_dir)


LocalProcessBackend = LocalProcessLauncher
"""The deprecated name of :class:`LocalProcessLauncher` (until issue 27: it launches runtimes;
"backend" is the claims contract only); ``k8s_agent_sandbox_awx.testing`` keeps exporting it."""


def _names(command: str | Sequence[str], placeholder: str) -> bool:
    """Whether the runtime command names ``placeholder`` (``{port_file}``: it picks its own
    port and writes it there; ``{socket}``: it listens on that Unix socket)."""
    parts = [command] if isinstance(command, str) else command
    return any(placeholder in part for part in parts)


class _Plan:
    """How one sandbox's runtime starts and is reached (host paths): its directories, its
    command, and the port file or Unix socket it reports on (neither: the racy ``{port}``)."""

    def __init__(self, root: str, command: str | Sequence[str], *, builtin: bool) -> None:
        self.root = root
        self.command = command
        self.builtin = builtin
        self.base_dir = os.path.join(root, "work")
        # the sandbox's persistent area (/workspace of the file API), beside the base directory
        # so that a fresh base directory is empty; removed with the sandbox
        self.workspace_dir = os.path.join(root, "workspace")
        self.control_dir = os.path.join(root, "control")  # the runtime's socket or port file
        # the runtime's socket, hard-linked where no sandbox reaches (see _pin_socket)
        self.pinned = os.path.join(root, _bubblewrap.SOCKET_NAME)
        self.log = os.path.join(root, "runtime.log")
        self.port_file: str | None = None
        self.uds: str | None = None

    @property
    def free_port(self) -> bool:
        """The runtime gets a port chosen before it starts (a start may meet it taken)."""
        return self.port_file is None and self.uds is None


@dataclass(frozen=True)
class _Inside:
    """The paths of a plan as its runtime sees them: the host's own, or an isolated
    sandbox's (``/app``, ``/workspace``, the control directory)."""

    base_dir: str
    workspace_dir: str
    port_file: str | None
    socket: str

    @classmethod
    def host(cls, plan: _Plan) -> _Inside:
        socket_path, _ = _bubblewrap.control_paths(plan.control_dir)
        return cls(plan.base_dir, plan.workspace_dir, plan.port_file, socket_path)

    @classmethod
    def of(cls, plan: _Plan) -> _Inside:
        socket_path, port_file = _bubblewrap.control_paths(_bubblewrap.CONTROL_DIR)
        return cls("/app", "/workspace", port_file if plan.port_file else None, socket_path)


def _reported_port(path: str) -> int:
    """The port a runtime wrote to ``path`` (0: not yet; a link there is never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return 0
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    except OSError:
        return 0
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else 0


def _pin_socket(found: str, pinned: str) -> bool:
    """Hard-link the runtime's socket at ``found`` (in its control directory, which an
    isolated sandbox writes) to ``pinned`` (in the sandbox's host directory, which no sandbox
    sees) and say whether ``pinned`` now holds a socket. The broker then connects to
    ``pinned`` only: that inode is the socket the runtime listened on, whatever the sandbox
    later puts at ``found`` (a socket of its own, a link to a host socket, a FIFO, a file). A
    link at ``found`` is never followed (``link`` makes a hard link of the link itself, which
    is then refused)."""
    try:
        os.link(found, pinned, follow_symlinks=False)
    except FileExistsError:
        pass
    except OSError:  # not there yet (not listening yet)
        return False
    try:
        if stat.S_ISSOCK(os.lstat(pinned).st_mode):
            return True
    except OSError:
        return False
    with contextlib.suppress(OSError):
        os.unlink(pinned)  # not a socket: the runtime has not made its own yet
    return False


def _waited_for(handle: RuntimeHandle, plan: _Plan) -> str:
    """What a runtime that did not become ready in time did not do."""
    if not handle.port:
        return f"write its port to {plan.port_file}"
    if plan.uds and handle.uds is None:
        if os.path.lexists(plan.uds) and not os.path.exists(plan.pinned):
            return f"listen on {plan.uds} (what is there is not a socket)"
        return f"listen on {plan.uds}"
    return "answer GET /"


async def _unix_get_ok(path: str) -> bool:
    """``GET /`` on the Unix socket ``path`` answers 200 (a readiness probe: one request on a
    connection of its own; an HTTP client per sandbox would cost more than the probe)."""
    try:
        async with asyncio.timeout(2.0):
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                await writer.drain()
                status = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False
    return status.split(b" ", 2)[1:2] == [b"200"]


def _tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode("utf-8", errors="replace").strip()
    except OSError:
        return ""
