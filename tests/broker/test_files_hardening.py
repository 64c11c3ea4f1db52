"""The local runtime's file endpoints and cleanup against what a sandbox's commands can do to
their own directories: trees deeper than the recursion limit and longer than PATH_MAX, a root
(``/app``, ``/workspace``) swapped for a symbolic link or another directory, a symbolic link
swapped in between a check and a use, and a destination created during a move."""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.broker_api import fs_get, fs_post, fs_write
from tests._support.isolation import ROOTS_ARE_MOUNTS, host_processes_only

DEEP = (
    "python3 -c 'import os, sys\n"
    'os.chdir(os.path.expandvars(sys.argv[1])); os.makedirs("deep", exist_ok=True)\n'
    'os.chdir("deep")\n'
    "for _ in range(int(sys.argv[2])):\n"
    '    os.mkdir("d"); os.chdir("d")\n'
    'open("leaf.txt", "w").write("x")\' {where} {depth}'
)
"""A command that makes ``{where}/deep/d/d/.../d/leaf.txt``, ``{depth}`` directories deep (far
beyond PATH_MAX for 3,000: each step is relative to the last)."""


def _deep(api: Any, sandbox: dict[str, Any], depth: int, where: str = ".") -> None:
    out = api.run(sandbox, DEEP.format(where=where, depth=depth)).json()
    assert out["exit_code"] == 0, out


def _handle(broker: LocalBroker, sandbox: dict[str, Any]) -> Any:
    handle = broker._require_store().sandboxes[sandbox["name"]].handle
    assert handle is not None and handle.root is not None
    return handle


def _gone(path: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.lexists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- item 4: deep trees --------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1000, 3000])
def test_remove_recursive_of_a_deep_tree(alice: Any, sandbox: dict[str, Any], depth: int) -> None:
    _deep(alice, sandbox, depth)
    _deep(alice, sandbox, depth, where="$SANDBOX_WORKSPACE_DIR")
    assert fs_get(alice, sandbox, "info", path="deep/d/d").json()["type"] == "directory"
    for path in ("deep", "/workspace/deep"):
        resp = fs_post(alice, sandbox, "remove", path=path, recursive=True)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"removed": True}
        assert fs_get(alice, sandbox, "exists", path=path).json() == {"exists": False}


def test_a_deep_tree_beside_others_is_removed_with_them(
    alice: Any, sandbox: dict[str, Any]
) -> None:
    """Many siblings, files and links at every level, a link to a directory outside that must
    survive."""
    outside = tempfile.mkdtemp()
    try:
        Path(outside, "keep.txt").write_text("keep")
        make = (
            "python3 -c 'import os, sys\n"
            'os.makedirs("t"); os.chdir("t")\n'
            "for i in range(1200):\n"
            '    [os.mkdir(f"s{j}") for j in range(3)]; open("f", "w").close()\n'
            '    os.symlink(sys.argv[1], "out"); os.chdir("s1")\' '
            f"{outside}"
        )
        assert alice.run(sandbox, make).json()["exit_code"] == 0
        resp = fs_post(alice, sandbox, "remove", path="t", recursive=True)
        assert resp.json() == {"removed": True}, resp.text
        assert Path(outside, "keep.txt").read_text() == "keep"
    finally:
        os.unlink(os.path.join(outside, "keep.txt"))
        os.rmdir(outside)


def test_recursive_watch_of_a_deep_tree(alice: Any, sandbox: dict[str, Any], api: Any) -> None:
    _deep(alice, sandbox, 1500)
    other = api(alice.token)
    deepest = "/".join(["d"] * 1500)
    params = {"path": "deep", "duration": 4, "recursive": "true"}
    with alice.http.stream(
        "GET", "/fs/watch", params=params, headers=alice.data_headers(sandbox)
    ) as resp:
        assert resp.status_code == 200
        events = (json.loads(line) for line in resp.iter_lines() if line)
        snapshot = next(events)
        assert snapshot["type"] == "snapshot", snapshot
        assert f"{deepest}/leaf.txt" in snapshot["entries"]
        assert len(snapshot["entries"]) == 1501
        leaf = f"deep/{deepest}/new.txt"
        assert (
            other.run(sandbox, f'python3 -c \'open("{leaf}", "w").close()\'').json()["exit_code"]
            == 0
        )
        created = next(e for e in events if e["type"] != "heartbeat")
    assert (created["type"], created["path"]) == ("created", f"/app/{leaf}")


