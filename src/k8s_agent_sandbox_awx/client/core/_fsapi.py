"""A sandbox's files, without I/O: the runtime's file API (``/fs/*``, docs/broker-api.md
"Files") with the legacy endpoints (``/upload``, ``/download``, ``/list``, ``/exists``) as the
fallback when a runtime lacks it, written once for the sync and the async ``files``.

Each operation is a generator of :class:`Call`s (an ``Op``, ``_steps``), run by the transports'
``run``. A runtime without the file API answers its paths with ``404`` and no ``code``
(:class:`FileAPIUnsupportedError`): the operation is sent again to the legacy endpoint if it
has one, and the sandbox's :class:`FileAPI` remembers it, so later operations go there at once;
the operations without a legacy equivalent raise the error, naming the requirement. Paths
follow the runtime's rules (``/app/...``, ``/workspace/...`` or relative to ``/app``); the
client only refuses control characters. Also here: :class:`FileInfo`, the watch events and the
state of a watch across reconnections.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import posixpath
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, cast

from ...errors import (
    BrokerUnavailableError,
    FileAPIUnsupportedError,
    RequestTimeoutError,
    SandboxFileError,
    SandboxFileLimitError,
)
from ..wire import _dataplane as dp
from ..wire import _files_wire as files_wire
from ..wire import _multipart as multipart
from ..wire import _protocol as proto
from . import _upload as up
from ._steps import Call, Learned, Op, learning

__all__ = [
    "FileAPI",
    "FileInfo",
    "Watch",
    "WatchEvent",
    "exists",
    "get_info",
    "list_dir",
    "make_dir",
    "move",
    "read",
    "remove",
    "write",
    "write_many",
]

T = TypeVar("T")
ReadFormat = Literal["bytes", "text", "stream"]
MAX_WATCH_SEGMENT = 20.0
"""The longest single ``GET /fs/watch`` (the runtime's limit); a watch reconnects after it."""
WATCH_RECONNECTS = 3
"""Broken watch connections in a row that are reconnected before the error is raised."""


# --------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class FileInfo:
    """A file, directory or link in the sandbox, as the runtime reports it.

    ``type`` is ``file``, ``directory``, ``symlink`` or ``other``; ``mod_time`` seconds since
    the epoch; ``permissions`` the mode bits (``0o644``); ``modified_ns`` and
    ``symlink_target`` when the runtime says; ``extra``: fields the client does not know.
    Through the legacy endpoints (no file API) ``permissions``/``modified_ns`` are ``None``.
    ``modified`` and ``mode`` give upstream ``FileEntry``'s spellings."""

    name: str
    path: str
    type: str
    size: int
    mod_time: float | None = None
    permissions: int | None = None
    modified_ns: int | None = None
    symlink_target: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def modified(self) -> datetime | None:
        """``mod_time`` as an aware datetime (upstream ``FileEntry.modified``)."""
        return None if self.mod_time is None else datetime.fromtimestamp(self.mod_time, UTC)

    @property
    def mode(self) -> str | None:
        """``permissions`` as octal text, e.g. ``"0644"`` (upstream ``FileEntry.mode``)."""
        return None if self.permissions is None else f"{self.permissions:04o}"

    @property
    def is_dir(self) -> bool:
        return self.type == "directory"

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**self.extra, **out}


_KNOWN = ("name", "path", "type", "size", "mod_time", "permissions", "modified_ns")


