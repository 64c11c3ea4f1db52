"""The local runtime's file endpoints (/fs/*) through the broker: semantics, refusals, streaming."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.broker_api import fs_get, fs_post, fs_write


def _streamed_write(
    api: Any, sandbox: dict[str, Any], path: str, chunks: Iterator[bytes], **kw: Any
) -> httpx.Response:
    """``POST /fs/write`` with a body generated as it is sent (never held in memory)."""
    boundary = "fs-test-boundary-7f3a"

    def body() -> Iterator[bytes]:
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="path"\r\n\r\n{path}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="f"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        yield from chunks
        yield f"\r\n--{boundary}--\r\n".encode()

    resp: httpx.Response = api.http.post(
        "/fs/write",
        content=body(),
        headers={
            **api.data_headers(sandbox),
            "Content-Type": f"multipart/form-data; boundary={boundary}",
        },
        **kw,
    )
    return resp


def _refused(resp: httpx.Response, status: int, code: str, *named: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == code, body
    for text in named:
        assert text in body["detail"], body


def test_write_read_info_and_the_two_roots(alice: Any, sandbox: dict[str, Any]) -> None:
    written = fs_write(alice, sandbox, "/workspace/deep/er/f.txt", b"hello")
    assert written.status_code == 200, written.text
    info = written.json()
    assert info["name"] == "f.txt"
    assert info["path"] == "/workspace/deep/er/f.txt"
    assert info["type"] == "file"
    assert info["size"] == 5
    assert info["permissions"] == 0o666 & ~_umask()
    assert isinstance(info["mod_time"], float)
    assert abs(info["modified_ns"] / 1e9 - info["mod_time"]) < 1e-3
    for alias in ("/workspace/deep/er/f.txt", "/app/workspace/deep/er/f.txt"):
        read = fs_get(alice, sandbox, "read", path=alias)
        assert read.status_code == 200
        assert read.content == b"hello"
        assert read.headers["content-type"] == "application/octet-stream"
    assert fs_get(alice, sandbox, "info", path="/app/workspace/deep/er/f.txt").json() == info
    # relative paths are relative to /app, where commands run
    assert fs_write(alice, sandbox, "sub/g.txt", b"app").status_code == 200
    out = alice.run(sandbox, "cat sub/g.txt").json()
    assert out["stdout"] == "app"
    assert fs_get(alice, sandbox, "read", path="/app/sub/g.txt").content == b"app"
    # /workspace is not the base directory: the legacy listing of /app does not show it
    assert [
        e["name"] for e in alice.http.get("/list/", headers=alice.data_headers(sandbox)).json()
    ] == ["sub"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_write_replaces_atomically(broker: LocalBroker, alice: Any, api: Any) -> None:
    sandbox = alice.ready()
    assert fs_write(alice, sandbox, "f.bin", b"old" * 1000).status_code == 200
    assert alice.run(sandbox, "chmod 600 f.bin").json()["exit_code"] == 0
    observer = api(alice.token)
    seen: list[bytes] = []

    def body() -> Iterator[bytes]:
        yield b"new" * 100_000
        # half the new content is on disk: a reader still sees the whole old file
        seen.append(fs_get(observer, sandbox, "read", path="f.bin").content)
        seen.append(json.dumps(fs_get(observer, sandbox, "list", path="/app").json()).encode())
        yield b"new" * 100_000

    resp = _streamed_write(alice, sandbox, "f.bin", body())
    assert resp.status_code == 200, resp.text
    assert seen[0] == b"old" * 1000
    assert resp.json()["size"] == 600_000
    assert resp.json()["permissions"] == 0o600  # a replaced file keeps its mode
    assert fs_get(alice, sandbox, "read", path="f.bin").content == b"new" * 200_000
    names = [e["name"] for e in fs_get(alice, sandbox, "list", path="/app").json()]
    assert names == ["f.bin"]  # the temporary file is gone


def test_write_refusals_leave_the_old_file(alice: Any, sandbox: dict[str, Any]) -> None:
    assert fs_write(alice, sandbox, "keep.txt", b"kept").status_code == 200
    assert fs_post(alice, sandbox, "mkdir", path="adir").json() == {"created": True}
    _refused(fs_write(alice, sandbox, "adir", b"x"), 400, "is_a_directory", "/app/adir")
    _refused(fs_write(alice, sandbox, "keep.txt/x", b"x"), 400, "not_a_directory", "keep.txt")
    _refused(fs_write(alice, sandbox, "/etc/x", b"x"), 403, "path_outside_root", "/etc/x")
    # the file part before the path field: refused, nothing written
    resp = alice.http.post(
        "/fs/write",
        content=(
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="f"\r\n\r\nnew'
            b'\r\n--b\r\nContent-Disposition: form-data; name="path"\r\n\r\nkeep.txt\r\n--b--\r\n'
        ),
        headers={**alice.data_headers(sandbox), "Content-Type": "multipart/form-data; boundary=b"},
    )
    _refused(resp, 400, "invalid_argument", "'path' field must come before")
    path_part = b'--b\r\nContent-Disposition: form-data; name="path"\r\n\r\nkeep.txt\r\n'
    for body, reason in (
        (path_part + b"--b--\r\n", "no 'file' part"),
        (path_part + path_part + b"--b--\r\n", "given twice"),
    ):
        resp = alice.http.post(
            "/fs/write",
            content=body,
            headers={
                **alice.data_headers(sandbox),
                "Content-Type": "multipart/form-data; boundary=b",
            },
        )
        _refused(resp, 400, "invalid_argument", reason)
    resp = alice.http.post(
        "/fs/write", data={"path": "keep.txt"}, headers=alice.data_headers(sandbox)
    )
    _refused(resp, 400, "invalid_argument", "multipart/form-data")
    assert fs_get(alice, sandbox, "read", path="keep.txt").content == b"kept"
    names = [e["name"] for e in fs_get(alice, sandbox, "list", path=".").json()]
    assert names == ["adir", "keep.txt"]


def test_an_aborted_write_leaves_the_old_file(alice: Any, sandbox: dict[str, Any]) -> None:
    assert fs_write(alice, sandbox, "/workspace/f", b"old").status_code == 200

    def body() -> Iterator[bytes]:
        yield b"x" * 1_000_000
        raise OSError("the caller's source failed")

    with pytest.raises((httpx.HTTPError, OSError)):
        _streamed_write(alice, sandbox, "/workspace/f", body())
    deadline = time.monotonic() + 10
    while True:  # the runtime notices the broken body, then removes its temporary file
        names = [e["name"] for e in fs_get(alice, sandbox, "list", path="/workspace").json()]
        if names == ["f"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert names == ["f"]
    assert fs_get(alice, sandbox, "read", path="/workspace/f").content == b"old"


@pytest.mark.parametrize(
    ("path", "status", "code", "named"),
    [
        ("/etc/passwd", 403, "path_outside_root", "/app or /workspace"),
        ("/", 403, "path_outside_root", "/app or /workspace"),
        ("/application/x", 403, "path_outside_root", "/application/x"),
        ("../outside", 400, "path_invalid", "'..'"),
        ("/app/a/../../etc", 400, "path_invalid", "'..'"),
        ("a\x01b", 400, "path_invalid", "control characters"),
        ("a\x7fb", 400, "path_invalid", "control characters"),
        ("a\nb", 400, "path_invalid", "control characters"),
        ("x" * 4097, 400, "path_invalid", "4096"),
        ("", 400, "path_invalid", "empty"),
        ("missing.txt", 404, "path_not_found", "/app/missing.txt"),
        ("/workspace/no/such", 404, "path_not_found", "/workspace/no"),
    ],
)
def test_path_rules(
    alice: Any, sandbox: dict[str, Any], path: str, status: int, code: str, named: str
) -> None:
    resp = fs_get(alice, sandbox, "read", path=path)
    _refused(resp, status, code, named)
    if code != "path_not_found":
        assert resp.json()["path"] == path[:200] + ("..." if len(path) > 200 else "")
        _refused(fs_get(alice, sandbox, "list", path=path), status, code)
        _refused(fs_post(alice, sandbox, "mkdir", path=path), status, code)


def test_symlinks_are_never_followed(alice: Any, sandbox: dict[str, Any]) -> None:
    assert alice.run(sandbox, "ln -s /etc etc-link").json()["exit_code"] == 0
    assert alice.run(sandbox, "ln -s /etc/hostname host-link").json()["exit_code"] == 0
    _refused(fs_get(alice, sandbox, "read", path="etc-link/passwd"), 400, "symlink_not_followed")
    _refused(fs_get(alice, sandbox, "read", path="host-link"), 400, "symlink_not_followed")
    _refused(fs_get(alice, sandbox, "list", path="etc-link"), 400, "symlink_not_followed")
    _refused(fs_write(alice, sandbox, "etc-link/x", b"x"), 400, "symlink_not_followed", "etc-link")
    _refused(fs_post(alice, sandbox, "mkdir", path="etc-link/d"), 400, "symlink_not_followed")
    info = fs_get(alice, sandbox, "info", path="etc-link").json()
    assert info["type"] == "symlink"
    assert info["symlink_target"] == "/etc"
    entries = {e["name"]: e["type"] for e in fs_get(alice, sandbox, "list", path="/app").json()}
    assert entries == {"etc-link": "symlink", "host-link": "symlink"}
    # remove acts on the link itself
    assert fs_post(alice, sandbox, "remove", path="etc-link", recursive=True).json() == {
        "removed": True
    }
    assert os.path.isdir("/etc")
    assert fs_get(alice, sandbox, "exists", path="etc-link").json() == {"exists": False}


def test_read_kinds_and_cap(alice: Any) -> None:
    sandbox = alice.ready(env={"SANDBOX_FS_READ_MAX_BYTES": "10"})
    assert fs_write(alice, sandbox, "ten", b"0123456789").status_code == 200
    assert fs_write(alice, sandbox, "eleven", b"0123456789A").status_code == 200
    assert fs_get(alice, sandbox, "read", path="ten").content == b"0123456789"
    _refused(fs_get(alice, sandbox, "read", path="eleven"), 400, "file_too_large", "10 bytes")
    download = alice.http.get("/download/eleven", headers=alice.data_headers(sandbox))
    assert download.content == b"0123456789A"  # the legacy endpoint has no cap
    _refused(fs_get(alice, sandbox, "read", path="/app"), 400, "is_a_directory")
    assert fs_post(alice, sandbox, "mkdir", path="d").status_code == 200
    _refused(fs_get(alice, sandbox, "read", path="d"), 400, "is_a_directory", "/app/d")
    assert alice.run(sandbox, "mkfifo pipe").json()["exit_code"] == 0
    _refused(fs_get(alice, sandbox, "read", path="pipe"), 400, "not_a_file")
    _refused(fs_get(alice, sandbox, "list", path="ten"), 400, "not_a_directory", "/app/ten")


def test_list_exists_info(alice: Any, sandbox: dict[str, Any]) -> None:
    fs_write(alice, sandbox, "/workspace/d/b.txt", b"bb")
    fs_write(alice, sandbox, "/workspace/d/a.txt", b"a")
    fs_post(alice, sandbox, "mkdir", path="/workspace/d/sub")
    entries = fs_get(alice, sandbox, "list", path="/workspace/d").json()
    assert [(e["name"], e["type"], e["path"]) for e in entries] == [
        ("a.txt", "file", "/workspace/d/a.txt"),
        ("b.txt", "file", "/workspace/d/b.txt"),
        ("sub", "directory", "/workspace/d/sub"),
    ]
    assert entries[1]["size"] == 2
    assert set(entries[0]) >= {
        "name",
        "path",
        "type",
        "size",
        "mod_time",
        "modified_ns",
        "permissions",
    }
    assert fs_get(alice, sandbox, "exists", path="/workspace/d/a.txt").json() == {"exists": True}
    assert fs_get(alice, sandbox, "exists", path="/workspace/d/zz").json() == {"exists": False}
    assert fs_get(alice, sandbox, "exists", path="/workspace/d/a.txt/x").json() == {"exists": False}
    assert fs_get(alice, sandbox, "info", path="/workspace/d/sub").json()["type"] == "directory"
    _refused(fs_get(alice, sandbox, "info", path="/workspace/d/zz"), 404, "path_not_found", "/zz")
    _refused(fs_get(alice, sandbox, "exists", path="/tmp"), 403, "path_outside_root")
    _refused(fs_get(alice, sandbox, "exists"), 400, "invalid_argument", "'path' is required")


def test_list_limit(alice: Any, sandbox: dict[str, Any]) -> None:
    make = "python3 -c \"import os; [open(f'many/{i}', 'w').close() for i in range({n})]\""
    assert fs_post(alice, sandbox, "mkdir", path="many").status_code == 200
    assert alice.run(sandbox, make.replace("{n}", "2000")).json()["exit_code"] == 0
    assert len(fs_get(alice, sandbox, "list", path="many").json()) == 2000
    assert alice.run(sandbox, "touch many/one-more").json()["exit_code"] == 0
    _refused(fs_get(alice, sandbox, "list", path="many"), 400, "too_many_entries", "2000")


def test_mkdir(alice: Any, sandbox: dict[str, Any]) -> None:
    assert fs_post(alice, sandbox, "mkdir", path="/workspace/a/b/c").json() == {"created": True}
    assert fs_post(alice, sandbox, "mkdir", path="/workspace/a/b/c").json() == {"created": False}
    assert fs_post(alice, sandbox, "mkdir", path="/workspace").json() == {"created": False}
    fs_write(alice, sandbox, "/workspace/file", b"x")
    _refused(fs_post(alice, sandbox, "mkdir", path="/workspace/file"), 400, "path_exists", "/file")
    _refused(fs_post(alice, sandbox, "mkdir", path="/workspace/file/d"), 400, "not_a_directory")
    _refused(fs_post(alice, sandbox, "mkdir"), 400, "invalid_argument", "'path' is required")
    _refused(fs_post(alice, sandbox, "mkdir", path=5), 400, "invalid_argument", "string")
    resp = alice.http.post("/fs/mkdir", content=b"[1", headers=alice.data_headers(sandbox))
    _refused(resp, 400, "invalid_argument", "JSON")
    resp = alice.http.post(
        "/fs/mkdir", content=b'{"path": "a\\ud800b"}', headers=alice.data_headers(sandbox)
    )
    _refused(resp, 400, "path_invalid", "surrogate")


def test_move_never_overwrites_unless_asked(alice: Any, sandbox: dict[str, Any]) -> None:
    fs_write(alice, sandbox, "a.txt", b"A")
    fs_write(alice, sandbox, "b.txt", b"B")
    resp = fs_post(alice, sandbox, "move", source="a.txt", destination="b.txt")
    _refused(resp, 400, "path_exists", "/app/b.txt")
    assert fs_get(alice, sandbox, "read", path="a.txt").content == b"A"
    assert fs_get(alice, sandbox, "read", path="b.txt").content == b"B"
    resp = fs_post(alice, sandbox, "move", source="a.txt", destination="c.txt")
    assert resp.status_code == 200
    assert resp.json()["path"] == "/app/c.txt"
    assert resp.json()["size"] == 1
    assert fs_get(alice, sandbox, "exists", path="a.txt").json() == {"exists": False}
    resp = fs_post(alice, sandbox, "move", source="c.txt", destination="b.txt", overwrite=True)
    assert resp.status_code == 200
    assert fs_get(alice, sandbox, "read", path="b.txt").content == b"A"
    _refused(
        fs_post(alice, sandbox, "move", source="zz", destination="y"),
        404,
        "path_not_found",
        "/app/zz",
    )
    _refused(
        fs_post(alice, sandbox, "move", source="b.txt", destination="/workspace/b.txt"),
        400,
        "cross_root",
    )
    _refused(
        fs_post(alice, sandbox, "move", source="b.txt", destination="nodir/b.txt"),
        404,
        "path_not_found",
    )
    _refused(fs_post(alice, sandbox, "move", source="/app", destination="x"), 403, "path_is_root")
    fs_post(alice, sandbox, "mkdir", path="d1/d2")
    _refused(
        fs_post(alice, sandbox, "move", source="d1", destination="d1/d2/d3"),
        400,
        "invalid_argument",
        "into itself",
    )
    resp = fs_post(alice, sandbox, "move", source="d1", destination="d9")
    assert resp.json()["type"] == "directory"
    resp = fs_post(alice, sandbox, "move", source="b.txt", destination="x", overwrite="yes please")
    _refused(resp, 400, "invalid_argument", "overwrite")


def test_remove(alice: Any, sandbox: dict[str, Any]) -> None:
    fs_write(alice, sandbox, "/workspace/d/e/f", b"x")
    fs_write(alice, sandbox, "g", b"x")
    assert fs_post(alice, sandbox, "remove", path="g").json() == {"removed": True}
    assert fs_post(alice, sandbox, "remove", path="g").json() == {"removed": False}
    assert fs_post(alice, sandbox, "remove", path="nodir/g").json() == {"removed": False}
    _refused(fs_post(alice, sandbox, "remove", path="/workspace/d"), 400, "not_empty", "recursive")
    assert fs_get(alice, sandbox, "read", path="/workspace/d/e/f").content == b"x"
    resp = fs_post(alice, sandbox, "remove", path="/workspace/d", recursive=True)
    assert resp.json() == {"removed": True}
    assert fs_get(alice, sandbox, "list", path="/workspace").json() == []
    _refused(
        fs_post(alice, sandbox, "remove", path="/workspace", recursive=True), 403, "path_is_root"
    )
    _refused(fs_post(alice, sandbox, "remove", path="."), 403, "path_is_root")


def _events(resp: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in resp.iter_lines():
        if line:
            yield json.loads(line)


def test_watch_sees_a_command_and_ends_at_duration(
    alice: Any, sandbox: dict[str, Any], api: Any
) -> None:
    fs_write(alice, sandbox, "w/old", b"1")
    other = api(alice.token)
    started = time.monotonic()
    with alice.http.stream(
        "GET",
        "/fs/watch",
        params={"path": "/app/w", "duration": 3},
        headers=alice.data_headers(sandbox),
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "application/x-ndjson"
        events = _events(resp)
        snapshot = next(events)
        assert snapshot["type"] == "snapshot"
        assert set(snapshot["entries"]) == {"old"}
        assert snapshot["entries"]["old"]["path"] == "/app/w/old"
        assert other.run(sandbox, "touch w/new").json()["exit_code"] == 0
        created = next(events)
        assert created["type"] == "created"
        assert created["path"] == "/app/w/new"
        assert created["entry"]["type"] == "file"
        fs_write(other, sandbox, "w/old", b"22")
        fs_post(other, sandbox, "remove", path="w/new")
        rest = [e for e in events if e["type"] != "heartbeat"]
    assert time.monotonic() - started >= 2.9  # it lasted its duration, no less
    assert sorted((e["type"], e["path"], e["entry"]["size"]) for e in rest) == [
        ("modified", "/app/w/old", 2),
        ("removed", "/app/w/new", 0),
    ]


def test_watch_recursive_and_refusals(alice: Any, sandbox: dict[str, Any], api: Any) -> None:
    fs_post(alice, sandbox, "mkdir", path="r/s")
    other = api(alice.token)
    params = {"path": "r", "duration": 2, "recursive": "true"}
    with alice.http.stream(
        "GET", "/fs/watch", params=params, headers=alice.data_headers(sandbox)
    ) as resp:
        events = _events(resp)
        assert set(next(events)["entries"]) == {"s"}
        fs_write(other, sandbox, "r/s/deep.txt", b"x")
        created = next(events)
        assert (created["type"], created["path"]) == ("created", "/app/r/s/deep.txt")
        assert other.run(sandbox, "rm -r r").json()["exit_code"] == 0
        tail = list(events)
    assert tail[-1]["type"] == "error"
    assert "/app/r was removed" in tail[-1]["message"]
    _refused(fs_get(alice, sandbox, "watch", path="r", duration=1), 404, "path_not_found")
    fs_write(alice, sandbox, "f", b"")
    _refused(fs_get(alice, sandbox, "watch", path="f", duration=1), 400, "not_a_directory")
    for bad in ("0", "21", "soon"):
        resp = fs_get(alice, sandbox, "watch", path=".", duration=bad)
        _refused(resp, 400, "invalid_argument", "duration")


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_large_write_and_read_stream_with_flat_runtime_memory(
    broker: LocalBroker, alice: Any
) -> None:
    size = 200 * 1024 * 1024
    sandbox = alice.ready(env={"SANDBOX_FS_READ_MAX_BYTES": str(size)})
    pid = broker.runtime_pid(sandbox["name"])
    assert pid is not None
    before = _peak_rss(pid)
    block = bytes(range(256)) * 4096  # 1 MiB

    def body() -> Iterator[bytes]:
        for _ in range(size // len(block)):
            yield block

    resp = _streamed_write(alice, sandbox, "/workspace/big", body(), timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["size"] == size
    total = 0
    digest = hashlib.sha256()
    with alice.http.stream(
        "GET",
        "/fs/read",
        params={"path": "/workspace/big"},
        headers=alice.data_headers(sandbox),
        timeout=120,
    ) as read:
        assert read.status_code == 200
        for chunk in read.iter_bytes():
            digest.update(chunk)
            total += len(chunk)
    assert total == size
    assert digest.hexdigest() == hashlib.sha256(block * (size // len(block))).hexdigest()
    growth = _peak_rss(pid) - before
    print(f"runtime peak RSS growth: {growth / 2**20:.1f} MiB for a 200 MiB write and read")
    assert growth < 32 * 1024 * 1024


def test_owner_checks_apply(alice: Any, bob: Any, sandbox: dict[str, Any]) -> None:
    fs_write(alice, sandbox, "secret", b"s")
    for resp in (
        fs_get(bob, sandbox, "read", path="secret"),
        fs_get(bob, sandbox, "list", path="."),
        fs_write(bob, sandbox, "secret", b"overwritten"),
        fs_post(bob, sandbox, "remove", path="secret"),
        fs_get(bob, sandbox, "watch", path=".", duration=1),
    ):
        _refused(resp, 403, "not_owner")
    assert fs_get(alice, sandbox, "read", path="secret").content == b"s"


def test_unknown_fs_route_is_a_plain_404(alice: Any, sandbox: dict[str, Any]) -> None:
    for resp in (
        fs_get(alice, sandbox, "nope", path="x"),
        alice.http.post("/fs/read", json={}, headers=alice.data_headers(sandbox)),
        alice.http.get("/fs/mkdir", headers=alice.data_headers(sandbox)),
    ):
        assert resp.status_code == 404
        assert "code" not in resp.json()  # what an old runtime answers: no such endpoint
