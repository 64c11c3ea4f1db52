"""The data plane: the sandbox runtime's endpoints, proxied by the broker (no I/O).

Shared by every dialect: a dialect only says which headers route a request to its sandbox
(:meth:`Dialect.data_target`); the paths, bodies, answers and the runtime's own errors are
decided here, once. Today these are the legacy python-runtime endpoints (``/execute``,
``/upload``, ``/download``, ``/list``, ``/exists``) and the managed commands (``/commands``,
see ``docs/broker-api.md#managed-commands``); the file API is in ``_fsapi``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import posixpath
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

from ..._upstream import ExecutionResult, FileEntry, SandboxError
from ...errors import (
    BrokerError,
    BrokerUnavailableError,
    CommandOutputLostError,
    FileAPIUnsupportedError,
    RequestTimeoutError,
    SandboxFileError,
    SandboxFileExistsError,
    SandboxFileLimitError,
    SandboxFileNotFoundError,
    SandboxPathError,
    StdinTooLargeError,
)
from ._protocol import (
    Call,
    RequestSpec,
    json_body,
    protocol_error,
    redact_answer,
    rfc3339_seconds,
    seconds,
)

__all__ = [
    "COMMAND_TIMEOUT_MARGIN",
    "EVENTS_DURATION",
    "LEGACY_NOT_FOUND",
    "MAX_COMMAND_TIMEOUT",
    "MAX_SANDBOX_TIMEOUT",
    "NO_TIME_LIMIT",
    "STDIN_MAX_BODY",
    "STREAMED_START_ACCEPT",
    "CommandInfo",
    "DataTarget",
    "DownloadMeter",
    "Keepalive",
    "KeptAlive",
    "Multipart",
    "check_command_timeout",
    "command_events",
    "command_status",
    "command_stdin",
    "data_request",
    "download",
    "execute",
    "exists",
    "find_command",
    "kill_command",
    "list_commands",
    "list_files",
    "multipart_framing",
    "parse_command_id",
    "parse_command_info",
    "parse_command_list",
    "parse_execution_result",
    "parse_exists",
    "parse_file_entries",
    "refuse_control_characters",
    "resize_command",
    "runtime_error",
    "start_command",
    "stdin_chunk",
    "stdin_refusal",
    "upload",
    "validate_sandbox_path",
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
STDIN_MAX_BODY = 1024 * 1024
"""The largest request body the sandbox runtime reads (the local runtime's limit for its JSON
requests, ``POST /commands/{id}/stdin`` included): a stdin write's body is its data
JSON-encoded, so a write is checked against it before it is sent."""
_SIZE = re.compile(r"(?i)too large|larger than|\bover \d+ bytes")
_BYTES = re.compile(r"(\d+)\s*bytes")

EVENTS_DURATION = 20.0
"""Seconds an event stream is asked to stay open (the protocol's maximum): a client re-requests
with its cursor at least this often, so no HTTP or proxy timeout cuts a long command."""
STREAMED_START_ACCEPT = "application/x-ndjson, application/json;q=0.5"
"""What a streamed start accepts: NDJSON events, or the plain answer of a runtime without it."""
EVENTS_READ_MARGIN = 15.0
"""Seconds of silence (no event, no heartbeat) beyond ``duration`` before a stream counts as
stalled and is re-requested."""


class DataTarget(Protocol):
    """Where a data-plane request goes: a dialect's routing headers for one sandbox."""

    @property
    def sandbox_id(self) -> str: ...

    def headers(self) -> dict[str, str]: ...


def refuse_control_characters(path: str) -> str:
    """``path`` if it is a str without control characters (the one path rule every file
    operation checks on the client, whatever the runtime's own rules)."""
    if not isinstance(path, str):
        raise TypeError(f"A sandbox path must be a str, got {type(path).__name__}.")
    bad = next((i for i, c in enumerate(path) if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(
            f"The sandbox path {path!r} contains a control character (U+{ord(path[bad]):04X} "
            f"at index {bad}). Paths must not contain control characters (U+0000-U+001F, "
            "U+007F), even with allow_unsafe_paths=True; remove them."
        )
    return path


class Keepalive:
    """One sandbox's opt-in activity keepalive (``keepalive=`` seconds): data-plane activity
    moves the sandbox's deadline to now + ``seconds``, when that is later than the deadline
    it knows, and at most once per half window. Thread-safe; owned by the sandbox's data
    target (:class:`KeptAlive`). The extension itself is sent by the transport of the
    sandbox's data plane, best effort: one short attempt, a failure is logged (never raised)
    and the extension tried again by the next request (:meth:`failed`)."""

    def __init__(
        self,
        name: str,
        seconds: int,
        deadline: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self.seconds = seconds
        self.deadline = deadline
        """The sandbox's deadline as last reported (epoch seconds), ``None``: unknown."""
        self._clock = clock
        self._last: float | None = None
        self._lock = threading.Lock()

    def claim(self) -> bool:
        """Whether this request should extend the lifetime now (then it counts as done)."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < self.seconds / 2:
                return False
            if self.deadline is not None and now + self.seconds <= self.deadline:
                return False
            self._last = now
            return True

    def extended(self, expires_at: str | None) -> None:
        """Record the deadline an extension's answer reports."""
        self.deadline = rfc3339_seconds(expires_at)

    def failed(self) -> None:
        """The extension :meth:`claim` asked for failed: the next request tries it again."""
        with self._lock:
            self._last = None


@dataclass(frozen=True)
class KeptAlive:
    """A sandbox's data target with its activity keepalive, the one owner of it: the
    transport of the sandbox's data plane (``transport.to(target)``) asks :meth:`due` before
    each data-plane request, and sends the extension it returns; ``extend`` is the dialect's
    (``Dialect.extend``)."""

    target: DataTarget
    keepalive: Keepalive
    extend: Callable[[str, int], Call[Any]]

    def due(self) -> Call[Any] | None:
        """The extension to send before a data-plane request now, if one is due (it then
        counts as sent: report its outcome to :attr:`keepalive`)."""
        if not self.keepalive.claim():
            return None
        return self.extend(self.keepalive.name, self.keepalive.seconds)

    @property
    def sandbox_id(self) -> str:
        return self.target.sandbox_id

    def headers(self) -> dict[str, str]:
        return self.target.headers()


def validate_sandbox_path(
    path: str, *, allow_root: bool = False, allow_unsafe: bool = False
) -> str:
    """A sandbox-relative path, checked like upstream: no control characters, no empty name,
    no ``..`` segment. Returns the normalised relative path (``.`` for the root if allowed).

    ``allow_unsafe`` (a file operation's ``allow_unsafe_paths=True``) skips the name checks,
    as upstream does, but never the control characters: a CR/LF would end up in the upload's
    multipart headers (another file name, the framing in the content), a NUL in the runtime's
    system calls."""
    refuse_control_characters(path)
    if allow_unsafe:
        if not path:
            raise ValueError("The sandbox path is empty; name a file relative to the sandbox root.")
        return path.lstrip("/") or "."
    if not path.strip():
        if allow_root:
            return "."
        raise ValueError("The sandbox path is empty; name a file relative to the sandbox root.")
    if any(part == ".." for part in path.split("/")):
        raise ValueError(
            f"The sandbox path {path!r} contains '..'; paths must stay inside the sandbox root."
        )
    normalized = posixpath.normpath(path).lstrip("/")
    if not normalized or normalized == ".":
        if allow_root:
            return "."
        raise ValueError(f"The sandbox path {path!r} does not name a file.")
    return normalized


def data_request(
    method: str,
    endpoint: str,
    what: str,
    target: DataTarget,
    subject: str | None = None,
    *,
    headers: Mapping[str, str] | None = None,
    read_timeout: float | None = None,
    retryable: bool | None = None,
    params: Mapping[str, str] | None = None,
) -> RequestSpec:
    """A data-plane request to ``target`` (``GET``s are retryable unless ``retryable`` says;
    ``subject``: the sandbox path it is about)."""
    return RequestSpec(
        method,
        endpoint,
        what,
        params=dict(params or {}),
        headers={**target.headers(), **(headers or {})},
        retryable=method == "GET" if retryable is None else retryable,
        read_timeout=read_timeout,
        data_plane=True,
        subject=subject,
    )


_data = data_request


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


def _command_path(command_id: str, tail: str = "") -> str:
    if not isinstance(command_id, str) or not command_id or len(command_id) > 255:
        raise ValueError(
            f"command_id must be the non-empty id a command was started with, got {command_id!r}."
        )
    return f"/commands/{quote(command_id, safe='')}{tail}"


def start_command(
    target: DataTarget, body: Mapping[str, Any], *, stream: bool = False
) -> RequestSpec:
    """``POST /commands``: never retried (a command must not run twice); ``body`` carries a
    fresh ``request_id`` so that the runtime can deduplicate. ``stream``: ask for the streamed
    start (``Accept: application/x-ndjson``: the command id, then the command's events); a
    runtime without it answers ``{"command_id"}`` as usual."""
    if not stream:
        return json_body(_data("POST", "/commands", "start a command", target), dict(body))
    spec = _data(
        "POST",
        "/commands",
        "start a command",
        target,
        headers={"Accept": STREAMED_START_ACCEPT},
        read_timeout=EVENTS_DURATION + EVENTS_READ_MARGIN,
    )
    return json_body(spec, dict(body))


def command_status(target: DataTarget, command_id: str) -> RequestSpec:
    return _data("GET", _command_path(command_id), f"get command {command_id!r}", target)


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
    path = _command_path(command_id, "/events")
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
    return _data("POST", _command_path(command_id, "/kill"), f"kill command {command_id!r}", target)


def command_stdin(target: DataTarget, command_id: str, data: str | bytes, eof: bool) -> RequestSpec:
    """``POST /commands/{id}/stdin``: never retried (the data would be written twice); a body
    over :data:`STDIN_MAX_BODY` is refused before it is sent (:class:`StdinTooLargeError`).
    ``data``: text (``"data"``), or bytes (``"data_base64"``: a runtime with terminals)."""
    path = _command_path(command_id, "/stdin")
    spec = _data("POST", path, f"write to the stdin of command {command_id!r}", target)
    if isinstance(data, bytes):
        body: dict[str, Any] = {"data_base64": base64.b64encode(data).decode("ascii")}
    else:
        body = {"data": data}
    spec = json_body(spec, {**body, "eof": bool(eof)})
    size = len(spec.content or b"")  # the body exactly as the runtime counts it
    if size > STDIN_MAX_BODY:
        raise _stdin_too_large(spec, size, STDIN_MAX_BODY, "", request_sent=False)
    return spec


def resize_command(target: DataTarget, command_id: str, cols: int, rows: int) -> RequestSpec:
    """``POST /commands/{id}/resize``: a terminal's new size; retried like a ``GET`` (an
    absolute size: idempotent in effect)."""
    path = _command_path(command_id, "/resize")
    spec = _data("POST", path, f"resize the terminal of command {command_id!r}", target)
    return dataclasses.replace(json_body(spec, {"cols": cols, "rows": rows}), retryable=True)


def stdin_chunk(limit: int) -> int:
    """Characters of text that always fit one stdin write under ``limit`` bytes of body (JSON
    escaping makes a character at most 12 bytes), as a power of two (65536 for 1 MiB)."""
    room = max(1, (limit - 64) // 12)
    return 1 << (room.bit_length() - 1)


def _stdin_too_large(
    spec: RequestSpec, size: int, limit: int | None, answered: str, **common: Any
) -> StdinTooLargeError:
    chunk = stdin_chunk(limit if limit is not None else max(1, size // 2))
    over = (
        f"over the sandbox runtime's limit of {limit} bytes per request"
        if limit is not None
        else "too large for the sandbox runtime, which did not say its limit"
    )
    return StdinTooLargeError(
        f"Could not {spec.what}: the request would be {size} bytes (the data JSON-encoded), "
        f"{over}{answered}. Send it in chunks of at most {chunk} characters: one "
        "send_stdin(piece) per piece, eof=True with the last one (or send_stdin('', eof=True)).",
        limit=limit,
        size=size,
        method=spec.method,
        path=spec.path,
        **common,
    )


def stdin_refusal(spec: RequestSpec) -> Callable[[Exception], Exception | None]:
    """The ``fail`` of a stdin write: a refusal for its size (``413``, or ``400`` naming the
    size) is a :class:`StdinTooLargeError` with the limit the answer names, if any."""

    def fail(exc: Exception) -> Exception | None:
        status = getattr(exc, "status_code", None)
        detail = getattr(exc, "detail", None) or ""
        if not isinstance(exc, BrokerError) or not (
            status == 413 or (status == 400 and _SIZE.search(detail))
        ):
            return None
        found = _BYTES.search(detail)
        answered = f" (it answered {status}: {detail})" if detail else f" (it answered {status})"
        size = len(spec.content or b"")
        limit = int(found.group(1)) if found else None
        return _stdin_too_large(
            spec, size, limit, answered, status_code=status, code=exc.code, detail=exc.detail
        )

    return fail


def upload(target: DataTarget, path: str) -> RequestSpec:
    """``POST /upload``, without its body: the upload (``_upload.finish_spec``) adds the
    multipart framing's headers (:meth:`Multipart.headers`), and the retry rule (only a
    replayable body is retried) and read timeout of that body."""
    return _data("POST", "/upload", f"write {path!r}", target)


def download(target: DataTarget, path: str) -> RequestSpec:
    return _data("GET", f"/download/{quote(path, safe='')}", f"read {path!r}", target, path)


def list_files(target: DataTarget, path: str) -> RequestSpec:
    return _data("GET", f"/list/{quote(path, safe='')}", f"list {path!r}", target, path)


def exists(target: DataTarget, path: str) -> RequestSpec:
    what = f"check whether {path!r} exists"
    return _data("GET", f"/exists/{quote(path, safe='')}", what, target, path)


@dataclass(frozen=True)
class Multipart:
    """The framing of a ``multipart/form-data`` body whose last part is one file (field
    ``file``): ``prefix``, the file's bytes, ``suffix``."""

    prefix: bytes
    suffix: bytes
    content_type: str

    def length(self, content_length: int) -> int:
        """The body's length around ``content_length`` bytes of file."""
        return len(self.prefix) + content_length + len(self.suffix)

    def headers(self, content_length: int | None) -> dict[str, str]:
        """The body's headers: its type, and its ``Content-Length`` around
        ``content_length`` bytes of file (``None``: unknown, the body is chunked)."""
        if content_length is None:
            return {"Content-Type": self.content_type, "Transfer-Encoding": "chunked"}
        return {
            "Content-Type": self.content_type,
            "Content-Length": str(self.length(content_length)),
        }


def multipart_framing(
    filename: str, boundary: str | None = None, *, fields: Mapping[str, str] | None = None
) -> Multipart:
    """The one multipart framing of an upload: the text ``fields`` first (``/fs/write``'s
    ``path``), then the ``file`` part named ``filename`` (the legacy ``/upload``: the
    destination path). The filename is a quoted-string: ``\\`` and ``"`` are escaped with a
    backslash, which multipart parsers undo (a ``%22`` would be kept: another file's name). A
    random boundary is drawn again while a field holds it."""
    values = [(name, value.encode("utf-8")) for name, value in (fields or {}).items()]
    boundary = boundary or secrets.token_hex(16)
    while any(boundary.encode() in value for _, value in values):  # pragma: no cover
        boundary = secrets.token_hex(16)  # 128 random bits in a field
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        + value
        + b"\r\n"
        for name, value in values
    ]
    quoted = filename.replace("\\", "\\\\").replace('"', '\\"')
    file_part = (
        f"--{boundary}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="{quoted}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    suffix = f"\r\n--{boundary}--\r\n".encode()
    return Multipart(
        b"".join(parts) + file_part, suffix, f"multipart/form-data; boundary={boundary}"
    )


# --------------------------------------------------------------------------------------------
# Answers


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


def parse_file_entries(obj: Any, path: str) -> list[FileEntry]:
    what = f"list {path!r}"
    if not isinstance(obj, list):
        raise protocol_error(what, "the listing is not a JSON array")
    try:
        return [FileEntry.from_legacy(entry) for entry in obj]
    except (KeyError, TypeError, ValueError) as exc:
        raise protocol_error(what, f"bad listing entry ({exc})") from exc


def parse_exists(obj: Any, path: str) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("exists"), bool):
        raise protocol_error(f"check whether {path!r} exists", 'expected {"exists": true|false}')
    return bool(obj["exists"])


FILE_ERRORS: dict[str, type[SandboxFileError]] = {
    "path_not_found": SandboxFileNotFoundError,
    "path_exists": SandboxFileExistsError,
    "path_invalid": SandboxPathError,
    "path_outside_root": SandboxPathError,
    "path_is_root": SandboxPathError,
    "symlink_not_followed": SandboxPathError,
    "root_replaced": SandboxPathError,
    "file_too_large": SandboxFileLimitError,
    "too_many_entries": SandboxFileLimitError,
    "invalid_argument": SandboxFileError,
    "not_a_directory": SandboxFileError,
    "is_a_directory": SandboxFileError,
    "not_a_file": SandboxFileError,
    "not_empty": SandboxFileError,
    "cross_root": SandboxFileError,
    "permission_denied": SandboxFileError,
    "not_supported": SandboxFileError,
    "io_error": SandboxFileError,
}
"""The refusal codes of the runtime's file API (docs/broker-api.md, Files) and their error
classes; they share no value with the broker's own codes."""

FILE_API = "/fs/"
FILE_API_REQUIREMENT = (
    "a sandbox runtime with the file API (/fs/*: the deployed runtimes since v0.4.0, the local "
    "runtime)"
)


COMMAND_ERRORS = frozenset({"invalid_text"})
"""The refusal codes of the runtime's managed commands (``invalid_text``: an argv, envs, cwd or
stdin data that UTF-8 cannot carry); they share no value with the broker's own codes."""


def is_runtime_answer(status: int, code: str | None) -> bool:
    """Whether an error answer on the data plane is the sandbox runtime's own (passed through
    by the broker): no ``code`` (a 4xx), or one of the file API's or managed commands' codes."""
    return (code is None and 400 <= status < 500) or code in FILE_ERRORS or code in COMMAND_ERRORS


def _refused_path(body: bytes) -> str | None:
    """The ``path`` a file API refusal names (the one it concerns: a move's destination)."""
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        return None
    path = obj.get("path") if isinstance(obj, dict) else None
    return redact_answer(path) if isinstance(path, str) else None


def runtime_error(
    status: int, reason: str, spec: RequestSpec, common: Mapping[str, Any], body: bytes = b""
) -> BrokerError:
    """An error answer of the sandbox runtime itself, passed through: a ``410`` with
    ``resume_after`` (command output no longer retained) is a :class:`CommandOutputLostError`
    carrying the cursor to resume from; a file API refusal is its typed error (naming the path
    and the rule); a legacy 404 is a missing file."""
    if status == 410:
        return CommandOutputLostError(
            f"Could not {spec.what}: the sandbox runtime answered 410 ({reason}).",
            resume_after=_resume_after(body),
            **common,
        )
    code = common.get("code")
    subject = _refused_path(body) or spec.subject
    if spec.path.startswith(FILE_API) and status == 404 and code is None:
        return FileAPIUnsupportedError(
            f"Could not {spec.what}: the sandbox runtime has no {spec.path.split('?')[0]} "
            f"(404 without a code); this needs {FILE_API_REQUIREMENT}. Create the sandbox from "
            "a template with a newer runtime.",
            sandbox_path=subject,
            **common,
        )
    if code in FILE_ERRORS:
        return FILE_ERRORS[code](
            f"Could not {spec.what}: the sandbox runtime refused it ({status} {code}): {reason}.",
            sandbox_path=subject,
            **common,
        )
    hint = {
        404: "The path does not exist in the sandbox (or is not a file/directory as needed).",
        403: "The path escapes the sandbox's base directory; use a relative path inside it.",
    }.get(status, "See the runtime's detail.")
    cls = SandboxFileNotFoundError if status == 404 and subject is not None else BrokerError
    return cls(
        f"Could not {spec.what}: the sandbox runtime answered {status} ({reason}). {hint}",
        **common,
    )


def _resume_after(body: bytes) -> int | None:
    try:
        value = json.loads(body).get("resume_after")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def check_max_bytes(max_bytes: int | None) -> int | None:
    """``max_bytes`` of a download: ``None`` (no limit) or >= 0."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}.")
    return max_bytes


class DownloadMeter:
    """Counts a streamed download, enforces ``max_bytes`` and names a broken stream's error."""

    def __init__(self, spec: RequestSpec, src: str, max_bytes: int | None) -> None:
        self.spec = spec
        self.src = src
        self.max_bytes = check_max_bytes(max_bytes)
        self.total = 0

    def count(self, chunk: bytes) -> bytes:
        if self.max_bytes is not None and self.total + len(chunk) > self.max_bytes:
            raise SandboxError(
                f"The file {self.src!r} is larger than max_bytes={self.max_bytes}; raise the limit."
            )
        self.total += len(chunk)
        return chunk

    def error(self, exc: Exception, *, timed_out: bool) -> BrokerError:
        """The typed error for a stream broken by ``exc`` (``timed_out``: it stalled)."""
        spec = self.spec
        if not spec.retryable:  # the answer of a request that ran (a streamed start)
            how = "stalled" if timed_out else f"broke ({type(exc).__name__})"
            kind = RequestTimeoutError if timed_out else BrokerUnavailableError
            return kind(
                f"Could not {spec.what}: the connection {how} while its answer was read. The "
                "request reached the sandbox; it is not retried because it is not idempotent "
                "(a command could run twice). Retry if that is safe.",
                method=spec.method,
                path=spec.path,
            )
        if timed_out:
            return RequestTimeoutError(
                f"Could not read {self.src!r}: the download stalled after {self.total} bytes. "
                "Retry, or pass a larger timeout=.",
                method=spec.method,
                path=spec.path,
            )
        return BrokerUnavailableError(
            f"Could not read {self.src!r}: the connection broke after {self.total} bytes "
            f"({type(exc).__name__}). Retry the download.",
            method=spec.method,
            path=spec.path,
        )