def test_deleting_a_sandbox_removes_its_deep_tree(
    broker: LocalBroker, alice: Any, sandbox: dict[str, Any]
) -> None:
    _deep(alice, sandbox, 3000)
    _deep(alice, sandbox, 3000, where="$SANDBOX_WORKSPACE_DIR")
    root = _handle(broker, sandbox).root
    assert alice.http.delete(f"/v1/sandboxes/{sandbox['name']}").status_code == 202
    assert _gone(root), "the sandbox's directory was left behind"


def test_stop_removes_a_deep_tree_and_every_temporary_file(api: Any) -> None:
    b = LocalBroker(warn=False).start()
    try:
        client = api(b.issue_kubernetes_token("team-a", "alice"), b)
        sandbox = client.ready()
        _deep(client, sandbox, 3000)
        tmp = os.path.dirname(b.ca_bundle)
    finally:
        b.stop()  # raises nothing
    assert not os.path.lexists(tmp), "stop() left its temporary directory"


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(proc.stdout)


def _dead_brokers_leftover(depth: int) -> str:
    """A temporary directory like a broker killed with ``kill -9`` leaves: its owner file names a
    process that is gone, and a sandbox's command left a deep tree in it."""
    path = tempfile.mkdtemp(prefix="agent-sandbox-broker-")
    Path(path, "broker.pid").write_text(str(_dead_pid()))
    where = os.path.join(path, "sandboxes", "s-1", "work")
    os.makedirs(where)
    subprocess.run(
        [sys.executable, "-c", DEEP.split("'")[1], where, str(depth)], check=True, timeout=60
    )
    return path


def test_a_dead_brokers_deep_leftover_does_not_stop_a_start() -> None:
    leftovers = [_dead_brokers_leftover(3000), _dead_brokers_leftover(1000)]
    with LocalBroker(warn=False) as b:
        assert b.url
        for path in leftovers:
            assert not os.path.lexists(path), "the dead broker's leftover was not swept"
    with LocalBroker(warn=False) as b:  # and every later start too
        assert b.url


def test_a_leftover_the_sweep_cannot_remove_is_logged_and_skipped(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k8s_agent_sandbox_awx.broker.runtime import _tree

    path = _dead_brokers_leftover(3)

    def fail(dir_fd: int, name: str, **kwargs: Any) -> bool:
        raise PermissionError(13, "Permission denied")

    broker = LocalBroker(warn=False)
    with caplog.at_level("WARNING"):
        monkeypatch.setattr(_tree, "remove_tree", fail)
        try:
            broker.start()
        finally:
            monkeypatch.undo()
    try:
        assert broker.url
        assert os.path.isdir(path)
        logged = [r.getMessage() for r in caplog.records]
        assert any(path in m and "Permission denied" in m for m in logged), logged
    finally:
        broker.stop()
        _tree.remove_path(path)
    assert not os.path.lexists(path)


# -- item 5: a root swapped ---------------------------------------------------------------------
def _root_refused(resp: httpx.Response, root: str) -> None:
    assert resp.status_code == 403, resp.text
    body = resp.json()
    assert body["code"] == "root_replaced", body
    assert root in body["detail"], body


def _every_operation(alice: Any, sandbox: dict[str, Any], root: str) -> Iterator[httpx.Response]:
    yield fs_get(alice, sandbox, "list", path=root)
    yield fs_get(alice, sandbox, "read", path=f"{root}/secret.txt")
    yield fs_get(alice, sandbox, "info", path=root)
    yield fs_get(alice, sandbox, "info", path=f"{root}/secret.txt")
    yield fs_get(alice, sandbox, "exists", path=f"{root}/secret.txt")
    yield fs_get(alice, sandbox, "watch", path=root, duration=1)
    yield fs_get(alice, sandbox, "watch", path=f"{root}/sub", duration=1, recursive="true")
    yield fs_write(alice, sandbox, f"{root}/new.txt", b"new")
    yield fs_post(alice, sandbox, "mkdir", path=f"{root}/newdir")
    yield fs_post(alice, sandbox, "remove", path=f"{root}/secret.txt")
    yield fs_post(alice, sandbox, "remove", path=f"{root}/sub", recursive=True)
    yield fs_post(alice, sandbox, "move", source=f"{root}/secret.txt", destination=f"{root}/m.txt")


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "secret.txt").write_text("outside")
    (outside / "sub" / "f").write_text("f")
    return outside


