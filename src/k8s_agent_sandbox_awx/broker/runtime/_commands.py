"""Managed commands for the local sandbox runtime: start, follow, feed, kill and reattach.

Standard library only (the runtime is forked per sandbox). The wire protocol (documented in
docs/broker-api.md and openapi.json):

- ``POST /commands`` ``{"command": [argv...], "timeout"?, "request_id"?, "stdin"?, "envs"?,
  "cwd"?}`` -> ``{"command_id"}`` (``"timeout": "none"``: no time limit); a repeated
  ``request_id`` returns the same command. With ``Accept: application/x-ndjson`` (the
  streamed start) the answer is NDJSON instead: the line
  ``{"command_id"}``, then the command's events as ``GET /commands/{id}/events?after=0`` sends
  them, until the exit event or ``max_duration`` (``SANDBOX_COMMAND_STREAM_START=0``: off, as
  a runtime without the extension).
- ``GET /commands`` -> ``{"commands": [summary...]}`` (``?request_id=R``: only the command whose
  start carried ``R``, or none); ``GET /commands/{id}`` -> the status.
- ``GET /commands/{id}/events?after=SEQ&duration=S`` -> NDJSON lines
  ``{"type": "stdout"|"stderr"|"exit"|"heartbeat", "seq", "data"}``.
- ``POST /commands/{id}/kill`` -> the final status; ``POST /commands/{id}/stdin``
  ``{"data" | "data_base64", "eof"}``; ``POST /commands/{id}/resize`` ``{"cols", "rows"}`` (a
  command started with ``"pty": {"cols", "rows"}``: :mod:`._pty`).

Each command runs in its own process group (``start_new_session``); one thread per command reads
its pipes as the bytes arrive (not line-buffered) and turns them into events with contiguous
sequence numbers. Output is decoded as UTF-8 with replacement characters by an incremental decoder
per stream, so a multi-byte character split across two reads stays whole.

The output events and their retention: :mod:`._command`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import math
import os
import re
import selectors
import signal
import subprocess
import threading
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Generator, Iterator
from typing import Any, Protocol

from . import _paths, _process, _pty
from ._command import Command, Limits, _Follower, _line
from ._http import Exchange, read_json, send_json, start_ndjson

READ_SIZE = 128 * 1024
"""The most one read of a command's pipe takes (what is there now: a read never waits to fill),
and the capacity asked for its stdout and stderr pipes (Linux ``F_SETPIPE_SZ``; the default is
64 KiB): a fast command writes ahead while the last read is handed on, in fewer, larger events.
Both are at most an eighth of the live window (see ``_read_size``)."""
BATCH_BYTES = 256 * 1024
TIMEOUT_EXIT_CODE = 124
KILLED_EXIT_CODE = 128 + signal.SIGKILL
STDIN_WRITE_SECONDS = 30.0
KILL_WAIT_SECONDS = 10.0
DRAIN_SECONDS = 2.0
_ENV_NAME = re.compile(r"^[^=\x00]+$")
INVALID_TEXT = "invalid_text"
"""The code of a refusal of text UTF-8 cannot carry (argv, envs, cwd, stdin data)."""
_REQUEST_FIELDS = frozenset({"command", "timeout", "request_id", "stdin", "envs", "cwd"})
_PTY_FIELDS = _REQUEST_FIELDS | {"pty"}
_STDIN_FIELDS = frozenset({"data", "data_base64", "eof"})


def _host_cwd(cwd: str, base_dir: str) -> str:
    """A command's working directory on this host: ``/app`` and ``/workspace`` (and what is
    below them, ``/app/workspace`` too) are the sandbox's roots, as in the file API (``/app``:
    the base directory, where commands run by default); any other absolute path is the host's
    own (NO ISOLATION: a local command is a host process)."""
    parts = [p for p in cwd.split("/") if p not in ("", ".")]
    if not parts or parts[0] not in ("app", "workspace"):
        return cwd
    try:
        target = _paths.check_path(cwd, base_dir, "cwd")
        # a root replaced (by a link, another directory) is refused, as the file API does
        target.roots.check(target.root, cwd)
    except _paths.FsError as exc:  # its detail names sandbox paths only, never host ones
        raise CommandError(exc.status, f"field 'cwd': {exc.detail}", code=exc.code) from None
    return os.path.join(target.root_dir, *target.parts)


class CommandError(Exception):
    """An error answer: HTTP ``status`` and a JSON body ``{"detail", ...extra}``."""

    def __init__(self, status: int, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.body: dict[str, Any] = {"detail": detail, **extra}


def _argv(argv: Any) -> list[str]:
    if (
        not isinstance(argv, list)
        or not argv
        or not all(isinstance(a, str) for a in argv)
        or not argv[0]
    ):
        raise CommandError(
            400,
            "field 'command' must be a non-empty list of strings (the argv; to use a shell "
            'send ["/bin/bash", "-c", "..."])',
        )
    if any("\x00" in a for a in argv):
        raise CommandError(400, "field 'command' contains a NUL byte, which argv cannot carry")
    checked: list[str] = argv
    for arg in checked:
        _check_text("command", arg)
    return checked


NO_TIME_LIMIT = "none"
"""The ``"timeout"`` of a command without a time limit: it runs until it exits, is killed or
the runtime (its sandbox) ends; ``max_running`` still counts it."""


def _timeout(timeout: Any, limits: Limits) -> float:
    if timeout is None:
        timeout = limits.default_timeout
    if timeout == NO_TIME_LIMIT:
        return math.inf
    max_timeout = limits.max_timeout
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= max_timeout
    ):
        raise CommandError(
            400,
            f"field 'timeout' must be a number of seconds above 0 and at most {max_timeout:g} "
            f"(this runtime's SANDBOX_EXEC_TIMEOUT_SECONDS), or {NO_TIME_LIMIT!r} for no time "
            "limit",
        )
    return float(timeout)


def _envs(envs: Any) -> dict[str, str]:
    if not isinstance(envs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
    ):
        raise CommandError(400, "field 'envs' must be an object of string values")
    for key, value in envs.items():
        if not _ENV_NAME.match(key) or "\x00" in value:
            raise CommandError(
                400,
                f"field 'envs': {key!r} is not a valid variable (a name is non-empty, without "
                "'=' or NUL; a value without NUL)",
            )
        _check_text("envs", key)
        _check_text("envs", value)
    return envs


def _check_text(name: str, text: str) -> None:
    """Refuse text UTF-8 cannot carry (a lone surrogate: JSON can escape one, ``"\\ud800"``),
    before anything is registered or started: ``400`` with code ``invalid_text``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise CommandError(
            400,
            f"field {name!r} holds text that is not valid Unicode (a lone surrogate, "
            f"{bad!r}), which UTF-8, and so an argv, an environment or a stdin, cannot carry; "
            "send valid text (decode bytes with errors='replace', or send them as base64)",
            code=INVALID_TEXT,
        ) from None


