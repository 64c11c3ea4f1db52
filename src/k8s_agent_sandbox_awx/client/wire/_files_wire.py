"""The legacy file endpoints (``/upload``, ``/download``, ``/list``, ``/exists``, no I/O): the
path rules every file operation checks, their requests and answers, and the meter of a streamed
download (``max_bytes``, a broken stream's error). The file API (``/fs/*``) is ``core/_fsapi``.
"""

from __future__ import annotations

import posixpath
from typing import Any
from urllib.parse import quote

from ..._upstream import FileEntry, SandboxError
from ...errors import BrokerError, BrokerUnavailableError, RequestTimeoutError
from ._dataplane import DataTarget
from ._dataplane import data_request as _data
from ._protocol import RequestSpec, protocol_error

__all__ = [
    "FILE_API",
    "FILE_API_REQUIREMENT",
    "DownloadMeter",
    "check_max_bytes",
    "download",
    "exists",
    "list_files",
    "parse_exists",
    "parse_file_entries",
    "refuse_control_characters",
    "upload",
    "validate_sandbox_path",
]


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


FILE_API = "/fs/"


FILE_API_REQUIREMENT = (
    "a sandbox runtime with the file API (/fs/*: the deployed runtimes since v0.4.0, the local "
    "runtime)"
)


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
