"""The managed commands' endpoints (``/commands``, ``docs/broker-api.md#managed-commands``)
and the legacy ``POST /execute`` (no I/O): their requests, time limits and answers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ..._upstream import ExecutionResult
from ._dataplane import DataTarget
from ._dataplane import data_request as _data
from ._protocol import RequestSpec, json_body, protocol_error, seconds
from ._refusals import not_a_command_id

__all__ = [
    "COMMAND_TIMEOUT_MARGIN",
    "EVENTS_DURATION",
    "EVENTS_READ_MARGIN",
    "LEGACY_NOT_FOUND",
    "LOOKUP_TIMEOUT",
    "MAX_COMMAND_TIMEOUT",
    "MAX_SANDBOX_TIMEOUT",
    "NO_TIME_LIMIT",
    "PREFER_WHOLE",
    "STREAMED_START_ACCEPT",
    "CommandInfo",
    "check_command_timeout",
    "command_events",
    "command_path",
    "command_status",
    "execute",
    "find_command",
    "kill_command",
    "list_commands",
    "parse_command_id",
    "parse_command_info",
    "parse_command_list",
    "parse_execution_result",
    "resize_command",
    "start_command",
]


COMMAND_TIMEOUT_MARGIN = 10.0
"""Seconds the client waits for an answer beyond a command's own time limit."""


MAX_SANDBOX_TIMEOUT = 86400.0
"""The largest ``X-Sandbox-Timeout`` the broker accepts (seconds it waits for a runtime)."""


MAX_COMMAND_TIMEOUT = MAX_SANDBOX_TIMEOUT - COMMAND_TIMEOUT_MARGIN / 2
"""The longest command time limit: the client sends ``X-Sandbox-Timeout`` = limit + 5 s."""


NO_TIME_LIMIT = "none"
"""The start's ``"timeout"`` of a command without a time limit (``commands.run(...,
background=True, timeout=0)``): a value a runtime that predates it refuses (not a number),
never read as the field left out (the runtime's default, 60 s)."""


LEGACY_NOT_FOUND = "Not Found"
"""The detail of the legacy runtime's 404 for a route it does not have (upstream's python
runtime is a FastAPI app: ``{"detail": "Not Found"}``): what identifies a runtime without
``/commands``."""


EVENTS_DURATION = 20.0
"""Seconds an event stream is asked to stay open (the protocol's maximum): a client re-requests
with its cursor at least this often, so no HTTP or proxy timeout cuts a long command."""


STREAMED_START_ACCEPT = "application/x-ndjson, application/json;q=0.5"
"""What a streamed start accepts: NDJSON events, or the plain answer of a runtime without it."""

PREFER_WHOLE = "no-live-output"
"""``Prefer: no-live-output``: the reader of a streamed start shows no output live (no
callbacks), so the runtime may hold the answer until the command's exit and send it whole
(``Content-Length``: one read instead of one per batch of events); a runtime without the
preference ignores it and streams (docs/broker-api.md, "The streamed start")."""


EVENTS_READ_MARGIN = 15.0
"""Seconds of silence (no event, no heartbeat) beyond ``duration`` before a stream counts as
stalled and is re-requested."""


def check_command_timeout(command_timeout: float) -> float:
    """A command's time limit, checked before anything is sent."""
    if not math.isfinite(command_timeout) or command_timeout <= 0:
        raise ValueError(
            f"The command timeout must be a finite number of seconds greater than 0, got "
            f"{command_timeout}; pass timeout= (or command_timeout=) as, e.g., 60."
        )
    if command_timeout > MAX_COMMAND_TIMEOUT:
        raise ValueError(
            f"The command timeout {command_timeout:g} s is over the limit of "
            f"{MAX_COMMAND_TIMEOUT:g} s: the broker waits at most {MAX_SANDBOX_TIMEOUT:g} s for "
            f"a sandbox's answer (X-Sandbox-Timeout), and the client asks for the command's "
            f"limit plus {COMMAND_TIMEOUT_MARGIN / 2:g} s. Pass timeout= (or command_timeout=) "
            f"of at most {MAX_COMMAND_TIMEOUT:g}, or start longer work in the background "
            "without a time limit (commands.run(..., background=True, timeout=0)) and wait on "
            "its handle."
        )
    return command_timeout


