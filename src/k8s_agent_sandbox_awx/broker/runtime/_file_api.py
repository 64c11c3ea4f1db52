"""The file API's endpoints (``/fs/*``), as the deployed runtimes speak them.

The runtime's server (:mod:`._server`) routes ``GET`` requests for :data:`GET_ROUTES` and
``POST`` requests for :data:`POST_ROUTES` to :func:`handle`; the contract is docs/broker-api.md
("Files"). Paths are checked by :func:`._paths.check_path` (the rules are in :mod:`._paths`),
the operations are :mod:`._files` and :mod:`._watch`. Refusals are JSON ``{"detail", "code",
"path"}`` with the codes of :data:`._paths.ERROR_CODES`.

Standard library only (``python-multipart`` is imported on the first ``POST /fs/write``, as the
legacy ``/upload`` does: :mod:`._multipart`).
"""

from __future__ import annotations

import contextlib
import os
import stat
import urllib.parse
from collections.abc import Callable
from typing import Any

from . import _files, _watch
from ._http import Exchange, body_chunks, read_json, send_file, send_json
from ._multipart import FileWriter, PartFile, boundary_of, read_form
from ._paths import (
    MAX_PATH_CHARS,
    FsError,
    Roots,
    SandboxPath,
    check_path,
    lstat,
    open_dir,
    refusal,
)

GET_ROUTES = frozenset({"/fs/read", "/fs/list", "/fs/exists", "/fs/info", "/fs/watch"})
POST_ROUTES = frozenset({"/fs/write", "/fs/mkdir", "/fs/move", "/fs/remove"})


def handle(exchange: Exchange) -> None:
    """Serve one request for a route in GET_ROUTES or POST_ROUTES."""
    route = urllib.parse.urlsplit(exchange.path).path
    if route == "/fs/write":  # the body is streamed to disk
        _write(exchange)
        return
    try:
        if exchange.command == "POST":
            _POST[route](exchange, _json_body(exchange))
        else:
            _GET[route](exchange, _query(exchange))
    except FsError as exc:
        send_json(exchange, exc.status, exc.body())
    except (BrokenPipeError, ConnectionResetError):
        exchange.close_connection = True  # the client went away
    except OSError as exc:  # an unexpected file-system failure: still a JSON answer
        failure = FsError("io_error", f"{route} failed: {exc.strerror or exc}")
        send_json(exchange, failure.status, failure.body(), close=True)


def _json_body(exchange: Exchange) -> dict[str, Any]:
    try:
        body = read_json(exchange)
    except (ValueError, ConnectionError) as exc:
        exchange.close_connection = True
        raise FsError("invalid_argument", f"the body must be a JSON object: {exc}") from None
    if not isinstance(body, dict):
        raise FsError("invalid_argument", "the body must be a JSON object")
    return body


def _query(exchange: Exchange) -> dict[str, str]:
    raw = urllib.parse.urlsplit(exchange.path).query
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise FsError("path_invalid", "the query is not valid UTF-8 after URL decoding") from None
    out: dict[str, str] = {}
    for key, value in pairs:
        if key in out:
            raise FsError("invalid_argument", f"query parameter {key!r} is given twice")
        out[key] = value
    return out


def _target(exchange: Exchange, args: dict[str, Any], field: str = "path") -> SandboxPath:
    if field not in args:
        raise FsError("invalid_argument", f"{field!r} is required")
    return check_path(args[field], exchange.fs_roots, field)


def _flag(args: dict[str, Any], name: str) -> bool:
    value = args.get(name, False)
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("", "0", "false", "no"):
            return False
    elif isinstance(value, bool):
        return value
    raise FsError("invalid_argument", f"{name!r} must be a boolean (true or false), not {value!r}")


# -- GET -----------------------------------------------------------------------------------------
def _get_read(exchange: Exchange, args: dict[str, str]) -> None:
    fd, size = _files.open_for_read(_target(exchange, args))
    with os.fdopen(fd, "rb", buffering=0) as fh:
        send_file(exchange, fh, size)


def _get_list(exchange: Exchange, args: dict[str, str]) -> None:
    send_json(exchange, 200, _files.list_dir(_target(exchange, args)))


def _get_exists(exchange: Exchange, args: dict[str, str]) -> None:
    send_json(exchange, 200, {"exists": _files.exists(_target(exchange, args))})


def _get_info(exchange: Exchange, args: dict[str, str]) -> None:
    send_json(exchange, 200, _files.info_of(_target(exchange, args)))


def _get_watch(exchange: Exchange, args: dict[str, str]) -> None:
    target = _target(exchange, args)
    recursive = _flag(args, "recursive")
    limit = _watch.MAX_WATCH_SECONDS
    try:
        duration = float(args.get("duration", limit))
    except ValueError:
        duration = -1.0
    if not 0 < duration <= limit:
        raise FsError(
            "invalid_argument",
            f"duration must be a number of seconds, more than 0 and at most {limit:g}",
        )
    _watch.stream(exchange, target, recursive, duration)


