"""``sandbox.files`` end to end: the runtime's file API (``/fs/*``), its typed refusals, and the
legacy fallback on a runtime without it (``tests/legacy_runtime.py``), through the local broker."""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import FileInfo, KubernetesAuth, Sandbox, WatchEvent
from k8s_agent_sandbox_awx.client.wire._dialect import SANDBOX_ENV
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    FileAPIUnsupportedError,
    SandboxFileError,
    SandboxFileExistsError,
    SandboxFileLimitError,
    SandboxFileNotFoundError,
    SandboxPathError,
)
from tests._support.isolation import ROOTS_ARE_MOUNTS, host_processes_only

# Data-plane behaviour is the same under both dialects: one dialect (v1) for most tests, and
# a small rpc data-plane smoke set (``RPC_SMOKE``: once per dialect) so that the /rpc data path
# stays covered. Tests whose behaviour depends on the dialect request ``dialect`` themselves.
pytestmark = pytest.mark.e2e
RPC_SMOKE = pytest.mark.usefixtures("dialect")  # once per dialect


@contextlib.contextmanager
def _sandbox(broker: Any, template: str = "python", **options: Any) -> Iterator[Sandbox]:
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    auth = KubernetesAuth(env.pop("AGENT_SANDBOX_TOKEN_FILE"))
    with Sandbox.create(template=template, auth=auth, environ=env, timeout=100, **options) as sb:
        yield sb


@RPC_SMOKE
def test_every_file_operation(files_broker: Any, tmp_path: Path) -> None:
    with _sandbox(files_broker) as sb:
        files = sb.files
        info = files.write("d/a.txt", b"hello")
        assert isinstance(info, FileInfo)
        assert (info.name, info.path, info.type, info.size) == ("a.txt", "/app/d/a.txt", "file", 5)
        assert info.permissions is not None and info.mod_time is not None
        assert files.write("d/b.txt", "héllo").size == len("héllo".encode())
        assert files.write("d/c.bin", io.BytesIO(b"xyz")).size == 3
        assert files.write("d/g.bin", (bytes([i]) * 1000 for i in range(10))).size == 10_000
        local = tmp_path / "up.bin"
        local.write_bytes(b"u" * 5000)
        assert files.write_from("d/up.bin", local).size == 5000
        batch = files.write([("e/1.txt", b"1"), ("e/2.txt", "2")])
        assert [i.path for i in batch] == ["/app/e/1.txt", "/app/e/2.txt"]

        assert files.read("d/a.txt") == b"hello"
        assert files.read("/app/d/b.txt", format="text") == "héllo"
        with contextlib.closing(files.read("d/g.bin", format="stream")) as chunks:
            assert b"".join(chunks) == b"".join(bytes([i]) * 1000 for i in range(10))
        with pytest.raises(ValueError, match="format"):
            files.read("d/a.txt", format="json")

        listing = files.list("d")
        assert [e.name for e in listing] == ["a.txt", "b.txt", "c.bin", "g.bin", "up.bin"]
        assert all(isinstance(e, FileInfo) and e.path.startswith("/app/d/") for e in listing)
        assert listing[0].modified is not None and listing[0].mode is not None
        assert files.exists("d/a.txt") and not files.exists("d/nope")
        assert files.get_info("d").type == "directory"

        assert files.make_dir("m/n") is True
        assert files.make_dir("m/n") is False
        assert files.move("d/a.txt", "m/n/a.txt").path == "/app/m/n/a.txt"
        with pytest.raises(SandboxFileExistsError) as exists:
            files.move("d/b.txt", "m/n/a.txt")
        assert exists.value.code == "path_exists" and exists.value.sandbox_path == "m/n/a.txt"
        assert "m/n/a.txt" in str(exists.value)
        assert files.move("d/b.txt", "m/n/a.txt", overwrite=True).size == len("héllo".encode())
        assert files.read("m/n/a.txt", format="text") == "héllo"

        assert files.remove("d/nope") is False
        with pytest.raises(SandboxFileError) as not_empty:
            files.remove("m")
        assert not_empty.value.code == "not_empty" and "recursive" in str(not_empty.value)
        assert files.remove("m", recursive=True) is True
        assert not files.exists("m")

        assert files.write("/workspace/w.txt", b"kept").path == "/workspace/w.txt"
        assert files.read("/app/workspace/w.txt") == b"kept"  # the alias