def execute(target: DataTarget, command: str, *, command_timeout: float) -> RequestSpec:
    """``POST /execute``: never retried (it is not idempotent)."""
    if not isinstance(command, str) or not command.strip():
        raise ValueError("The command is empty; pass the command line to run, e.g. 'echo hi'.")
    check_command_timeout(command_timeout)
    spec = _data(
        "POST",
        "/execute",
        "run a command",
        target,
        headers={"X-Sandbox-Timeout": seconds(command_timeout + COMMAND_TIMEOUT_MARGIN / 2)},
        read_timeout=command_timeout + COMMAND_TIMEOUT_MARGIN,
    )
    return json_body(spec, {"command": command, "timeout_seconds": command_timeout})


def command_path(command_id: str, tail: str = "") -> str:
    if not isinstance(command_id, str) or not command_id or len(command_id) > 255:
        raise not_a_command_id(command_id)
    return f"/commands/{quote(command_id, safe='')}{tail}"


def start_command(
    target: DataTarget, body: Mapping[str, Any], *, stream: bool = False, whole: bool = False
) -> RequestSpec:
    """``POST /commands``: never retried (a command must not run twice); ``body`` carries a
    fresh ``request_id`` so that the runtime can deduplicate. ``stream``: ask for the streamed
    start (``Accept: application/x-ndjson``: the command id, then the command's events); a
    runtime without it answers ``{"command_id"}`` as usual. ``whole`` (with ``stream``): no
    output is shown live, the answer may come whole at the exit (:data:`PREFER_WHOLE`)."""
    if not stream:
        return _data("POST", "/commands", "start a command", target, json=dict(body))
    headers = {"Accept": STREAMED_START_ACCEPT}
    if whole:
        headers["Prefer"] = PREFER_WHOLE
    return _data(
        "POST",
        "/commands",
        "start a command",
        target,
        headers=headers,
        read_timeout=EVENTS_DURATION + EVENTS_READ_MARGIN,
        json=dict(body),
    )


def command_status(target: DataTarget, command_id: str) -> RequestSpec:
    return _data("GET", command_path(command_id), f"get command {command_id!r}", target)


def list_commands(target: DataTarget) -> RequestSpec:
    return _data("GET", "/commands", "list the sandbox's commands", target)


LOOKUP_TIMEOUT = 10.0
"""Seconds the lookup of an interrupted start (:func:`find_command`) waits for its answer."""


def find_command(target: DataTarget, request_id: str) -> RequestSpec:
    """``GET /commands?request_id=...``: the command a start with ``request_id`` started (a
    list of one, or none). One short attempt, never retried: it is the cleanup of an
    interrupted start. A runtime that ignores the query lists every command: the caller keeps
    those whose ``request_id`` matches (a runtime that does not report it: none)."""
    return _data(
        "GET",
        "/commands",
        f"find the command started with request_id {request_id!r}",
        target,
        params={"request_id": request_id},
        retryable=False,
        read_timeout=LOOKUP_TIMEOUT,
    )


def command_events(
    target: DataTarget, command_id: str, after: int, duration: float = EVENTS_DURATION
) -> RequestSpec:
    """``GET /commands/{id}/events``: the NDJSON events after ``after`` for ``duration`` s."""
    path = command_path(command_id, "/events")
    return _data(
        "GET",
        path,
        f"follow the output of command {command_id!r}",
        target,
        params={"after": str(after), "duration": f"{duration:.3f}".rstrip("0").rstrip(".")},
        read_timeout=duration + EVENTS_READ_MARGIN,
    )


def kill_command(target: DataTarget, command_id: str) -> RequestSpec:
    """``POST /commands/{id}/kill``: not retried (safe to repeat by the caller)."""
    return _data("POST", command_path(command_id, "/kill"), f"kill command {command_id!r}", target)


def resize_command(target: DataTarget, command_id: str, cols: int, rows: int) -> RequestSpec:
    """``POST /commands/{id}/resize``: a terminal's new size; retried like a ``GET`` (an
    absolute size: idempotent in effect)."""
    path = command_path(command_id, "/resize")
    spec = _data("POST", path, f"resize the terminal of command {command_id!r}", target)
    return dataclasses.replace(json_body(spec, {"cols": cols, "rows": rows}), retryable=True)