def _unchanged(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt", "sub"]
    assert (outside / "secret.txt").read_text() == "outside"
    assert (outside / "sub" / "f").read_text() == "f"


@host_processes_only(ROOTS_ARE_MOUNTS)
@pytest.mark.parametrize("how", ["symlink", "directory"])
def test_a_replaced_workspace_is_refused_never_followed(
    alice: Any, sandbox: dict[str, Any], tmp_path: Path, how: str
) -> None:
    outside = _outside(tmp_path)
    assert fs_write(alice, sandbox, "/workspace/secret.txt", b"mine").status_code == 200
    if how == "symlink":
        swap = f'rm -rf "$SANDBOX_WORKSPACE_DIR" && ln -s {outside} "$SANDBOX_WORKSPACE_DIR"'
    else:
        swap = f'rm -rf "$SANDBOX_WORKSPACE_DIR" && cp -r {outside} "$SANDBOX_WORKSPACE_DIR"'
    assert alice.run(sandbox, f"sh -c '{swap}'").json()["exit_code"] == 0
    for root in ("/workspace", "/app/workspace"):
        for resp in _every_operation(alice, sandbox, root):
            _root_refused(resp, "/workspace")
    _unchanged(outside)
    # /app is untouched: it still works
    assert fs_write(alice, sandbox, "/app/ok.txt", b"ok").status_code == 200
    assert fs_get(alice, sandbox, "read", path="ok.txt").content == b"ok"


def _replace_base_dir(base: str, outside: Path, how: str) -> None:
    os.rename(base, base + ".old")
    if how == "symlink":
        os.symlink(outside, base)
    else:
        subprocess.run(["cp", "-r", str(outside), base], check=True)


@host_processes_only(ROOTS_ARE_MOUNTS)
@pytest.mark.parametrize("how", ["symlink", "directory"])
def test_a_replaced_base_dir_is_refused_by_every_endpoint(
    broker: LocalBroker, alice: Any, sandbox: dict[str, Any], tmp_path: Path, how: str
) -> None:
    outside = _outside(tmp_path)
    base = os.path.realpath(_handle(broker, sandbox).base_dir)
    _replace_base_dir(base, outside, how)
    try:
        for resp in _every_operation(alice, sandbox, "/app"):
            _root_refused(resp, "/app")
        headers = alice.data_headers(sandbox)
        legacy = [
            alice.http.get("/download/secret.txt", headers=headers),
            alice.http.get("/list/sub", headers=headers),
            alice.http.get("/list/", headers=headers),
            alice.http.get("/exists/secret.txt", headers=headers),
            alice.http.post("/upload", files={"file": ("new.txt", b"x")}, headers=headers),
            alice.http.post("/upload", files={"file": ("sub/new.txt", b"x")}, headers=headers),
        ]
        for resp in legacy:
            _root_refused(resp, "/app")
        _unchanged(outside)
    finally:
        if os.path.islink(base):
            os.unlink(base)
        else:
            subprocess.run(["rm", "-rf", base], check=True)
        os.rename(base + ".old", base)


@host_processes_only(ROOTS_ARE_MOUNTS)
def test_a_watch_ends_when_its_root_is_replaced(
    alice: Any, sandbox: dict[str, Any], api: Any, tmp_path: Path
) -> None:
    outside = _outside(tmp_path)
    other = api(alice.token)
    swap = f'rm -rf "$SANDBOX_WORKSPACE_DIR" && ln -s {outside} "$SANDBOX_WORKSPACE_DIR"'
    params = {"path": "/workspace", "duration": 5}
    with alice.http.stream(
        "GET", "/fs/watch", params=params, headers=alice.data_headers(sandbox)
    ) as resp:
        events = (json.loads(line) for line in resp.iter_lines() if line)
        assert next(events)["type"] == "snapshot"
        assert other.run(sandbox, f"sh -c '{swap}'").json()["exit_code"] == 0
        rest = [e for e in events if e["type"] != "heartbeat"]
    assert rest[-1]["type"] == "error", rest
    assert "/workspace" in rest[-1]["message"]
    assert "no longer the directory" in rest[-1]["message"]
    assert not any("secret.txt" in json.dumps(e) for e in rest)


# -- item 6: legacy endpoints and a symbolic link swapped in -----------------------------------
class _Swapping:
    """``steps`` taken without end in a process of its own (forked), until :meth:`stop`: a
    thread of the test's process would hold the GIL that the in-process broker needs, and the
    requests raced against the swaps would each wait for it (2000 took 45-55 s so)."""

    def __init__(self, steps: Iterator[None]) -> None:
        def run() -> None:
            while True:
                next(steps)

        self._process = multiprocessing.get_context("fork").Process(target=run, daemon=True)
        self._process.start()

    def stop(self) -> None:
        self._process.kill()
        self._process.join(5)
        assert self._process.exitcode == -9, "the swaps ended before the requests did"


def _file_or_link(base: str, outside: Path) -> Iterator[None]:
    """``base/x``: a file inside, then a link to a file outside, and again (atomic swaps)."""
    target = os.path.join(base, "x")
    while True:
        with open(os.path.join(base, ".x-file"), "wb") as fh:
            fh.write(b"INSIDE")
        os.replace(os.path.join(base, ".x-file"), target)
        yield
        os.symlink(outside / "secret.txt", os.path.join(base, ".x-link"))
        os.replace(os.path.join(base, ".x-link"), target)
        yield


@pytest.mark.slow
def test_legacy_download_never_serves_a_file_outside(
    broker: LocalBroker, alice: Any, sandbox: dict[str, Any], tmp_path: Path
) -> None:
    outside = _outside(tmp_path)
    base = os.path.realpath(_handle(broker, sandbox).base_dir)
    swapping = _Swapping(_file_or_link(base, outside))
    seen: collections.Counter[tuple[int, bytes]] = collections.Counter()
    try:
        for _ in range(2000):
            resp = alice.http.get("/download/x", headers=alice.data_headers(sandbox))
            seen[(resp.status_code, resp.content if resp.status_code == 200 else b"")] += 1
    finally:
        swapping.stop()
    assert seen[(200, b"outside")] == 0, seen
    assert {status for status, _ in seen} <= {200, 403, 404}, seen
    assert seen[(200, b"INSIDE")] > 0, seen


def _dir_or_link(base: str, outside: Path) -> Iterator[None]:
    """``base/d``: a directory inside, then a link to a directory outside, and again."""
    d, real, link = (os.path.join(base, n) for n in ("d", ".d-real", ".d-link"))
    os.mkdir(real)
    os.symlink(outside / "sub", link)
    strays = 0
    while True:
        for name in (real, link):
            try:
                os.rename(name, d)
            except OSError:  # an upload made d meanwhile: move it out of the way
                strays += 1
                os.rename(d, os.path.join(base, f".stray-{strays}"))
                continue
            yield
            os.rename(d, name)


@pytest.mark.slow
def test_legacy_upload_never_writes_outside(
    broker: LocalBroker, alice: Any, sandbox: dict[str, Any], tmp_path: Path
) -> None:
    outside = _outside(tmp_path)
    base = os.path.realpath(_handle(broker, sandbox).base_dir)
    swapping = _Swapping(_dir_or_link(base, outside))
    statuses: collections.Counter[int] = collections.Counter()
    written_outside = 0
    try:
        for _ in range(500):  # the old code wrote outside ~1.6 % of the time: ~8 expected
            resp = alice.http.post(
                "/upload", files={"file": ("d/up.txt", b"up")}, headers=alice.data_headers(sandbox)
            )
            statuses[resp.status_code] += 1
            if set(os.listdir(outside / "sub")) != {"f"}:
                written_outside += 1
                for name in set(os.listdir(outside / "sub")) - {"f"}:
                    os.unlink(outside / "sub" / name)
    finally:
        swapping.stop()
    assert written_outside == 0, statuses
    assert set(statuses) <= {200, 403, 409}, statuses
    assert statuses[200] > 0, statuses


def test_legacy_endpoints_still_follow_links_that_stay_inside(
    broker: LocalBroker, alice: Any, sandbox: dict[str, Any]
) -> None:
    make = (
        "sh -c 'mkdir sub && echo hi > sub/f && ln -s sub/f flink && ln -s sub dlink "
        "&& ln -s loop loop && ln -s /etc/hostname out'"
    )
    assert alice.run(sandbox, make).json()["exit_code"] == 0
    headers = alice.data_headers(sandbox)
    assert alice.http.get("/download/flink", headers=headers).content == b"hi\n"
    assert alice.http.get("/download/dlink%2Ff", headers=headers).content == b"hi\n"
    assert [e["name"] for e in alice.http.get("/list/dlink", headers=headers).json()] == ["f"]
    exists = alice.http.get("/exists/flink", headers=headers).json()
    assert exists == {"path": "flink", "exists": True}
    assert alice.http.get("/exists/loop", headers=headers).json()["exists"] is False
    assert alice.http.get("/download/loop", headers=headers).status_code == 404
    assert alice.http.get("/download/out", headers=headers).status_code == 403
    resp = alice.http.post("/upload", files={"file": ("dlink/new.txt", b"n")}, headers=headers)
    assert resp.json() == {"path": "dlink/new.txt", "size": 1}
    base = os.path.realpath(_handle(broker, sandbox).base_dir)
    assert Path(base, "sub", "new.txt").read_bytes() == b"n"
    assert not [n for n in os.listdir(base) if n.startswith(".upload-")]


# -- item 7: move without overwrite and a destination made meanwhile --------------------------
CREATOR = """
import os, sys, threading
path, kind = sys.argv[1:]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
replaced = made = 0
print("ready", flush=True)
while not stop.is_set():
    try:
        if kind == "file":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        else:
            os.mkdir(path)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileExistsError:
        continue
    except FileNotFoundError:  # its directory, gone before it could open it
        replaced += 1
        continue
    made += 1
    ino = os.fstat(fd).st_ino
    try:
        if os.lstat(path).st_ino == ino:
            (os.unlink if kind == "file" else os.rmdir)(path)
        else:
            replaced += 1
    except OSError:  # gone, or a directory moved over it and filled
        replaced += 1
    os.close(fd)
print(replaced, made)
"""
"""Create ``path`` (a file or a directory, exclusively) and remove it again, as fast as it can in
a process of its own, until its stdin closes; then print how many times its creation was no
longer there when it came to remove it (someone replaced it), and how many it made. It prints
``ready`` first, once it runs: on a loaded machine its start can outlast hundreds of moves."""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "directory"])
def test_move_without_overwrite_never_replaces_a_destination_made_meanwhile(
    broker: LocalBroker, alice: Any, sandbox: dict[str, Any], kind: str
) -> None:
    base = os.path.realpath(_handle(broker, sandbox).base_dir)
    destination = os.path.join(base, "dst")
    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR, destination, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    outcomes: collections.Counter[int] = collections.Counter()
    lost, odd = 0, []
    remove = os.unlink if kind == "file" else os.rmdir
    try:
        assert creator.stdout is not None and creator.stdout.readline() == "ready\n"
        # the old code lost a destination 10-18 % of the time; at least 400 moves, and on until
        # the creator has won the race at least once (a 400), so that the race did happen
        for done in range(4000):
            if done >= 400 and outcomes[400] > 0:
                break
            if kind == "file":
                Path(base, "src").write_bytes(b"mine")
            else:
                os.mkdir(os.path.join(base, "src"))
            resp = fs_post(alice, sandbox, "move", source="src", destination="dst")
            outcomes[resp.status_code] += 1
            if resp.status_code == 200 and resp.json()["type"] == kind:
                try:  # ours now: the creator cannot make it while it is there
                    remove(destination)
                except FileNotFoundError:  # the creator removed it: it replaced its file
                    lost += 1
            elif resp.status_code == 400 and resp.json()["code"] == "path_exists":
                remove(os.path.join(base, "src"))
            else:
                odd.append(resp.text)
    finally:
        replaced, made = map(int, creator.communicate(timeout=10)[0].split())
    assert (replaced, lost, odd) == (0, 0, []), (outcomes, made)
    assert outcomes[200] > 0 and outcomes[400] > 0, outcomes