def test_runtime_refusals_are_typed_errors(files_broker: Any) -> None:
    with _sandbox(files_broker) as sb:
        files = sb.files
        with pytest.raises(SandboxFileNotFoundError) as missing:
            files.read("no/such.txt")
        assert missing.value.code == "path_not_found"
        assert missing.value.sandbox_path == "no/such.txt" and "no/such.txt" in str(missing.value)
        with pytest.raises(SandboxPathError) as outside:
            files.write("/etc/passwd", b"x")
        assert outside.value.code == "path_outside_root" and "/etc/passwd" in str(outside.value)
        with pytest.raises(SandboxPathError, match="path_invalid"):
            files.read("a/../b")
        with pytest.raises(SandboxFileNotFoundError):
            files.list("nothing-here")
        with pytest.raises(SandboxFileError) as cross:
            files.write("/workspace/x", b"1")
            files.move("/workspace/x", "/app/x")
        assert cross.value.code == "cross_root"
        assert isinstance(cross.value, BrokerError)  # catchable as before
        for bad in ("a\nb", "tab\there", "nul\x00"):
            with pytest.raises(ValueError, match="control character"):
                files.write(bad, b"x")
            with pytest.raises(ValueError, match="control character"):
                files.remove(bad)


@pytest.mark.dialect_feature(SANDBOX_ENV, reason="the runtime's read limit is set through it")
def test_a_file_over_the_read_limit_is_read_through_download(files_broker: Any) -> None:
    with _sandbox(files_broker, env={"SANDBOX_FS_READ_MAX_BYTES": "1000"}) as sb:
        data = bytes(range(256)) * 20
        sb.files.write("big.bin", data)
        assert sb.files.read("big.bin") == data
        assert b"".join(sb.files.read("big.bin", format="stream")) == data
        sb.files.write("/workspace/big.bin", data)  # the legacy endpoints cannot reach it
        with pytest.raises(SandboxFileLimitError, match="SANDBOX_FS_READ_MAX_BYTES"):
            sb.files.read("/workspace/big.bin")


@RPC_SMOKE
def test_a_runtime_without_the_file_api(files_broker: Any) -> None:
    with _sandbox(files_broker, template="legacy") as sb:
        files = sb.files
        assert files.write("d/a.txt", b"hello").size == 5
        assert files.write("d/s.bin", iter([b"one-", b"shot"])).size == 8  # probed first
        assert files.read("/app/d/a.txt") == b"hello"
        assert files.read("d/s.bin", format="text") == "one-shot"
        assert [e.name for e in files.list("d")] == ["a.txt", "s.bin"]
        assert files.exists("d/a.txt") and not files.exists("d/b")
        for operation in (
            lambda: files.make_dir("x"),
            lambda: files.get_info("d/a.txt"),
            lambda: files.move("d/a.txt", "d/b.txt"),
            lambda: files.remove("d/a.txt"),
            lambda: next(files.watch_dir("d", timeout=1)),
            lambda: files.write("/workspace/a.txt", b"x"),
        ):
            with pytest.raises(FileAPIUnsupportedError, match=r"file API \(/fs/\*"):
                operation()


@RPC_SMOKE
def test_watch_dir_sees_a_file_created_by_a_command(files_broker: Any) -> None:
    with _sandbox(files_broker) as sb:
        sb.files.make_dir("w")
        sb.files.write("w/old.txt", b"1")
        events: list[WatchEvent] = []
        removed = threading.Event()
        watch = sb.files.watch_dir("w", timeout=None)  # until closed: one 20 s request

        def follow() -> None:
            for event in watch:
                events.append(event)
                if event.type == "removed":
                    removed.set()
                    return

        thread = threading.Thread(target=follow)
        thread.start()
        time.sleep(1.0)  # the snapshot is taken
        sb.commands.run("touch w/new.txt")
        sb.commands.run("rm w/old.txt")
        # delivered as they happen (the runtime polls every 250 ms), not when the request ends
        assert removed.wait(10), f"no live events within 10 s: {events}"
        thread.join(5)
        assert not thread.is_alive()
        kinds = [(e.type, e.path) for e in events]
        assert ("created", "/app/w/new.txt") in kinds
        assert ("removed", "/app/w/old.txt") in kinds
        created = next(e for e in events if e.type == "created")
        assert created.entry is not None and created.entry.name == "new.txt"


def test_a_write_in_progress_is_not_an_entry(files_broker: Any) -> None:
    """A write goes to a temporary file renamed over the target at its end: listings and
    watches (which poll the directory) never show that temporary file (a watch used to report
    it as a created file when a poll fell inside a write)."""
    with _sandbox(files_broker) as sb:
        sb.files.make_dir("t")
        sb.commands.run("touch t/.fs-write-0123456789abcdef t/kept.txt")  # as one looks mid-write
        assert [e.name for e in sb.files.list("t")] == ["kept.txt"]
        events: list[WatchEvent] = []
        watch = sb.files.watch_dir("t", timeout=1.5)
        thread = threading.Thread(target=lambda: events.extend(watch))
        thread.start()
        time.sleep(0.5)
        sb.commands.run("touch t/.fs-write-fedcba9876543210 t/new.txt")
        thread.join(10)
        assert [(e.type, e.path) for e in events] == [("created", "/app/t/new.txt")]