def parse_execution_result(obj: Any) -> ExecutionResult:
    if not isinstance(obj, dict) or "exit_code" not in obj:
        raise protocol_error("run a command", "the answer has no exit_code")
    try:
        return ExecutionResult(
            stdout=obj.get("stdout") or "",
            stderr=obj.get("stderr") or "",
            exit_code=obj["exit_code"],
            timed_out=bool(obj.get("timed_out", False)),
            output_truncated=obj.get("output_truncated") is True,
        )
    except ValueError as exc:
        raise protocol_error("run a command", f"bad execution result ({exc})") from exc


@dataclass(frozen=True)
class CommandInfo:
    """A managed command as the runtime reports it (``commands.list()``, ``handle.status()``).

    ``state``: ``running``, ``exited``, ``cancelled`` (killed) or ``timed_out``; ``exit_code``
    is ``None`` while running. ``stdout``/``stderr`` (status only, ``None`` in a listing) hold
    the retained output (the first 1 MiB on the local runtime; ``output_truncated`` beyond)."""

    command_id: str
    state: str
    exit_code: int | None
    command: tuple[str, ...]
    cwd: str | None = None
    pid: int | None = None
    stdin: bool = False
    last_seq: int = 0
    output_truncated: bool = False
    started_at: str | None = None
    ended_at: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    request_id: str | None = None
    """The ``request_id`` its start carried (``None``: none, or a runtime that does not say)."""
    pty: tuple[int, int] | None = None
    """``(cols, rows)`` of a command on a terminal (``None``: on pipes, or a runtime without
    terminals)."""
    no_time_limit: bool = False
    """Whether the runtime says the command has no time limit (its status' ``"timeout"`` is
    ``null``; a runtime that does not report the field: ``False``)."""

    @property
    def running(self) -> bool:
        return self.state == "running"

    def result(self) -> ExecutionResult:
        """The status as a result (the retained output)."""
        return ExecutionResult(
            stdout=self.stdout or "",
            stderr=self.stderr or "",
            exit_code=-1 if self.exit_code is None else self.exit_code,
            timed_out=self.state == "timed_out",
            output_truncated=self.output_truncated,
            command_id=self.command_id,
            state=self.state,
        )


def parse_command_id(obj: Any) -> str:
    command_id = obj.get("command_id") if isinstance(obj, dict) else None
    if not isinstance(command_id, str) or not command_id:
        raise protocol_error("start a command", "the answer has no command_id", _MANAGED)
    return command_id


_MANAGED = "the managed-command protocol"


def parse_command_info(obj: Any, what: str = "get a command's status") -> CommandInfo:
    try:
        if not isinstance(obj, dict):
            raise TypeError("not a JSON object")
        exit_code = obj.get("exit_code")
        last_seq = obj.get("last_seq") or 0
        return CommandInfo(
            command_id=str(obj["command_id"]),
            state=str(obj["state"]),
            exit_code=None if exit_code is None else int(exit_code),
            command=tuple(str(arg) for arg in obj.get("command") or ()),
            cwd=obj.get("cwd"),
            pid=obj.get("pid"),
            stdin=bool(obj.get("stdin", False)),
            last_seq=int(last_seq),
            output_truncated=bool(obj.get("output_truncated", False)),
            started_at=obj.get("started_at"),
            ended_at=obj.get("ended_at"),
            stdout=obj.get("stdout"),
            stderr=obj.get("stderr"),
            request_id=obj.get("request_id") if isinstance(obj.get("request_id"), str) else None,
            pty=_pty_size(obj.get("pty")),
            no_time_limit="timeout" in obj and obj["timeout"] is None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise protocol_error(what, f"bad command status ({exc!r})", _MANAGED) from exc


def _pty_size(obj: Any) -> tuple[int, int] | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise TypeError(f"pty is {type(obj).__name__}, not an object")
    return int(obj["cols"]), int(obj["rows"])


def parse_command_list(obj: Any) -> list[CommandInfo]:
    what = "list the sandbox's commands"
    items = obj.get("commands") if isinstance(obj, dict) else None
    if not isinstance(items, list):
        raise protocol_error(what, 'expected {"commands": [...]}', _MANAGED)
    return [parse_command_info(item, what) for item in items]