def parse_info(obj: Any, what: str, directory: str | None = None) -> FileInfo:
    """A FileInfo from the runtime's JSON (``directory``: a legacy listing's, for the path)."""
    if not isinstance(obj, dict):
        raise proto.protocol_error(what, "a FileInfo is not a JSON object", "the file API")
    try:
        name = str(obj["name"])
        path = obj.get("path")
        if path is None:
            path = posixpath.join(directory or ".", name)
        mod_time = obj.get("mod_time")
        perms, ns = obj.get("permissions"), obj.get("modified_ns")
        info = FileInfo(
            name=name,
            path=str(path),
            type=str(obj["type"]),
            size=int(obj.get("size") or 0),
            mod_time=None if mod_time is None else float(mod_time),
            permissions=None if perms is None else int(perms),
            modified_ns=None if ns is None else int(ns),
            symlink_target=obj.get("symlink_target"),
            extra={k: v for k, v in obj.items() if k not in (*_KNOWN, "symlink_target")},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise proto.protocol_error(what, f"bad FileInfo ({exc!r})", "the file API") from exc
    return info


@dataclass(frozen=True)
class WatchEvent:
    """A change in a watched directory: ``type`` is ``created``, ``modified`` or ``removed``;
    ``path`` the sandbox path; ``entry`` its FileInfo (for ``removed``, the last one seen)."""

    type: str
    path: str
    entry: FileInfo | None


FILE_API = "file_api"
"""The feature ``/fs/*`` is (a :class:`~._steps.Learned` step names it)."""


class FileAPI:
    """One sandbox's file endpoints: its data target and whether its runtime has the file API
    (``None`` until an answer tells). The operations yield what they find out
    (:class:`~._steps.Learned`); :meth:`record` keeps it, the one place it changes (each
    operation below hands it over: :func:`_learns`)."""

    def __init__(self, target: dp.DataTarget) -> None:
        self.target = target
        self.has_fs: bool | None = None

    def record(self, learned: Learned) -> None:
        if learned.feature == FILE_API:
            self.has_fs = learned.present


P = ParamSpec("P")


def _learns(
    operation: Callable[Concatenate[FileAPI, P], Op[T]],
) -> Callable[Concatenate[FileAPI, P], Op[T]]:
    """``operation`` with what it learns about the runtime kept by its :class:`FileAPI`."""

    def kept(api: FileAPI, *args: P.args, **kwargs: P.kwargs) -> Op[T]:
        return learning(operation(api, *args, **kwargs), api.record)

    return cast(Callable[Concatenate[FileAPI, P], Op[T]], functools.wraps(operation)(kept))


# --------------------------------------------------------------------------------------------
# Paths and requests


def fs_path(path: str) -> str:
    """A path for the file API: the runtime's rules apply; the client refuses control
    characters and an empty path."""
    files_wire.refuse_control_characters(path)
    if not path:
        raise ValueError(
            "The sandbox path is empty; name a file, e.g. 'data.txt' (relative to /app), "
            "'/app/data.txt' or '/workspace/data.txt'."
        )
    return path


def legacy_path(path: str, *, allow_root: bool = False, allow_unsafe: bool = False) -> str:
    """``path`` for the legacy endpoints (relative to the base directory, ``/app``)."""
    if path == "/app" or path.startswith("/app/"):
        path = path[len("/app") :] or ("." if allow_root else "")
    elif path == "/workspace" or path.startswith("/workspace/"):
        raise FileAPIUnsupportedError(
            f"The sandbox path {path!r} is in /workspace, which the runtime's legacy endpoints "
            f"cannot reach: this needs {files_wire.FILE_API_REQUIREMENT}.",
            sandbox_path=path,
        )
    return files_wire.validate_sandbox_path(path, allow_root=allow_root, allow_unsafe=allow_unsafe)


def _timed(spec: proto.RequestSpec, timeout: float | None) -> proto.RequestSpec:
    """``spec`` with ``timeout`` (seconds) to read its answer."""
    if timeout is None:
        return spec
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}.")
    return dataclasses.replace(spec, read_timeout=float(timeout))


def _get(api: FileAPI, endpoint: str, what: str, path: str, **params: str) -> proto.RequestSpec:
    spec = dp.data_request("GET", endpoint, what, api.target, path)
    return dataclasses.replace(spec, params={"path": path, **params})


def _post(
    api: FileAPI, endpoint: str, what: str, path: str, body: Any, *, retryable: bool = False
) -> proto.RequestSpec:
    spec = dp.data_request("POST", endpoint, what, api.target, path)
    return proto.json_body(dataclasses.replace(spec, retryable=retryable), body)


def _json(parse: Callable[[Any, str], T], what: str) -> Callable[[proto.Reply], T]:
    return lambda reply: parse(proto.parse_json(reply.content, what), what)