def test_watch_dir_closes_cleanly_and_ends_at_its_timeout(files_broker: Any) -> None:
    with _sandbox(files_broker) as sb:
        sb.files.make_dir("quiet")
        started = time.monotonic()
        assert list(sb.files.watch_dir("quiet", timeout=1.5)) == []
        assert time.monotonic() - started < 10
        watch = sb.files.watch_dir("quiet", timeout=30)
        watch.close()  # before it started: nothing was sent
        with pytest.raises(ValueError, match="timeout"):
            sb.files.watch_dir("quiet", timeout=0)


@pytest.mark.slow
def test_watch_dir_reconnects_and_loses_no_change(
    files_broker: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Short segments (1 s instead of 20): every reconnection reads the token again and diffs
    the runtime's new snapshot, so files created around the reconnections each arrive once."""
    from k8s_agent_sandbox_awx.client.core import _fsapi

    monkeypatch.setattr(_fsapi, "MAX_WATCH_SEGMENT", 1.0)
    with _sandbox(files_broker) as sb:
        sb.files.make_dir("r/sub")
        events: list[WatchEvent] = []
        watch = sb.files.watch_dir("r", timeout=6, recursive=True)
        thread = threading.Thread(target=lambda: events.extend(watch))
        with caplog.at_level("DEBUG", logger="k8s_agent_sandbox_awx.transport"):
            thread.start()
            time.sleep(0.5)
            for i in range(8):
                sb.files.write(f"r/sub/{i}.txt", b"x")
                time.sleep(0.4)
            thread.join(15)
        assert not thread.is_alive()
        created = sorted(e.path for e in events if e.type == "created")
        assert created == [f"/app/r/sub/{i}.txt" for i in range(8)]  # each once, none lost
        segments = caplog.text.count("GET /fs/watch -> 200")
        assert segments >= 4, caplog.text[-2000:]


DEEP_TREE = (
    "python3 -c 'import os\n"
    'os.mkdir("deep"); os.chdir("deep")\n'
    "for _ in range(3000):\n"
    '    os.mkdir("d"); os.chdir("d")\n'
    'open("leaf", "w").close()\''
)
"""3,000 nested directories (deeper than Python's recursion limit, longer than PATH_MAX)."""


def test_remove_recursive_of_a_tree_deeper_than_the_recursion_limit(files_broker: Any) -> None:
    with _sandbox(files_broker) as sb:
        assert sb.commands.run(DEEP_TREE).exit_code == 0
        assert sb.files.get_info("deep/d/d/d").type == "directory"
        assert sb.files.remove("deep", recursive=True) is True
        assert not sb.files.exists("deep")


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("outside")
    return outside


@host_processes_only(ROOTS_ARE_MOUNTS)
def test_a_replaced_workspace_is_a_typed_error_never_followed(
    files_broker: Any, tmp_path: Path
) -> None:
    outside = _outside(tmp_path)
    with _sandbox(files_broker) as sb:
        files = sb.files
        files.write("/workspace/mine.txt", b"mine")
        swap = f'rm -rf "$SANDBOX_WORKSPACE_DIR" && ln -s {outside} "$SANDBOX_WORKSPACE_DIR"'
        assert sb.commands.run(swap).exit_code == 0
        for operation in (
            lambda: files.list("/workspace"),
            lambda: files.read("/workspace/secret.txt"),
            lambda: files.write("/workspace/new.txt", b"x"),
            lambda: files.remove("/workspace/secret.txt"),
            lambda: files.exists("/workspace/secret.txt"),
        ):
            with pytest.raises(SandboxPathError) as replaced:
                operation()
            assert replaced.value.code == "root_replaced"
            assert "/workspace is no longer the directory it was" in str(replaced.value)
        files.write("ok.txt", b"ok")  # /app still works
        assert files.read("/app/ok.txt") == b"ok"
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "outside"


@host_processes_only(ROOTS_ARE_MOUNTS)
def test_a_replaced_base_directory_is_a_typed_error_on_the_legacy_endpoints(
    files_broker: Any, tmp_path: Path
) -> None:
    outside = _outside(tmp_path)
    with _sandbox(files_broker, template="legacy") as sb:
        base = '"$SANDBOX_BASE_DIR"'
        swap = f"cd / && mv {base} {base}.old && cp -r {outside} {base}"
        assert sb.commands.run(swap).exit_code == 0
        for operation in (
            lambda: sb.files.read("secret.txt"),
            lambda: sb.files.list("."),
            lambda: sb.files.exists("secret.txt"),
            lambda: sb.files.write("new.txt", b"x"),
        ):
            with pytest.raises(SandboxPathError) as replaced:
                operation()
            assert replaced.value.code == "root_replaced"
            assert "/app is no longer the directory it was" in str(replaced.value)
    assert sorted(os.listdir(outside)) == ["secret.txt"]