def _cwd(cwd: Any, base_dir: str) -> str:
    if cwd is None:
        return base_dir
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\x00" in cwd:
        raise CommandError(400, f"field 'cwd' must be an absolute path, not {cwd!r}")
    _check_text("cwd", cwd)
    host = _host_cwd(cwd, base_dir)
    if not os.path.isdir(host):  # named as sent: a sandbox path, never the host's
        raise CommandError(400, f"field 'cwd': {cwd!r} is not an existing directory")
    return host


_MANAGERS: list[CommandManager] = []


def kill_all() -> None:
    """Kill the process group of every running managed command (the runtime is going away)."""
    for manager in list(_MANAGERS):
        manager.kill_all()


class CommandManager:
    """The managed commands of one runtime (one sandbox)."""

    def __init__(self, base_dir: str, limits: Limits) -> None:
        self.base_dir = base_dir
        self.limits = limits
        self.lock = threading.Lock()
        self.commands: dict[str, Command] = {}
        self.by_request: dict[str, str] = {}
        _MANAGERS.append(self)

    # -- HTTP routing --------------------------------------------------------------------------
    def handle(self, handler: Exchange, method: str) -> None:
        """Answer one request whose path is ``/commands`` or under ``/commands/``."""
        split = urllib.parse.urlsplit(handler.path)
        parts = split.path.split("/")[2:]  # "", "commands", ...
        body: dict[str, Any] = {}
        try:
            if method == "POST":
                try:
                    body = read_json(handler)
                except (ValueError, ConnectionError) as exc:
                    handler.close_connection = True
                    raise CommandError(400, f"the body must be a JSON object: {exc}") from None
                if not isinstance(body, dict):
                    raise CommandError(400, "the body must be a JSON object")
            if method == "POST" and parts == []:
                self._answer_start(handler, self.start(body))
            elif method == "GET" and parts == []:
                query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
                listed = self.list_commands(_request_id_query(query))
                send_json(handler, 200, {"commands": listed})
            elif method == "GET" and len(parts) == 1:
                send_json(handler, 200, self.get(parts[0]).status())
            elif method == "GET" and len(parts) == 2 and parts[1] == "events":
                query = urllib.parse.parse_qs(split.query)
                self.stream(handler, self.get(parts[0]), query)
            elif method == "POST" and len(parts) == 2 and parts[1] == "kill":
                send_json(handler, 200, self.kill(self.get(parts[0])))
            elif method == "POST" and len(parts) == 2 and parts[1] == "stdin":
                send_json(handler, 200, self.write_stdin(self.get(parts[0]), body))
            elif method == "POST" and parts[1:] == ["resize"] and self.limits.pty:
                send_json(handler, 200, self.resize(self.get(parts[0]), body))
            else:
                raise CommandError(404, f"no route for {method} {split.path}")
        except CommandError as exc:
            send_json(handler, exc.status, exc.body)

    # -- start ---------------------------------------------------------------------------------
    def _parse(self, body: dict[str, Any]) -> dict[str, Any]:
        """The start request ``body``, checked field by field (CommandError 400 naming the
        field and the rule)."""
        fields = _PTY_FIELDS if self.limits.pty else _REQUEST_FIELDS
        unknown = sorted(set(body) - fields)
        if unknown:
            raise CommandError(400, f"unknown field(s) {unknown}: the fields are {sorted(fields)}")
        argv = _argv(body.get("command"))
        pty = _pty_option(body)
        timeout = (
            math.inf
            if pty is not None and body.get("timeout") is None
            else _timeout(body.get("timeout"), self.limits)
        )
        request_id = body.get("request_id")
        if request_id is not None and (
            not isinstance(request_id, str) or not 0 < len(request_id) <= 255
        ):
            raise CommandError(400, "field 'request_id' must be a string of 1 to 255 characters")
        stdin = body.get("stdin", pty is not None)
        if not isinstance(stdin, bool):
            raise CommandError(400, "field 'stdin' must be true or false")
        return {
            "command": argv,
            "timeout": timeout,
            "request_id": request_id,
            "stdin": stdin,
            "envs": _envs(body.get("envs") or {}),
            "cwd": _cwd(body.get("cwd"), self.base_dir),
            "pty": pty,
        }

    def start(self, body: dict[str, Any]) -> Command:
        request = self._parse(body)
        request_id = request["request_id"]
        with self.lock:
            self._sweep()
            if request_id is not None and request_id in self.by_request:
                existing = self.commands[self.by_request[request_id]]
                if existing.request != request:
                    raise CommandError(
                        409,
                        f"request_id {request_id!r} was already used for a different command; "
                        "use a new request id for a new command",
                    )
                return existing
            running = sum(1 for c in self.commands.values() if c.state == "running")
            if running >= self.limits.max_running:
                raise CommandError(
                    429,
                    f"too many running commands: this sandbox runs at most "
                    f"{self.limits.max_running} at a time; wait for one to end or kill one",
                    limit=self.limits.max_running,
                )
            if len(self.commands) >= self.limits.max_handles:
                finished = [c for c in self.commands.values() if c.state != "running"]
                oldest = min(finished, key=lambda c: c.ended_at or 0.0)
                self._forget(oldest)
            command = Command(
                command_id=str(uuid.uuid4()),
                request_id=request_id,
                request=request,
                argv=list(request["command"]),
                cwd=request["cwd"],
                timeout=request["timeout"],
                stdin_requested=request["stdin"],
                started_at=time.time(),
                pty=request["pty"],
            )
            # its caller is about to follow it: the window keeps its start for the grace time
            command.followers.append(_Follower(0, 0, ended_at=time.monotonic()))
            self.commands[command.command_id] = command
            if request_id is not None:
                self.by_request[request_id] = command.command_id
            self._launch(command, request["envs"])
        return command

    def _launch(self, command: Command, envs: dict[str, str]) -> None:
        try:
            if command.pty is not None:
                env = {**os.environ, "TERM": _pty.DEFAULT_TERM, **envs}
                proc, command.master_fd = _pty.spawn(command.argv, command.cwd, env, command.pty)
            else:
                proc = subprocess.Popen(
                    command.argv,
                    cwd=command.cwd,
                    env={**os.environ, **envs},
                    stdin=subprocess.PIPE if command.stdin_requested else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
        except (OSError, ValueError) as exc:
            # not found / not executable (126, 127: a result, as a shell reports it), or what
            # _parse did not foresee (1): never a command left running without a process
            code = 126 if isinstance(exc, PermissionError) else 127
            code = 1 if isinstance(exc, ValueError) else code
            with command.cond:
                why = (exc.strerror if isinstance(exc, OSError) else None) or exc
                reason = f"cannot start {command.argv[0]!r}: {why}\n"
                command.append("stderr", reason, len(reason.encode()), self.limits)
                self._finish(command, code, "exited")
            return
        for pipe in (proc.stdout, proc.stderr):  # None on a pty
            with contextlib.suppress(AttributeError, OSError):  # not Linux, or above the maximum
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, self._read_size())  # type: ignore[union-attr]
        command.proc = proc
        command.stdin_open = command.stdin_requested
        threading.Thread(
            target=self._guarded_pump,
            args=(command,),
            name=f"command-{command.command_id}",
            daemon=True,
        ).start()

    # -- the per-command thread ----------------------------------------------------------------
    def _guarded_pump(self, command: Command) -> None:
        """``_pump``, and if it fails: kill the group and end the command visibly anyway."""
        try:
            self._pump(command)
        except Exception:  # logged to the runtime's log (stderr), and the command ends below
            traceback.print_exc()
        finally:
            if not command.done.is_set() and command.proc is not None:
                _kill_processes(command)
                try:
                    rc = command.proc.wait(KILL_WAIT_SECONDS)
                except subprocess.TimeoutExpired:
                    rc = -int(signal.SIGKILL)
                with command.cond:
                    note = (
                        "\nthe runtime failed while reading this command's output; it was killed\n"
                    )
                    command.append("stderr", note, len(note), self.limits)
                    self._finish(command, rc if rc >= 0 else 128 - rc, "exited")

    def _pump(self, command: Command) -> None:
        """Read the command's pipes into events until both end (or, once its leader exited,
        for at most DRAIN_SECONDS), killing its group at the leader's exit or its timeout;
        then record the end."""
        proc = command.proc
        assert proc is not None
        pipes = _Pipes(command)
        try:
            while pipes.open or not pipes.leader_done:
                if self._held_back(command, pipes):
                    continue  # the pipe fills and the command blocks on its writes
                for key, _ in pipes.selector.select(pipes.wait(command)):
                    if key.data == "exit":
                        pipes.selector.unregister(pipes.pidfd)
                    elif not self._read(command, key.fd, key.data, pipes.decoders[key.data]):
                        pipes.selector.unregister(key.fd)
                        pipes.open -= 1
                if pipes.after_select(command):
                    break  # a process that left the group holds the pipes: stop reading
        finally:
            pipes.close()
        rc = proc.wait()
        with command.cond:
            if rc < 0 and command.killed_by == "cancel":
                self._finish(command, KILLED_EXIT_CODE, "cancelled")
            elif rc < 0 and command.killed_by == "timeout":
                self._finish(command, TIMEOUT_EXIT_CODE, "timed_out")
            else:
                self._finish(command, rc if rc >= 0 else 128 - rc, "exited")
        self._trim(command)

    def _held_back(self, command: Command, pipes: _Pipes) -> bool:
        """Backpressure: whether a follower has not been sent the window yet (the pipes are
        then not read, for at most 0.1 s at a time, while the command runs)."""
        if pipes.leader_done or command.killed_by is not None:
            return False
        with command.cond:
            full = command.evict(self.limits)
            if full:
                command.cond.wait(0.1)
        assert command.proc is not None
        return full and not _exited(command.proc.pid) and time.monotonic() < pipes.deadline

    def _trim(self, command: Command) -> None:
        """After the exit: bring the window back to its size once its followers acknowledged
        what they were sent or their grace time ended (nothing else would drop it now)."""
        while True:
            with command.cond:
                command.evict(self.limits)
                if (
                    command.window_size <= self.limits.window_bytes
                    or not command.followers
                    or command.command_id not in self.commands
                ):
                    return
                command.cond.wait(self.limits.follower_grace_seconds)

    def _read(self, command: Command, fd: int, kind: str, decoder: _Decoder) -> bool:
        """Read what the pipe (or pty) holds now into events; ``False`` at its end (a pty's
        master reads ``EIO`` once every holder of its terminal closed it)."""
        try:
            data = os.read(fd, self._read_size())
        except BlockingIOError:  # a pty's master is non-blocking (its writers share it)
            return True
        except OSError:
            data = b""
        text, extra = decoder.decode(data, not data)  # a split character waits for its rest
        if text:
            size = len(text) if text.isascii() else len(text.encode())
            with command.cond:
                command.append(kind, text, size, self.limits, **extra)
        return bool(data)

    def _read_size(self) -> int:
        """``READ_SIZE``, or an eighth of the live window if less: the window keeps several
        events, and what a command wrote ahead into its pipe stays small beside it."""
        return max(4096, min(READ_SIZE, self.limits.window_bytes // 8))

    def _finish(self, command: Command, exit_code: int, state: str) -> None:
        """Record the end and the ``exit`` event (the caller holds ``command.cond``)."""
        command.exit_code = exit_code
        command.state = state
        command.ended_at = time.time()
        command.stdin_open = False
        if command.proc is not None and command.proc.stdin is not None:
            with contextlib.suppress(OSError):
                command.proc.stdin.close()
        command.append("exit", "", 0, self.limits, exit_code=exit_code, state=state)
        command.done.set()

    # -- lookups -------------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Forget finished commands older than the retention time (the caller holds the lock)."""
        horizon = time.time() - self.limits.retention_seconds
        for command in list(self.commands.values()):
            if command.ended_at is not None and command.ended_at < horizon:
                self._forget(command)

    def _forget(self, command: Command) -> None:
        self.commands.pop(command.command_id, None)
        if command.request_id is not None:
            self.by_request.pop(command.request_id, None)
        with command.cond:
            command.cond.notify_all()

    def get(self, command_id: str) -> Command:
        with self.lock:
            self._sweep()
            command = self.commands.get(command_id)
        if command is None:
            raise CommandError(
                404,
                f"no command {command_id!r} in this sandbox (finished commands are kept "
                f"{self.limits.retention_seconds:g} s, at most {self.limits.max_handles})",
            )
        return command

    def list_commands(self, request_id: str | None = None) -> list[dict[str, Any]]:
        """The summaries of the commands, oldest first; with ``request_id``, of the one its
        start carried it (the cleanup of a client whose start's answer was lost), or none."""
        with self.lock:
            self._sweep()
            if request_id is None:
                commands = sorted(self.commands.values(), key=lambda c: c.started_at)
            else:
                found = self.commands.get(self.by_request.get(request_id, ""))
                commands = [found] if found is not None else []
        out = []
        for command in commands:
            with command.cond:
                out.append(command.summary())
        return out

    # -- kill and stdin ------------------------------------------------------------------------
    def kill(self, command: Command) -> dict[str, Any]:
        with command.cond:
            if command.state == "running" and command.proc is not None:
                if command.killed_by is None:
                    command.killed_by = "cancel"
                _kill_processes(command)
        command.done.wait(KILL_WAIT_SECONDS)
        return command.status()

    def kill_all(self) -> None:
        with self.lock:
            commands = list(self.commands.values())
        for command in commands:
            if command.state == "running" and command.proc is not None:
                _kill_processes(command)

    def write_stdin(self, command: Command, body: dict[str, Any]) -> dict[str, Any]:
        payload, eof = _stdin_payload(body, command.pty is not None)
        if not command.stdin_requested:
            raise CommandError(
                409, 'the command was started without stdin; start it with "stdin": true'
            )
        with command.stdin_lock:
            proc = command.proc
            with command.cond:
                running = command.state == "running" and proc is not None
                fd = _dup(command.master_fd) if command.pty is not None else None
            if fd is None and running and proc is not None and proc.stdin is not None:
                fd = proc.stdin.fileno()
            if not running or fd is None:
                raise CommandError(409, f"the command is {command.state}: its stdin is closed")
            try:
                self._write(command, fd, payload)
            finally:
                if command.pty is not None:
                    _pty.close_quietly(fd)
            if eof and proc is not None and proc.stdin is not None:
                command.stdin_open = False
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        return {"command_id": command.command_id, "written": len(payload), "stdin": not eof}

    @staticmethod
    def _write(command: Command, fd: int, payload: bytes) -> None:
        """Write ``payload`` to the command's stdin (its pipe, or its pty's master)."""
        if not command.stdin_open:
            raise CommandError(409, "stdin was closed (eof was sent)")
        try:
            _write_all(fd, payload)
        except TimeoutError:
            raise CommandError(
                409, f"the command did not read its stdin for {STDIN_WRITE_SECONDS:g} s"
            ) from None
        except OSError:
            command.stdin_open = False
            raise CommandError(409, "the command closed its stdin") from None

    def resize(self, command: Command, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /commands/{id}/resize``: the pty's new size (``SIGWINCH`` to its foreground
        process group)."""
        try:
            size = _pty.parse_size(body, "the body", defaults=False)
        except ValueError as exc:
            raise CommandError(400, str(exc)) from None
        if command.pty is None:
            raise CommandError(
                409, 'the command was started without a pty; start it with "pty": {"cols", "rows"}'
            )
        with command.cond:
            fd = _dup(command.master_fd) if command.state == "running" else None
            if fd is None:
                raise CommandError(409, f"the command is {command.state}: its terminal is closed")
            try:
                _pty.set_size(fd, size)
            except OSError as exc:
                raise CommandError(409, f"the terminal cannot be resized: {exc.strerror}") from None
            finally:
                _pty.close_quietly(fd)
            command.pty = size
        return {"command_id": command.command_id, "cols": size[0], "rows": size[1]}

    # -- the event stream ----------------------------------------------------------------------
    def stream(self, handler: Exchange, command: Command, query: dict[str, list[str]]) -> None:
        after = _query_number(query, "after", 0, int)
        duration = _query_number(query, "duration", self.limits.max_duration, float)
        if after < 0:
            raise CommandError(400, "query 'after' must be an integer sequence number >= 0")
        if not 0 <= duration <= self.limits.max_duration:
            raise CommandError(
                400,
                f"query 'duration' must be a number of seconds from 0 to "
                f"{self.limits.max_duration:g}",
            )
        with command.cond:
            if after > command.last_seq:
                raise CommandError(
                    400,
                    f"query 'after'={after} is beyond the last event ({command.last_seq})",
                    last_seq=command.last_seq,
                )
            try:
                command.event_at(after + 1)
            except LookupError as lost:
                first = int(lost.args[0])
                raise CommandError(
                    410,
                    f"events {after + 1} to {first - 1} were dropped: output beyond "
                    f"{self.limits.output_bytes} bytes is streamed live but not kept for replay; "
                    f"resume with after={first - 1} (the output is truncated)",
                    resume_after=first - 1,
                ) from None
        sending = _Sending(command, duration + self.limits.follower_grace_seconds)
        _send_ndjson(handler, self._lines(command, after, duration, sending), sending)

    def _answer_start(self, handler: Exchange, command: Command) -> None:
        """``{"command_id"}``, or with ``Accept: application/x-ndjson`` (the streamed start)
        that line followed by the command's events from the first one."""
        started = {"command_id": command.command_id}
        accept = handler.headers.get("Accept") or ""
        if not self.limits.stream_start or "application/x-ndjson" not in accept:
            send_json(handler, 200, started)
            return
        duration = self.limits.max_duration
        sending = _Sending(command, duration + self.limits.follower_grace_seconds)

        def lines() -> Generator[bytes, None, None]:
            yield _line(started)
            with contextlib.closing(self._lines(command, 0, duration, sending)) as events:
                yield from events

        _send_ndjson(handler, lines(), sending)

    def _lines(
        self, command: Command, after: int, duration: float, sending: _Sending
    ) -> Generator[bytes, None, None]:
        """Batches of NDJSON lines after ``after``, until the exit event or ``duration``."""
        with command.cond:
            follower = sending.follower = command.follow(after)
        try:
            yield from self._batches(command, follower, after, duration)
        finally:
            with command.cond:
                command.unfollow(follower, self.limits.follower_grace_seconds)

    def _batches(
        self, command: Command, follower: _Follower, after: int, duration: float
    ) -> Iterator[bytes]:
        deadline = time.monotonic() + duration
        beat = self.limits.heartbeat_seconds
        cursor = after
        last_sent = time.monotonic()
        unacked = 0  # window output sent: kept until a request continues from a later cursor
        while True:
            batch: list[bytes] = []
            size = 0
            ended = lost = False
            with command.cond:
                while True:
                    try:
                        event = command.event_at(cursor + 1)
                    except LookupError:
                        lost = True
                        break
                    if event is None:
                        break
                    batch.append(event.line)
                    size += len(event.line)
                    cursor = event.seq
                    if event.seq > len(command.retained):
                        unacked += event.size
                    if event.kind == "exit":
                        ended = True
                        break
                    if size >= BATCH_BYTES or unacked >= self.limits.unacked_bytes:
                        break
                if batch:  # sent from now on (a broken send may deliver part): read more
                    follower.cursor = cursor
                    command.cond.notify_all()
                now = time.monotonic()
                if not batch and not lost and now < deadline:
                    gone = command.command_id not in self.commands
                    if not gone:
                        command.cond.wait(max(0.0, min(deadline, last_sent + beat) - now))
                    else:
                        lost = True
            if batch:
                yield b"".join(batch)
                last_sent = time.monotonic()
            if ended or lost or unacked >= self.limits.unacked_bytes:
                return  # enough sent unacknowledged: the client continues from its cursor
            now = time.monotonic()
            if now >= deadline:
                return
            if not batch and now - last_sent >= beat:
                yield _line({"type": "heartbeat", "seq": cursor, "data": ""})
                last_sent = now


class _Decoder(Protocol):
    def decode(self, data: bytes, final: bool) -> tuple[str, dict[str, str]]: ...


class _Pipes:
    """A running command's stdout and stderr, or its pty's master (and its pidfd, readable when
    its leader exits, where the platform has one) in one selector, and where their reading
    stands."""

    def __init__(self, command: Command) -> None:
        proc = command.proc
        assert proc is not None
        self.command = command
        self.proc = proc
        self.selector = selectors.DefaultSelector()
        self.decoders: dict[str, _Decoder] = {}
        if command.master_fd is not None:  # one stream: the terminal, its bytes kept exact
            streams: list[tuple[int, str, _Decoder]] = [
                (command.master_fd, "stdout", _pty.ExactText())
            ]
        else:
            assert proc.stdout is not None and proc.stderr is not None
            streams = [
                (proc.stdout.fileno(), "stdout", _pty.PlainText()),
                (proc.stderr.fileno(), "stderr", _pty.PlainText()),
            ]
        for fd, kind, decoder in streams:
            self.selector.register(fd, selectors.EVENT_READ, kind)
            self.decoders[kind] = decoder
        self.pidfd = -1
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(proc.pid)  # readable when the leader exits
            self.selector.register(self.pidfd, selectors.EVENT_READ, "exit")
        self.deadline = time.monotonic() + command.timeout  # inf: a pty without a time limit
        self.open = len(streams)
        self.leader_done = False
        self.drain_until: float | None = None

    def wait(self, command: Command) -> float | None:
        """How long the next select may wait (``None``: until a pipe is readable)."""
        now = time.monotonic()
        waits = []
        if not self.leader_done:
            if command.killed_by is None and math.isfinite(self.deadline):
                waits.append(self.deadline - now)
            if self.pidfd < 0:
                waits.append(0.05)
        if self.drain_until is not None:
            waits.append(self.drain_until - now)
        return max(0.0, min(waits)) if waits else None

    def after_select(self, command: Command) -> bool:
        """Kill the group (and a pty's session) once the leader exited (what it left there ends
        with it) or at the timeout; ``True`` when the pipes have been drained for
        DRAIN_SECONDS after the exit."""
        if not self.leader_done and _exited(self.proc.pid):
            self.leader_done = True
            _kill_processes(command)  # what the command left in its group ends with it
            self.drain_until = time.monotonic() + DRAIN_SECONDS
        elif not self.leader_done and time.monotonic() >= self.deadline:
            with command.cond:
                if command.killed_by is None:
                    command.killed_by = "timeout"
            _kill_processes(command)
        return self.drain_until is not None and time.monotonic() >= self.drain_until

    def close(self) -> None:
        self.selector.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
        command = self.command
        with command.cond:  # its users hold duplicates: closing it never pulls one away
            master, command.master_fd = command.master_fd, None
        if master is not None:
            _pty.close_quietly(master)
            return
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()


def _kill_processes(command: Command) -> None:
    """SIGKILL the command's process group, and for a pty its whole session (the jobs its
    shell put in groups of their own)."""
    assert command.proc is not None
    _process.kill_group(command.proc.pid)
    if command.pty is not None:
        _pty.kill_session(command.proc.pid)


def _dup(fd: int | None) -> int | None:
    """A duplicate of ``fd`` (the caller closes it), ``None`` when there is none."""
    if fd is None:
        return None
    try:
        return os.dup(fd)
    except OSError:
        return None


def _pty_option(body: dict[str, Any]) -> tuple[int, int] | None:
    """The start's ``pty`` size, ``None`` for a command on pipes."""
    if body.get("pty") is None:
        return None
    try:
        size = _pty.parse_size(body["pty"], "pty", defaults=True)
    except ValueError as exc:
        raise CommandError(400, str(exc)) from None
    if body.get("stdin") is False:
        raise CommandError(
            400,
            "field 'stdin' cannot be false with 'pty': a terminal's input is always open "
            "(POST /commands/{id}/stdin); leave 'stdin' out",
        )
    return size


def _stdin_payload(body: dict[str, Any], pty: bool) -> tuple[bytes, bool]:
    """The bytes a stdin write carries (``data``, UTF-8, or ``data_base64``) and its ``eof``."""
    unknown = sorted(set(body) - _STDIN_FIELDS)
    if unknown:
        raise CommandError(
            400, f"unknown field(s) {unknown}: the fields are 'data' or 'data_base64', and 'eof'"
        )
    eof = body.get("eof", False)
    if not isinstance(eof, bool):
        raise CommandError(400, "field 'eof' must be true or false")
    if eof and pty:
        raise CommandError(
            400,
            "field 'eof' cannot end a terminal's input: send Ctrl-D (\\u0004) to end what a "
            "program reads from it, or kill the command",
        )
    if "data" in body and "data_base64" in body:
        raise CommandError(400, "give 'data' (text) or 'data_base64' (bytes), not both")
    if "data_base64" in body:
        encoded = body["data_base64"]
        try:
            if not isinstance(encoded, str):
                raise ValueError("not a string")
            return base64.b64decode(encoded, validate=True), eof
        except (ValueError, binascii.Error):
            raise CommandError(400, "field 'data_base64' must be a base64 string") from None
    data = body.get("data", "")
    if not isinstance(data, str):
        raise CommandError(400, "field 'data' must be a string")
    _check_text("data", data)
    return data.encode(), eof


class _Sending:
    """The sending side of one event stream: its sends must be done ``limit`` seconds (its
    duration plus the follower grace time) after it began, else the runtime ends it (a
    reader that does not read never holds a thread, a connection or the window for longer);
    and the progress of its follower's sends (``_Follower.sending_since``), which tells the
    reader whether that follower still reads."""

    def __init__(self, command: Command, limit: float) -> None:
        self.command = command
        self.send_by = time.monotonic() + limit
        self.follower: _Follower | None = None

    def remaining(self) -> float:
        """Seconds left to send in; a ``TimeoutError`` when none are."""
        left = self.send_by - time.monotonic()
        if left <= 0:
            raise TimeoutError("the event stream could not be sent within its time")
        return left

    def progress(self, sending: bool = True) -> None:
        """A send started or made progress (``sending``), or is done."""
        follower = self.follower
        if follower is not None:
            with self.command.cond:
                follower.sending_since = time.monotonic() if sending else None


def _send_ndjson(
    handler: Exchange, chunks: Generator[bytes, None, None], sending: _Sending
) -> None:
    """A ``200`` NDJSON answer, each chunk sent as it comes (chunked transfer encoding). Every
    write is bounded by ``sending``: a reader that stops reading gets its connection closed
    (no end of the chunked body) once the stream's time is up, and continues from its cursor."""
    sock = handler.connection
    try:
        sock.settimeout(sending.remaining())  # the status line and headers too
        start_ndjson(handler)
        with contextlib.closing(chunks):
            for chunk in chunks:
                _send_parts(sock, (b"%x\r\n" % len(chunk), chunk, b"\r\n"), sending)
            _send_parts(sock, (b"0\r\n\r\n",), sending)
    except OSError:  # the reader went away, or did not read within the stream's time
        handler.close_connection = True
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(None)


def _send_parts(sock: Any, parts: tuple[bytes, ...], sending: _Sending) -> None:
    """Send ``parts`` as one write without joining them (no copy of a large chunk), within the
    stream's time (``TimeoutError`` past it), recording the progress of the send."""
    views = [memoryview(part) for part in parts]
    sending.progress()
    while views:
        sock.settimeout(sending.remaining())
        sent = sock.sendmsg(views)
        sending.progress()
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views and sent:
            views[0] = views[0][sent:]
    sending.progress(False)


def _request_id_query(query: dict[str, list[str]]) -> str | None:
    """The ``request_id`` a ``GET /commands`` asks for (``None``: every command)."""
    values = query.get("request_id")
    if values is None:
        return None
    if not 0 < len(values[-1]) <= 255:
        raise CommandError(400, "query 'request_id' must be a string of 1 to 255 characters")
    return values[-1]


def _query_number(
    query: dict[str, list[str]], name: str, default: float, kind: type[int] | type[float]
) -> Any:
    values = query.get(name)
    if not values:
        return default
    try:
        return kind(values[-1])
    except ValueError:
        raise CommandError(400, f"query {name!r}={values[-1]!r} is not a number") from None


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited, without reaping it (its pgid stays valid)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to a pipe, waiting at most ``STDIN_WRITE_SECONDS`` for the reader."""
    if not data:
        return
    deadline = time.monotonic() + STDIN_WRITE_SECONDS
    os.set_blocking(fd, False)
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_WRITE)
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not selector.select(remaining):
                continue
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                continue
            view = view[written:]
