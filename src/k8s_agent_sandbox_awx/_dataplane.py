"""The data plane: the sandbox runtime's endpoints, proxied by the broker (no I/O).

Shared by every dialect: a dialect only says which headers route a request to its sandbox
(:meth:`Dialect.data_target`); the paths, bodies, answers and the runtime's own errors are
decided here, once. Today these are the legacy python-runtime endpoints (``/execute``,
``/upload``, ``/download``, ``/list``, ``/exists``).
"""

from __future__ import annotations

import math
import posixpath
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

from ._protocol import RequestSpec, json_body, protocol_error, seconds
from ._upstream import ExecutionResult, FileEntry, SandboxError
from .errors import BrokerError, BrokerUnavailableError, RequestTimeoutError

__all__ = [
    "COMMAND_TIMEOUT_MARGIN",
    "MAX_COMMAND_TIMEOUT",
    "MAX_SANDBOX_TIMEOUT",
    "DataTarget",
    "DownloadMeter",
    "Multipart",
    "download",
    "execute",
    "exists",
    "list_files",
    "multipart_framing",
    "parse_execution_result",
    "parse_exists",
    "parse_file_entries",
    "runtime_error",
    "upload",
    "validate_sandbox_path",
]

COMMAND_TIMEOUT_MARGIN = 10.0
"""Seconds the client waits for an answer beyond a command's own time limit."""
MAX_SANDBOX_TIMEOUT = 86400.0
"""The largest ``X-Sandbox-Timeout`` the broker accepts (seconds it waits for a runtime)."""
MAX_COMMAND_TIMEOUT = MAX_SANDBOX_TIMEOUT - COMMAND_TIMEOUT_MARGIN / 2
"""The longest command time limit: the client sends ``X-Sandbox-Timeout`` = limit + 5 s."""


class DataTarget(Protocol):
    """Where a data-plane request goes: a dialect's routing headers for one sandbox."""

    @property
    def sandbox_id(self) -> str: ...

    def headers(self) -> dict[str, str]: ...


def validate_sandbox_path(
    path: str, *, allow_root: bool = False, allow_unsafe: bool = False
) -> str:
    """A sandbox-relative path, checked like upstream: no control characters, no empty name,
    no ``..`` segment. Returns the normalised relative path (``.`` for the root if allowed).

    ``allow_unsafe`` (a file operation's ``allow_unsafe_paths=True``) skips the name checks,
    as upstream does, but never the control characters: a CR/LF would end up in the upload's
    multipart headers (another file name, the framing in the content), a NUL in the runtime's
    system calls."""
    if not isinstance(path, str):
        raise TypeError(f"A sandbox path must be a str, got {type(path).__name__}.")
    bad = next((i for i, c in enumerate(path) if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(
            f"The sandbox path {path!r} contains a control character (U+{ord(path[bad]):04X} "
            f"at index {bad}). Paths must not contain control characters (U+0000-U+001F, "
            "U+007F), even with allow_unsafe_paths=True; remove them."
        )
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


def _data(
    method: str,
    endpoint: str,
    what: str,
    target: DataTarget,
    *,
    headers: Mapping[str, str] | None = None,
    read_timeout: float | None = None,
    retryable: bool | None = None,
) -> RequestSpec:
    return RequestSpec(
        method,
        endpoint,
        what,
        headers={**target.headers(), **(headers or {})},
        retryable=method == "GET" if retryable is None else retryable,
        read_timeout=read_timeout,
        data_plane=True,
    )


def execute(target: DataTarget, command: str, *, command_timeout: float) -> RequestSpec:
    """``POST /execute``: never retried (it is not idempotent)."""
    if not isinstance(command, str) or not command.strip():
        raise ValueError("The command is empty; pass the command line to run, e.g. 'echo hi'.")
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
            "(e.g. `sh -c 'nohup CMD > out.log 2>&1 &'`) and poll for its result."
        )
    spec = _data(
        "POST",
        "/execute",
        "run a command",
        target,
        headers={"X-Sandbox-Timeout": seconds(command_timeout + COMMAND_TIMEOUT_MARGIN / 2)},
        read_timeout=command_timeout + COMMAND_TIMEOUT_MARGIN,
    )
    return json_body(spec, {"command": command, "timeout_seconds": command_timeout})


def upload(
    target: DataTarget,
    path: str,
    multipart: Multipart,
    *,
    size: int | None,
    replayable: bool,
    read_timeout: float | None = None,
) -> RequestSpec:
    """``POST /upload``; the body (``multipart.prefix``, ``size`` content bytes or a chunked
    stream, ``.suffix``) is added by the I/O layer; retried only if it is ``replayable``."""
    length = (
        {"Content-Length": str(multipart.length(size))}
        if size is not None
        else {"Transfer-Encoding": "chunked"}
    )
    return _data(
        "POST",
        "/upload",
        f"write {path!r}",
        target,
        headers={"Content-Type": multipart.content_type, **length},
        read_timeout=read_timeout,
        retryable=replayable,
    )


def download(target: DataTarget, path: str) -> RequestSpec:
    return _data("GET", f"/download/{quote(path, safe='')}", f"read {path!r}", target)


def list_files(target: DataTarget, path: str) -> RequestSpec:
    return _data("GET", f"/list/{quote(path, safe='')}", f"list {path!r}", target)


def exists(target: DataTarget, path: str) -> RequestSpec:
    return _data("GET", f"/exists/{quote(path, safe='')}", f"check whether {path!r} exists", target)


@dataclass(frozen=True)
class Multipart:
    """Framing of a single-file ``multipart/form-data`` body (field ``file``)."""

    prefix: bytes
    suffix: bytes
    content_type: str

    def length(self, content_length: int) -> int:
        return len(self.prefix) + content_length + len(self.suffix)


def multipart_framing(path: str, boundary: str | None = None) -> Multipart:
    boundary = boundary or secrets.token_hex(16)
    # The filename is the destination path, a quoted-string: '\\' and '"' are escaped with a
    # backslash, which multipart parsers undo (a "%22" would be kept: another file's name).
    filename = path.replace("\\", "\\\\").replace('"', '\\"')
    prefix = (
        f"--{boundary}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    suffix = f"\r\n--{boundary}--\r\n".encode()
    return Multipart(prefix, suffix, f"multipart/form-data; boundary={boundary}")


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


def runtime_error(
    status: int, reason: str, spec: RequestSpec, common: Mapping[str, Any]
) -> BrokerError:
    """An error answer of the sandbox runtime itself (no broker error code), passed through."""
    hint = {
        404: "The path does not exist in the sandbox (or is not a file/directory as needed).",
        403: "The path escapes the sandbox's base directory; use a relative path inside it.",
    }.get(status, "See the runtime's detail.")
    return BrokerError(
        f"Could not {spec.what}: the sandbox runtime answered {status} ({reason}). {hint}",
        **common,
    )


class DownloadMeter:
    """Counts a streamed download, enforces ``max_bytes`` and names a broken stream's error."""

    def __init__(self, spec: RequestSpec, src: str, max_bytes: int | None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}.")
        self.spec = spec
        self.src = src
        self.max_bytes = max_bytes
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