# -- in-process: the walk, and a move where the platform has no no-replace rename ---------------
@pytest.fixture
def roots(tmp_path: Path) -> Iterator[Any]:
    from k8s_agent_sandbox_awx.broker.runtime import _paths

    (tmp_path / "app").mkdir()
    made = _paths.Roots(str(tmp_path / "app"), str(tmp_path / "workspace"))
    yield made
    made.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tree_of(top: Path, depth: int) -> set[str]:
    """``top/d/d/...`` ``depth`` deep, with a file, a link and an empty directory beside each
    ``d``; returns the directories' paths relative to ``top``."""
    made, here = set(), top
    for i in range(depth):
        (here / "f").write_text(str(i))
        (here / "link").symlink_to("/")
        (here / "e").mkdir()
        here = here / "d"
        here.mkdir()
        made |= {str((here.parent / "e").relative_to(top)), str(here.relative_to(top))}
    return made


def test_the_walk_climbs_back_through_dotdot_below_the_descriptors_it_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k8s_agent_sandbox_awx.broker.runtime import _tree

    monkeypatch.setattr(_tree, "KEEP_OPEN", 3)
    (tmp_path / "t").mkdir()
    expected = _tree_of(tmp_path / "t", 40)
    seen: set[str] = set()
    left: list[str] = []

    def enter(fd: int, parts: tuple[str, ...]) -> list[str]:
        if parts:
            seen.add("/".join(parts))
        with os.scandir(fd) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]

    before = _open_fds()
    top = os.open(tmp_path / "t", os.O_RDONLY | os.O_DIRECTORY)
    try:
        _tree.walk(top, enter, lambda fd, name: left.append(name))
    finally:
        os.close(top)
    assert seen == expected
    assert len(left) == len(expected)
    assert _open_fds() == before  # nothing left open
    assert _tree.remove_path(str(tmp_path / "t")) is True
    assert not (tmp_path / "t").exists()
    assert _tree.remove_path(str(tmp_path / "t")) is False
    assert _open_fds() == before