def _flag(key: str) -> Callable[[Any, str], bool]:
    def parse(obj: Any, what: str) -> bool:
        if not isinstance(obj, dict) or not isinstance(obj.get(key), bool):
            raise proto.protocol_error(what, f'expected {{"{key}": true|false}}', "the file API")
        return bool(obj[key])

    return parse


def _info_list(directory: str) -> Callable[[Any, str], list[FileInfo]]:
    def parse(obj: Any, what: str) -> list[FileInfo]:
        if not isinstance(obj, list):
            raise proto.protocol_error(what, "the listing is not a JSON array", "the file API")
        return [parse_info(entry, what, directory) for entry in obj]

    return parse


def _unsupported(what: str, path: str) -> FileAPIUnsupportedError:
    return FileAPIUnsupportedError(
        f"Could not {what}: the sandbox runtime has no file API (/fs/*), and this operation has "
        f"no legacy equivalent; it needs {files_wire.FILE_API_REQUIREMENT}.",
        sandbox_path=path,
    )


# --------------------------------------------------------------------------------------------
# Operations


def _either(
    has_fs: bool | None, call: Call[T], legacy: Callable[[], Call[T]] | None, path: str
) -> Op[T]:
    """``call`` on the file API, else (a runtime without it: ``has_fs`` is ``False``, or the
    answer says so) ``legacy()``, if there is one; what the answer tells is learned."""
    if has_fs is not False:
        try:
            result: T = yield call
        except FileAPIUnsupportedError:
            yield Learned(FILE_API, False)
            if legacy is None:
                raise
        else:
            yield Learned(FILE_API, True)
            return result
    if legacy is None:
        raise _unsupported(call.spec.what, path)
    fallback: T = yield legacy()
    return fallback


Opened = tuple[proto.RequestSpec, proto.Reply]
"""A read's request and its answer (unread for a stream)."""


def _opened(spec: proto.RequestSpec, stream: bool) -> Call[Opened]:
    return Call(spec, lambda reply: (spec, reply), stream=stream)


@_learns
def read(
    api: FileAPI, path: str, timeout: float | None, allow_unsafe: bool, *, stream: bool
) -> Op[Opened]:
    """``GET /fs/read``; a file over the runtime's read limit, or a runtime without the file
    API: ``GET /download/...`` (no limit) when the path is in ``/app``."""
    call = _opened(_timed(_get(api, "/fs/read", f"read {path!r}", fs_path(path)), timeout), stream)

    def legacy() -> Call[Opened]:
        src = legacy_path(path, allow_unsafe=allow_unsafe)
        return _opened(_timed(files_wire.download(api.target, src), timeout), stream)

    try:
        return (yield from _either(api.has_fs, call, legacy, path))
    except SandboxFileLimitError as exc:
        if exc.code != "file_too_large":
            raise
        try:
            fallback = legacy()
        except FileAPIUnsupportedError:
            raise exc from None
        opened: Opened = yield fallback
        return opened


def decoded(opened: Opened, format: str) -> bytes | str:
    """A whole file's answer as ``format`` (``bytes`` or ``text``, UTF-8)."""
    content = opened[1].content
    return content.decode("utf-8") if format == "text" else content


def read_format(format: Any) -> ReadFormat:
    if format not in ("bytes", "text", "stream"):
        raise ValueError(f"format must be 'bytes', 'text' or 'stream', got {format!r}.")
    result: ReadFormat = format
    return result


def _legacy_written(path: str) -> Callable[[proto.Reply], FileInfo]:
    def parse(reply: proto.Reply) -> FileInfo:
        obj = proto.parse_json(reply.content, f"write {path!r}")
        size = obj.get("size") if isinstance(obj, dict) else None
        name = posixpath.basename(path)
        return FileInfo(name=name, path=path, type="file", size=int(size or 0))

    return parse


