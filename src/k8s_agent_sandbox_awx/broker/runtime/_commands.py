"""Managed commands for the local sandbox runtime: start, follow, feed, kill and reattach.

Standard library only (the runtime is forked per sandbox). The wire protocol (documented in
docs/broker-api.md and openapi.json):

- ``POST /commands`` ``{"command": [argv...], "timeout"?, "request_id"?, "stdin"?, "envs"?,
  "cwd"?}`` -> ``{"command_id"}`` (``"timeout": "none"``: no time limit); a repeated
  ``request_id`` returns the same command. With ``Accept: application/x-ndjson`` (the
  streamed start) the answer is NDJSON instead: the line
  ``{"command_id"}``, then the command's events as ``GET /commands/{id}/events?after=0`` sends
  them, until the exit event or ``max_duration`` (``SANDBOX_COMMAND_STREAM_START=0``: off, as
  a runtime without the extension); with ``Prefer: no-live-output`` as well, the same lines
  held until the exit (at most the heartbeat interval and 256 KiB) and sent whole, with a
  ``Content-Length`` and ``Preference-Applied: no-live-output``.
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

Here: :class:`CommandManager`, the commands of one runtime: the routes, the registry (request
ids, limits, retention), kill, stdin and resize. The checks of what a request says:
:mod:`._command_requests`; a command's process and the thread that reads it:
:mod:`._command_process`; its event stream: :mod:`._command_stream`; the output events and their
retention: :mod:`._command`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.parse
import uuid
from collections.abc import Generator, Mapping
from typing import Any

from . import _pty
from ._command import Command, Limits, _Follower, _line
from ._command_process import (
    KILL_WAIT_SECONDS,
    STDIN_WRITE_SECONDS,
    CommandRunner,
    duplicate_fd,
    kill_processes,
    write_all,
)
from ._command_requests import (
    CommandError,
    checked_start,
    query_number,
    request_id_query,
    sandbox_env_of,
    stdin_payload,
)
from ._command_stream import Sending, event_lines, send_held, send_ndjson, wants_whole
from ._http import Exchange, read_json, send_json

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
        self.runner = CommandRunner(limits, self._kept)
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
                self._answer_start(handler, self.start(body, sandbox_env_of(handler)))
            elif method == "GET" and parts == []:
                query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
                listed = self.list_commands(request_id_query(query))
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
    def start(self, body: dict[str, Any], sandbox_env: Mapping[str, str] | None = None) -> Command:
        """Start the command ``body`` asks for (its ``request_id`` seen before: that command);
        ``sandbox_env``: the sandbox's environment (:mod:`._env`), under the command's ``envs``."""
        request = checked_start(body, self.limits, self.base_dir)
        request_id = request["request_id"]
        with self.lock:
            self._forget_expired()
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
            self.runner.launch(command, sandbox_env or {}, request["envs"])
        return command

    # -- lookups -------------------------------------------------------------------------------
    def _forget_expired(self) -> None:
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

    def _kept(self, command: Command) -> bool:
        """Whether ``command`` is still one of this manager's (not forgotten)."""
        return command.command_id in self.commands

    def get(self, command_id: str) -> Command:
        with self.lock:
            self._forget_expired()
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
            self._forget_expired()
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
                kill_processes(command)
        command.done.wait(KILL_WAIT_SECONDS)
        return command.status()

    def kill_all(self) -> None:
        with self.lock:
            commands = list(self.commands.values())
        for command in commands:
            if command.state == "running" and command.proc is not None:
                kill_processes(command)

    def write_stdin(self, command: Command, body: dict[str, Any]) -> dict[str, Any]:
        payload, eof = stdin_payload(body, command.pty is not None)
        if not command.stdin_requested:
            raise CommandError(
                409, 'the command was started without stdin; start it with "stdin": true'
            )
        with command.stdin_lock:
            proc = command.proc
            with command.cond:
                running = command.state == "running" and proc is not None
                fd = duplicate_fd(command.master_fd) if command.pty is not None else None
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
            write_all(fd, payload)
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
            fd = duplicate_fd(command.master_fd) if command.state == "running" else None
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
        after = query_number(query, "after", 0, int)
        duration = query_number(query, "duration", self.limits.max_duration, float)
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
        sending = Sending(command, duration + self.limits.follower_grace_seconds)
        send_ndjson(
            handler,
            event_lines(command, after, duration, sending, self.limits, self._kept),
            sending,
        )

    def _answer_start(self, handler: Exchange, command: Command) -> None:
        """``{"command_id"}``, or with ``Accept: application/x-ndjson`` (the streamed start)
        that line followed by the command's events from the first one (held until the exit
        and sent whole when the start prefers it: ``Prefer: no-live-output``)."""
        started = {"command_id": command.command_id}
        accept = handler.headers.get("Accept") or ""
        if not self.limits.stream_start or "application/x-ndjson" not in accept:
            send_json(handler, 200, started)
            return
        duration = self.limits.max_duration
        sending = Sending(command, duration + self.limits.follower_grace_seconds)

        def lines() -> Generator[bytes, None, None]:
            yield _line(started)
            events = event_lines(command, 0, duration, sending, self.limits, self._kept)
            with contextlib.closing(events):
                yield from events

        if not wants_whole(handler):
            send_ndjson(handler, lines(), sending)
            return
        send_held(handler, lines(), sending, self.limits.heartbeat_seconds)
