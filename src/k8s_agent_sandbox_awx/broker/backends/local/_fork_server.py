"""The broker's side of the runtime's fork server (``runtime._forkserver``): one process that
forks each sandbox's runtime (about 2 ms instead of about 60 ms of CPU per sandbox), and the
environment every runtime starts from: the broker's minus credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
from typing import Any

from ...runtime._process import PARENT_PID_ENV
from ._launcher import RuntimeStartError

_CREDENTIAL_VARIABLES = (
    "AGENT_SANDBOX_",
    "ACTIONS_ID_TOKEN_REQUEST_",
    "CI_JOB_JWT",
    "CI_JOB_TOKEN",
)


def inherited_environment() -> dict[str, str]:
    """The broker's environment minus credentials: a sandbox never sees the caller's tokens."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_CREDENTIAL_VARIABLES)}


class ForkServer:
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
            env = {**inherited_environment(), PARENT_PID_ENV: str(os.getpid())}
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