@_learns
def write(
    api: FileAPI,
    path: str,
    content: Any,
    timeout: float | None,
    *,
    allow_unsafe: bool = False,
    allow_async: bool = False,
) -> Op[FileInfo]:
    """``POST /fs/write`` (atomic replace, parents created), else ``POST /upload``. A one-shot
    stream is sent once: while it is unknown whether the runtime has the file API, it is asked
    first (``GET /fs/exists``)."""
    what = f"write {fs_path(path)!r}"
    framing = multipart.multipart_framing("file", fields={"path": path})
    body = up.plan_body(framing, content, allow_async=allow_async)
    has_fs = api.has_fs
    if has_fs is None and not body.replayable:
        try:
            yield Call(_get(api, "/fs/exists", what, "."), proto.raw)
            has_fs = True
        except FileAPIUnsupportedError:
            has_fs = False
        yield Learned(FILE_API, has_fs)
    spec = up.finish_spec(
        dp.data_request("POST", "/fs/write", what, api.target, path), body, timeout
    )

    def legacy() -> Call[FileInfo]:
        dest = legacy_path(path, allow_unsafe=allow_unsafe)
        legacy_body = dataclasses.replace(body, framing=multipart.multipart_framing(dest))
        legacy_spec = up.finish_spec(files_wire.upload(api.target, dest), legacy_body, timeout)
        return Call(legacy_spec, _legacy_written(dest), body=legacy_body)

    parse = _json(lambda obj, w: parse_info(obj, w), what)
    return (yield from _either(has_fs, Call(spec, parse, body=body), legacy, path))


@_learns
def write_many(
    api: FileAPI, items: Iterable[Any], timeout: float | None, *, allow_async: bool = False
) -> Op[list[FileInfo]]:
    """A batch ``write([(path, data), ...])``: one after the other, in order."""
    results = []
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise TypeError(
                "A batch write takes (path, data) pairs, e.g. write([('a.txt', b'1')]); got "
                f"{type(item).__name__}."
            )
        results.append((yield from write(api, item[0], item[1], timeout, allow_async=allow_async)))
    return results


@_learns
def list_dir(api: FileAPI, path: str, timeout: float | None) -> Op[list[FileInfo]]:
    """``GET /fs/list`` (sorted by name), else ``GET /list/...``."""
    what = f"list {fs_path(path)!r}"
    call = Call(_timed(_get(api, "/fs/list", what, path), timeout), _json(_info_list(path), what))

    def legacy() -> Call[list[FileInfo]]:
        src = legacy_path(path, allow_root=True)
        return Call(
            _timed(files_wire.list_files(api.target, src), timeout), _json(_info_list(path), what)
        )

    return (yield from _either(api.has_fs, call, legacy, path))


@_learns
def exists(api: FileAPI, path: str, timeout: float | None) -> Op[bool]:
    """``GET /fs/exists``, else ``GET /exists/...``."""
    what = f"check whether {fs_path(path)!r} exists"
    parse = _json(_flag("exists"), what)
    call = Call(_timed(_get(api, "/fs/exists", what, path), timeout), parse)

    def legacy() -> Call[bool]:
        src = legacy_path(path, allow_root=True)
        return Call(_timed(files_wire.exists(api.target, src), timeout), parse)

    return (yield from _either(api.has_fs, call, legacy, path))


@_learns
def get_info(api: FileAPI, path: str, timeout: float | None) -> Op[FileInfo]:
    what = f"get information about {fs_path(path)!r}"
    call = Call(_timed(_get(api, "/fs/info", what, path), timeout), _json(parse_info, what))
    return (yield from _either(api.has_fs, call, None, path))


@_learns
def make_dir(api: FileAPI, path: str, timeout: float | None) -> Op[bool]:
    what = f"make the directory {fs_path(path)!r}"
    # retryable: creating an existing directory again answers false
    spec = _timed(_post(api, "/fs/mkdir", what, path, {"path": path}, retryable=True), timeout)
    return (yield from _either(api.has_fs, Call(spec, _json(_flag("created"), what)), None, path))


@_learns
def move(
    api: FileAPI, source: str, destination: str, overwrite: bool, timeout: float | None
) -> Op[FileInfo]:
    what = f"move {fs_path(source)!r} to {fs_path(destination)!r}"
    body = {"source": source, "destination": destination, "overwrite": bool(overwrite)}
    spec = _timed(_post(api, "/fs/move", what, source, body), timeout)  # never retried
    return (yield from _either(api.has_fs, Call(spec, _json(parse_info, what)), None, source))