def test_the_walk_stops_when_a_directory_is_moved_from_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k8s_agent_sandbox_awx.broker.runtime import _tree

    monkeypatch.setattr(_tree, "KEEP_OPEN", 2)
    (tmp_path / "t" / "a" / "b" / "c" / "d").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()

    def enter(fd: int, parts: tuple[str, ...]) -> list[str]:
        if parts == ("a", "b", "c", "d"):  # move c (and us with it) out of b
            os.rename(tmp_path / "t" / "a" / "b" / "c", tmp_path / "elsewhere" / "c")
        with os.scandir(fd) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]

    top = os.open(tmp_path / "t", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(_tree.TreeChangedError, match="moved"):
            _tree.walk(top, enter)
    finally:
        os.close(top)


def test_remove_tree_removes_a_link_never_its_target(tmp_path: Path) -> None:
    from k8s_agent_sandbox_awx.broker.runtime import _tree

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("keep")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert _tree.remove_path(str(tmp_path / "link")) is True
    assert (tmp_path / "target" / "keep").read_text() == "keep"
    assert not os.path.lexists(tmp_path / "link")


def _no_replace_unavailable(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    from k8s_agent_sandbox_awx.broker.runtime import _files

    def unsupported(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
        raise OSError(22, "Invalid argument")  # a file system without RENAME_NOREPLACE

    monkeypatch.setattr(
        _files, "_platform_no_replace", lambda: None if how == "no renameat2" else unsupported
    )


@pytest.mark.parametrize("how", ["no renameat2", "file system without the flag"])
def test_move_without_a_no_replace_rename(
    roots: Any, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Files: a hard link, then the old name removed (never replaces); directories: a clear
    error, unless overwrite."""
    from k8s_agent_sandbox_awx.broker.runtime import _files, _paths

    _no_replace_unavailable(monkeypatch, how)
    app = Path(roots.paths["/app"])
    (app / "a").write_text("A")
    (app / "b").write_text("B")
    with pytest.raises(_paths.FsError) as refused:
        _files.move(_paths.check_path("a", roots), _paths.check_path("b", roots), False)
    assert refused.value.code == "path_exists"
    assert ((app / "a").read_text(), (app / "b").read_text()) == ("A", "B")
    info = _files.move(_paths.check_path("a", roots), _paths.check_path("c", roots), False)
    assert (info["path"], (app / "c").read_text(), (app / "a").exists()) == ("/app/c", "A", False)
    (app / "d").mkdir()
    with pytest.raises(_paths.FsError) as refused:
        _files.move(_paths.check_path("d", roots), _paths.check_path("e", roots), False)
    assert (refused.value.code, refused.value.status) == ("not_supported", 400)
    assert "this platform cannot move a directory" in refused.value.detail
    assert "overwrite=true" in refused.value.detail
    assert (app / "d").is_dir() and not (app / "e").exists()
    assert _files.move(_paths.check_path("d", roots), _paths.check_path("e", roots), True)[
        "type"
    ] == ("directory")


def test_the_hard_link_move_never_replaces_a_destination_made_meanwhile(
    roots: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k8s_agent_sandbox_awx.broker.runtime import _files, _paths

    _no_replace_unavailable(monkeypatch, "no renameat2")
    app = roots.paths["/app"]
    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR, os.path.join(app, "dst"), "file"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    moved = lost = 0
    try:
        assert creator.stdout is not None and creator.stdout.readline() == "ready\n"
        for _ in range(3000):
            Path(app, "src").write_bytes(b"mine")
            try:
                _files.move(_paths.check_path("src", roots), _paths.check_path("dst", roots), False)
            except _paths.FsError as exc:
                assert exc.code == "path_exists", exc.detail
                os.unlink(os.path.join(app, "src"))
                continue
            moved += 1
            try:
                os.unlink(os.path.join(app, "dst"))
            except FileNotFoundError:
                lost += 1
    finally:
        replaced, made = map(int, creator.communicate(timeout=10)[0].split())
    assert (replaced, lost) == (0, 0), (moved, made)
    assert moved > 0