# -- POST ----------------------------------------------------------------------------------------
def _post_mkdir(exchange: Exchange, body: dict[str, Any]) -> None:
    send_json(exchange, 200, {"created": _files.make_dir(_target(exchange, body))})


def _post_move(exchange: Exchange, body: dict[str, Any]) -> None:
    source = _target(exchange, body, "source")
    destination = _target(exchange, body, "destination")
    send_json(exchange, 200, _files.move(source, destination, _flag(body, "overwrite")))


def _post_remove(exchange: Exchange, body: dict[str, Any]) -> None:
    target = _target(exchange, body)
    send_json(exchange, 200, {"removed": _files.remove(target, _flag(body, "recursive"))})


_GET: dict[str, Callable[[Exchange, dict[str, str]], None]] = {
    "/fs/read": _get_read,
    "/fs/list": _get_list,
    "/fs/exists": _get_exists,
    "/fs/info": _get_info,
    "/fs/watch": _get_watch,
}
_POST: dict[str, Callable[[Exchange, dict[str, Any]], None]] = {
    "/fs/mkdir": _post_mkdir,
    "/fs/move": _post_move,
    "/fs/remove": _post_remove,
}


# -- write ---------------------------------------------------------------------------------------
class _Write(FileWriter):
    """One ``POST /fs/write`` (a :class:`._multipart.Form`): the ``path`` field, then the
    ``file`` part, streamed to a temporary file beside the target and renamed over it at the
    part's end."""

    def __init__(self, roots: Roots) -> None:
        super().__init__()
        self.roots = roots
        self.part: str | None = None
        self.path_value = bytearray()
        self.target: SandboxPath | None = None
        self.result: dict[str, Any] | None = None

    def begin(self, disposition: dict[bytes, bytes]) -> None:
        name = disposition.get(b"name", b"").decode("utf-8", "replace")
        if name == "path":
            if self.path_value:
                raise FsError("invalid_argument", "the 'path' field is given twice")
            self.part = "path"
        elif name == "file":
            if self.result is not None or self.file is not None:
                raise FsError("invalid_argument", "one 'file' part per request")
            if not self.path_value:
                raise FsError(
                    "invalid_argument",
                    "the 'path' field must come before the 'file' part (multipart order)",
                )
            self._open_destination()
            self.part = "file"
        else:
            self.part = None  # unknown parts are read and ignored

    def _open_destination(self) -> None:
        try:
            raw = self.path_value.decode("utf-8")
        except UnicodeDecodeError:
            raise FsError("path_invalid", "the 'path' field is not UTF-8") from None
        target = check_path(raw, self.roots)
        if target.is_root:
            raise FsError("is_a_directory", f"{target.display} is a directory", raw)
        self.target = target
        self.parent = open_dir(target, target.parts[:-1], create=True)
        st = lstat(target.parts[-1], self.parent)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise FsError("is_a_directory", f"{target.display} is a directory", raw)
        self.file = PartFile(self.parent, _files.WRITE_TMP_PREFIX, 0o666)
        if st is not None and stat.S_ISREG(st.st_mode):  # a replaced file keeps its mode
            assert self.file.out is not None
            os.fchmod(self.file.out, stat.S_IMODE(st.st_mode))

    def data(self, data: memoryview) -> None:
        if self.part == "path":
            self.path_value += data
            if len(self.path_value) > MAX_PATH_CHARS * 4:
                raise FsError("path_invalid", f"the 'path' field is over {MAX_PATH_CHARS} chars")
        elif self.part == "file" and self.file is not None:
            self.file.write(data)

    def end(self) -> None:
        if self.part == "file" and self.file is not None:
            assert self.target is not None and self.parent is not None
            name = self.target.parts[-1]
            self.file.commit(name)
            self.file = None
            self.result = _files.entry_info(name, self.parent, self.target.display)
        self.part = None

    def failed(self, exc: Exception) -> FsError:
        """The refusal an exception raised while a chunk was parsed means."""
        if isinstance(exc, FsError):
            return exc
        if isinstance(exc, OSError):
            return refusal(exc, self.target) if self.target else FsError("io_error", str(exc))
        if isinstance(exc, ValueError):
            return FsError("invalid_argument", f"malformed multipart body: {exc}")
        raise exc


def _write(exchange: Exchange) -> None:
    boundary = boundary_of(exchange.headers.get("Content-Type", ""))
    state = _Write(exchange.fs_roots)
    refused: FsError | None = None
    if boundary is None:
        refused = FsError(
            "invalid_argument",
            "fs/write takes multipart/form-data with a 'path' field and a 'file' part",
        )
    try:
        failure = read_form(boundary, body_chunks(exchange), state, state.failed, refused)
        if failure is None and state.result is None:
            failure = FsError("invalid_argument", "the body has no 'file' part")
    except (ConnectionError, ValueError) as exc:
        failure = FsError("invalid_argument", f"the body ended early: {exc}")
        exchange.close_connection = True
    finally:
        state.cleanup()
    if failure is not None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # client may be gone
            send_json(exchange, failure.status, failure.body(), close=True)
        return
    send_json(exchange, 200, state.result)