@_learns
def remove(api: FileAPI, path: str, recursive: bool, timeout: float | None) -> Op[bool]:
    what = f"remove {fs_path(path)!r}"
    body = {"path": path, "recursive": recursive}
    # retryable: a replayed remove answers false
    spec = _timed(_post(api, "/fs/remove", what, path, body, retryable=True), timeout)
    return (yield from _either(api.has_fs, Call(spec, _json(_flag("removed"), what)), None, path))


# --------------------------------------------------------------------------------------------
# Watching a directory


class Watch:
    """One ``watch_dir``: the ``GET /fs/watch`` segments to request (each at most 20 s, until
    ``timeout``; ``None``: until closed), and the events of their NDJSON lines. Each segment
    starts with a snapshot: the first one is the baseline, a later one (after a reconnection)
    is diffed against what was known, so no change between two segments is lost."""

    def __init__(
        self,
        api: FileAPI,
        path: str,
        timeout: float | None,
        recursive: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api, self.path, self.recursive = api, fs_path(path), bool(recursive)
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}.")
        self._clock = clock
        self.deadline = None if timeout is None else clock() + float(timeout)
        self.known: dict[str, FileInfo] | None = None
        self.base = path
        self.failures = 0

    def next_spec(self) -> proto.RequestSpec | None:
        """The next segment's request; ``None`` when the watch is over."""
        if self.api.has_fs is False:
            raise _unsupported(f"watch {self.path!r}", self.path)
        remaining = MAX_WATCH_SEGMENT
        if self.deadline is not None:
            remaining = min(remaining, self.deadline - self._clock())
            if remaining <= 0.05:
                return None
        params = {
            "duration": proto.seconds(round(remaining, 2)),
            "recursive": "true" if self.recursive else "false",
        }
        return _get(self.api, "/fs/watch", f"watch {self.path!r}", self.path, **params)

    def feed(self, value: Any) -> list[WatchEvent]:
        """The events of one NDJSON value of the stream."""
        self.failures = 0
        self.api.record(Learned(FILE_API, True))
        what = f"watch {self.path!r}"
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "snapshot":
            return self._snapshot(value, what)
        if kind in ("created", "modified", "removed"):
            entry = parse_info(value.get("entry"), what) if value.get("entry") else None
            key = self._key(str(value.get("path", "")))
            if self.known is not None:
                if kind == "removed":
                    self.known.pop(key, None)
                elif entry is not None:
                    self.known[key] = entry
            return [WatchEvent(kind, str(value.get("path", "")), entry)]
        if kind == "error":
            raise SandboxFileError(
                f"Could not {what}: the runtime ended the watch: {value.get('message')}.",
                sandbox_path=self.path,
            )
        return []  # heartbeat, or a type this client does not know

    def _key(self, path: str) -> str:
        prefix = self.base.rstrip("/") + "/"
        return path[len(prefix) :] if path.startswith(prefix) else path

    def _snapshot(self, value: dict[str, Any], what: str) -> list[WatchEvent]:
        entries = value.get("entries")
        if not isinstance(entries, dict):
            raise proto.protocol_error(what, "the snapshot has no entries", "the file API")
        self.base = str(value.get("path") or self.base)
        current = {str(k): parse_info(v, what) for k, v in entries.items()}
        previous, self.known = self.known, current
        if previous is None:
            return []
        events = []
        for key in sorted(previous.keys() | current.keys()):
            old, new = previous.get(key), current.get(key)
            if old == new or (old and new and old.is_dir and new.is_dir):
                continue
            kind = "created" if old is None else "removed" if new is None else "modified"
            events.append(WatchEvent(kind, f"{self.base.rstrip('/')}/{key}", new or old))
        return events

    def failed(self, exc: BaseException) -> None:
        """A segment broke with ``exc``: return to reconnect, else raise it."""
        if isinstance(exc, FileAPIUnsupportedError):
            self.api.record(Learned(FILE_API, False))
        reconnect = isinstance(exc, BrokerUnavailableError | RequestTimeoutError)
        if not reconnect or self.failures >= WATCH_RECONNECTS:
            raise exc
        self.failures += 1
