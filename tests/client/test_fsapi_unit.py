"""The I/O-free file layer (``_fsapi``): watch state across reconnections, FileInfo parsing,
legacy path mapping, and the fallback decisions, without a broker."""

from __future__ import annotations

from typing import Any

import pytest

from k8s_agent_sandbox_awx.client.core import _fsapi as fsapi
from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget
from k8s_agent_sandbox_awx.errors import (
    BrokerProtocolError,
    BrokerUnavailableError,
    FileAPIUnsupportedError,
    SandboxFileError,
)


def _entry(name: str, size: int = 1, mtime: float = 1.0, kind: str = "file") -> dict[str, Any]:
    return {
        "name": name,
        "path": f"/app/w/{name}",
        "type": kind,
        "size": size,
        "mod_time": mtime,
        "modified_ns": int(mtime * 1e9),
        "permissions": 420,
    }


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_watch_diffs_the_snapshot_of_each_reconnection() -> None:
    clock = Clock()
    watch = fsapi.Watch(fsapi.FileAPI(RouterTarget("s")), "w", 50, False, clock)
    first = watch.next_spec()
    assert first is not None and first.params == {
        "path": "w",
        "duration": "20",
        "recursive": "false",
    }
    snapshot = {"type": "snapshot", "path": "/app/w", "entries": {"a": _entry("a")}}
    assert watch.feed(snapshot) == []  # the baseline
    created = watch.feed({"type": "created", "path": "/app/w/b", "entry": _entry("b")})
    assert [(e.type, e.path) for e in created] == [("created", "/app/w/b")]
    assert watch.feed({"type": "heartbeat"}) == [] and watch.feed({"type": "new-kind"}) == []
    # the connection breaks: reconnect (up to 3 times in a row), then the error is raised
    broken = BrokerUnavailableError("the connection broke")
    for _ in range(fsapi.WATCH_RECONNECTS):
        watch.failed(broken)
    with pytest.raises(BrokerUnavailableError):
        watch.failed(broken)
    clock.now = 40.0
    second = watch.next_spec()
    assert second is not None and second.params["duration"] == "10"  # what is left
    # meanwhile a changed, c created, b removed (between the two segments): nothing is lost
    changed = {"a": _entry("a", size=2, mtime=2.0), "c": _entry("c")}
    events = watch.feed({"type": "snapshot", "path": "/app/w", "entries": changed})
    assert [(e.type, e.path) for e in events] == [
        ("modified", "/app/w/a"),
        ("removed", "/app/w/b"),
        ("created", "/app/w/c"),
    ]
    assert events[1].entry is not None and events[1].entry.name == "b"  # the last one seen
    clock.now = 50.0
    assert watch.next_spec() is None  # over at its timeout
    with pytest.raises(SandboxFileError, match="was removed"):
        watch.feed({"type": "error", "message": "/app/w was removed"})
    with pytest.raises(SandboxFileError):
        watch.failed(SandboxFileError("refused"))  # not a broken connection: raised


def test_a_watch_of_a_runtime_without_the_file_api_says_so() -> None:
    api = fsapi.FileAPI(RouterTarget("s"))
    watch = fsapi.Watch(api, "w", None, True)
    with pytest.raises(FileAPIUnsupportedError):
        watch.failed(FileAPIUnsupportedError("no /fs/watch"))
    assert api.has_fs is False
    with pytest.raises(FileAPIUnsupportedError, match=r"v0\.4\.0"):
        watch.next_spec()


def test_fileinfo_parsing_keeps_unknown_fields() -> None:
    info = fsapi.parse_info({**_entry("a"), "owner": "app"}, "list")
    assert info.extra == {"owner": "app"} and info.to_dict()["owner"] == "app"
    assert info.mode == "0644" and info.modified is not None
    legacy = fsapi.parse_info({"name": "x", "size": 3, "type": "file", "mod_time": 1.5}, "l", "d")
    assert (legacy.path, legacy.permissions) == ("d/x", None)
    with pytest.raises(BrokerProtocolError, match="FileInfo"):
        fsapi.parse_info({"name": "x"}, "list")


def test_legacy_paths() -> None:
    assert fsapi.legacy_path("/app/d/a.txt") == "d/a.txt"
    assert fsapi.legacy_path("/app", allow_root=True) == "."
    assert fsapi.legacy_path("d/a.txt") == "d/a.txt"
    with pytest.raises(FileAPIUnsupportedError, match="/workspace"):
        fsapi.legacy_path("/workspace/a")
    with pytest.raises(ValueError, match=r"\.\."):
        fsapi.legacy_path("../a")


def test_fallback_is_remembered_per_sandbox() -> None:
    api = fsapi.FileAPI(RouterTarget("s"))
    op = fsapi.exists(api, "a", None)
    first = next(op)
    assert first.spec.path == "/fs/exists"
    legacy = op.throw(FileAPIUnsupportedError("404 without a code"))
    assert legacy.spec.path == "/exists/a" and api.has_fs is False
    with pytest.raises(StopIteration) as done:
        op.send(True)
    assert done.value.value is True
    again = next(fsapi.exists(api, "b", None))  # the next operation goes there at once
    assert again.spec.path == "/exists/b"
    with pytest.raises(FileAPIUnsupportedError, match="no legacy equivalent"):
        next(fsapi.make_dir(api, "x", None))


def test_retry_rules_of_the_file_requests() -> None:
    api = fsapi.FileAPI(RouterTarget("s"))
    assert next(fsapi.make_dir(api, "x", None)).spec.retryable
    assert next(fsapi.remove(api, "x", False, None)).spec.retryable
    assert not next(fsapi.move(api, "x", "y", False, None)).spec.retryable
    write = next(fsapi.write(api, "x", b"bytes", None))
    assert write.spec.retryable and write.spec.headers["Content-Length"]
    api.has_fs = True
    one_shot = next(fsapi.write(api, "x", iter([b"a"]), None))
    assert not one_shot.spec.retryable
    assert one_shot.spec.headers["Transfer-Encoding"] == "chunked"
    with pytest.raises(TypeError, match="async"):
        next(fsapi.write(api, "x", _agen(), None))  # the sync client


async def _agen() -> Any:
    yield b"x"
