"""The local backend: each sandbox's runtime is a host process.

:class:`LocalProcessBackend` (a :class:`~._runtimes.SandboxBackend`) starts one process per
sandbox from a command line template, so any server that speaks the legacy python-runtime
protocol can be plugged in, under a supervisor that kills every process the sandbox started when
the runtime ends (see ``runtime._forkserver``).

NO ISOLATION: local runtimes and the commands they run are ordinary host processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ..runtime import _tree
from ..runtime._process import PARENT_PID_ENV
from . import _isolation
from ._interface import RUNTIME_PORT
from ._runtimes import RuntimeHandle, RuntimeStartError, SandboxSpec

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


_CREDENTIAL_VARIABLES = (
    "AGENT_SANDBOX_",
    "ACTIONS_ID_TOKEN_REQUEST_",
    "CI_JOB_JWT",
    "CI_JOB_TOKEN",
)


_BOOT = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from k8s_agent_sandbox_awx.broker.runtime._main import main; sys.exit(main())"
)
"""The built-in runtime in an isolated sandbox: a new interpreter that imports this very
package (from the directory this broker imported it from, whatever its working directory and
``PYTHONPATH``) without changing the commands' environment."""

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


def _inherited_environment() -> dict[str, str]:
    """The broker's environment minus credentials: a sandbox never sees the caller's tokens."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_CREDENTIAL_VARIABLES)}


def _free_port(host: str) -> int:
    """A port free now (for a runtime command without ``{port_file}``): racy, see
    :data:`DEFAULT_RUNTIME_COMMAND`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class _ForkServer:
    """Client side of the runtime's fork server (see ``runtime._forkserver``).

    A runtime is known by the id of the request that started it (``spawn``'s first value),
    never by its pid: the fork server reports an exit with that id, and a pid can be used again
    by the next runtime, also before the previous one's exit is reported."""

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.exited: dict[int, int] = {}  # request id -> exit status (until forgotten)
        self._exit_events: dict[int, asyncio.Event] = {}
        self._waiting: dict[int, asyncio.Future[int]] = {}
        self._ids = itertools.count(1)
        self._buffer = b""
        self._start_lock = asyncio.Lock()
        self.dead = False

    async def ensure_started(self) -> None:
        async with self._start_lock:
            if self.proc is not None:
                return
            argv = [sys.executable, "-m", "k8s_agent_sandbox_awx.broker.runtime", "--fork-server"]
            env = {**_inherited_environment(), PARENT_PID_ENV: str(os.getpid())}
            self.proc = _spawn_piped(argv, env, self.log_path)
            assert self.proc.stdout is not None
            fd = self.proc.stdout.fileno()
            os.set_blocking(fd, False)
            asyncio.get_running_loop().add_reader(fd, self._on_readable, fd)

    def _on_readable(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not data:
            asyncio.get_running_loop().remove_reader(fd)
            self._on_dead()
            return
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exited" in message:
                ident = int(message["id"])
                self.exited[ident] = int(message["status"])
                event = self._exit_events.pop(ident, None)
                if event is not None:
                    event.set()
                continue
            future = self._waiting.pop(int(message["id"]), None)
            if future is None or future.done():
                continue
            if "pid" in message:
                future.set_result(int(message["pid"]))
            else:
                future.set_exception(RuntimeStartError("RuntimeStartFailed", message["error"]))

    def _on_dead(self) -> None:
        self.dead = True
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(
                    RuntimeStartError("RuntimeStartFailed", "the runtime fork server exited")
                )
        self._waiting.clear()
        for event in self._exit_events.values():
            event.set()

    async def spawn(self, request: dict[str, Any]) -> tuple[int, int]:
        """Start a runtime: ``(its request id, its pid)``."""
        await self.ensure_started()
        if self.dead or self.proc is None or self.proc.stdin is None:
            raise RuntimeStartError("RuntimeStartFailed", "the runtime fork server is not running")
        ident = next(self._ids)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        line = json.dumps({**request, "id": ident}).encode() + b"\n"
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except OSError as exc:
            self._waiting.pop(ident, None)
            raise RuntimeStartError(
                "RuntimeStartFailed", f"cannot reach the runtime fork server: {exc}"
            ) from exc
        return ident, await asyncio.wait_for(future, 10.0)

    def status(self, ident: int) -> int | None:
        """The exit status of the runtime of request ``ident`` (``None``: still running)."""
        if ident in self.exited:
            return self.exited[ident]
        return -1 if self.dead else None

    async def wait_exit(self, ident: int, within: float) -> bool:
        if self.status(ident) is not None:
            return True
        event = self._exit_events.setdefault(ident, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), within)
        return self.status(ident) is not None

    def forget(self, ident: int) -> None:
        """Drop what is known of a stopped runtime (a long-lived broker keeps no exit forever)."""
        self.exited.pop(ident, None)
        self._exit_events.pop(ident, None)

    async def close(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.stdout is not None and not self.dead:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(proc.stdout.fileno())
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # EOF: the fork server stops its runtimes and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, 3.0)
        self.kill_now()
        if proc.stdout is not None:
            proc.stdout.close()

    def terminate(self) -> None:
        """SIGTERM the fork server (it stops its supervisors, which stop their sandboxes)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGTERM)

    def kill_now(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=3.0)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=2.0)


class LocalProcessBackend:
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

    ``isolation``: ``"auto"`` (bubblewrap when it works here, else none), ``"bwrap"`` (each
    sandbox in namespaces of its own; IsolationUnavailable, naming the package to install, when
    bwrap is missing or does not work) or ``"none"`` (host processes); default
    ``$AGENT_SANDBOX_LOCAL_ISOLATION``, else ``"auto"`` (see ``_isolation``). Isolated, a
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
    ) -> None:
        self.isolation_info = _isolation.choose(isolation)  # first: may refuse
        self.command = command or DEFAULT_RUNTIME_COMMAND
        self.host = host
        self.startup_timeout = startup_timeout
        self._own_root = root_dir is None
        self.root_dir = root_dir or owned_temp_dir(RUNTIMES_DIR_PREFIX)
        os.makedirs(self.root_dir, exist_ok=True)
        bwrap = self.isolation_info.bwrap
        self._layout = _isolation.Layout(bwrap, hidden=(self.root_dir,)) if bwrap else None
        if fork_server is None:
            fork_server = hasattr(os, "fork")
        self._fork: _ForkServer | None = (
            _ForkServer(os.path.join(self.root_dir, "fork-server.log")) if fork_server else None
        )
        self._own_forks: dict[str, _ForkServer] = {}  # sandbox name -> its own fork server
        self._handles: dict[str, RuntimeHandle] = {}
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

    def _fork_server_of(self, name: str) -> _ForkServer | None:
        return self._fork or self._own_forks.get(name)

    @property
    def isolation(self) -> str:
        """How this backend's sandboxes are isolated: ``"bwrap"`` or ``"none"``."""
        return self.isolation_info.mode

    async def start(self, spec: SandboxSpec) -> RuntimeHandle:
        root = os.path.join(self.root_dir, spec.name)
        plan = self._plan(spec, root)
        fork = self._fork or self._own_forks.setdefault(
            spec.name, _ForkServer(os.path.join(root, "fork-server.log"))
        )
        last_error = ""
        try:
            for _attempt in range(3):
                handle = await self._spawn(spec, plan, fork)
                try:
                    await self._wait_ready(handle, plan.log, plan.port_file)
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
                f"{_isolation.INSTALL_HINT}, or give the policy network=True",
            )
        plan = _Plan(root, command, builtin=command == DEFAULT_RUNTIME_COMMAND)
        socket_path, port_file = _isolation.control_paths(plan.control_dir)
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
        problem = _isolation.socket_path_problem(plan.uds) if plan.uds else None
        if problem:
            raise RuntimeStartError("RuntimeStartFailed", problem)
        for directory in (plan.base_dir, plan.workspace_dir, plan.control_dir):
            os.makedirs(directory, exist_ok=True)
        return plan

    async def _spawn(self, spec: SandboxSpec, plan: _Plan, fork: _ForkServer) -> RuntimeHandle:
        """Have ``fork`` start ``spec``'s runtime as ``plan`` says; its handle (not ready yet)."""
        for stale in (plan.port_file, plan.uds):
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
        handle.uds = plan.uds
        self._handles[spec.name] = handle
        return handle

    def _spawn_request(self, spec: SandboxSpec, plan: _Plan, port: int) -> dict[str, Any]:
        """What the fork server is asked to start for ``spec`` (see ``runtime._forkserver``):
        the built-in runtime forked, or a command line exec'd (in bwrap, when isolated)."""
        inside = _Inside.of(plan) if self._layout is not None else _Inside.host(plan)
        env = {
            **_inherited_environment(),
            **spec.env,
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
                "-P",  # never the working directory (/app: the caller's files) on sys.path
                "-c",
                _BOOT,
                _isolation.PACKAGE_PARENT,
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

    async def _wait_ready(
        self, handle: RuntimeHandle, log_path: str, port_file: str | None = None
    ) -> None:
        """Wait until the runtime answers ``GET /`` (first, with ``port_file``, until it has
        written the port it listens on: ``handle.port`` is set from it)."""
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.002
        while True:
            code = self._exit_status(handle)
            if code is not None:
                tail = _tail(log_path)
                raise RuntimeStartError(
                    "RuntimeExited",
                    f"the runtime exited with status {code} before it was ready"
                    + (f": {tail}" if tail else ""),
                )
            if port_file is not None and not handle.port:
                handle.port = _reported_port(port_file)
            if await self._answers(handle):
                return
            if time.monotonic() > deadline:
                raise RuntimeStartError(
                    "RuntimeStartTimeout",
                    f"the runtime did not {_waited_for(handle, port_file)} within "
                    f"{self.startup_timeout:g} s",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.05)

    async def _answers(self, handle: RuntimeHandle) -> bool:
        """Whether the runtime answers ``GET /`` with 200 now."""
        if handle.uds is not None:
            return await _unix_get_ok(handle.uds)  # no socket file yet: not listening yet
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
        await self._terminate(handle)

    async def close(self) -> None:
        await asyncio.gather(*(self._terminate(h) for h in list(self._handles.values())))
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
        socket_path, _ = _isolation.control_paths(plan.control_dir)
        return cls(plan.base_dir, plan.workspace_dir, plan.port_file, socket_path)

    @classmethod
    def of(cls, plan: _Plan) -> _Inside:
        socket_path, port_file = _isolation.control_paths(_isolation.CONTROL_DIR)
        return cls("/app", "/workspace", port_file if plan.port_file else None, socket_path)


def _reported_port(path: str) -> int:
    """The port a runtime wrote to ``path`` (0: not yet)."""
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def _waited_for(handle: RuntimeHandle, port_file: str | None) -> str:
    """What a runtime that did not become ready in time did not do."""
    if not handle.port:
        return f"write its port to {port_file}"
    if handle.uds and not os.path.exists(handle.uds):
        return f"listen on {handle.uds}"
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


def _spawn_piped(argv: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            start_new_session=True,
        )


def _tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode("utf-8", errors="replace").strip()
    except OSError:
        return ""
