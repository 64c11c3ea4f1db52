"""The local runtime's semantics, through the broker: shlex without a shell, time limit, paths."""

from __future__ import annotations

import time
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker

MIB = 1024 * 1024


def test_runs_without_a_shell(alice: Any, sandbox: dict[str, Any]) -> None:
    out = alice.run(sandbox, "echo $HOME '|' `id` ; ls").json()
    assert out == {
        "stdout": "$HOME | `id` ; ls\n",
        "stderr": "",
        "exit_code": 0,
        "timed_out": False,
        "output_truncated": False,
    }


def test_shlex_quoting(alice: Any, sandbox: dict[str, Any]) -> None:
    out = alice.run(sandbox, "python3 -c 'import sys; print(sys.argv[1:])' \"a b\" c").json()
    assert out["stdout"] == "['a b', 'c']\n"


def test_nonzero_exit_is_a_result(alice: Any, sandbox: dict[str, Any]) -> None:
    out = alice.run(sandbox, "python3 -c 'import sys; sys.stderr.write(\"no\"); sys.exit(3)'")
    assert out.status_code == 200
    assert out.json()["exit_code"] == 3
    assert out.json()["stderr"] == "no"


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        ("definitely-not-a-command-xyz", "definitely-not-a-command-xyz"),
        ("echo 'unbalanced", "cannot parse"),
        ("", "empty command"),
        ("echo a\x00b", "null byte"),
    ],
)
def test_unstartable_command_is_exit_1(
    alice: Any, sandbox: dict[str, Any], command: str, reason: str
) -> None:
    resp = alice.run(sandbox, command)
    assert resp.status_code == 200
    out = resp.json()
    assert out["exit_code"] == 1
    assert reason in out["stderr"]
    assert out["timed_out"] is False


def test_command_with_a_lone_surrogate_is_exit_1(alice: Any, sandbox: dict[str, Any]) -> None:
    """Valid JSON ('\\ud800' escape) that no file system encoding can pass to exec."""
    resp = alice.http.post(
        "/execute",
        content=b'{"command": "echo \\ud800"}',
        headers={**alice.data_headers(sandbox), "Content-Type": "application/json"},
    )
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["exit_code"] == 1
    assert "surrogates not allowed" in out["stderr"]


def test_time_limit_kills_the_process_group(alice: Any, sandbox: dict[str, Any]) -> None:
    started = time.monotonic()
    command = (
        "python3 -c 'import subprocess, time; "
        'subprocess.Popen(["sleep", "30"]); print("started", flush=True); time.sleep(30)\''
    )
    # 3 s: a loaded machine can take over a second to start python3 and print
    out = alice.run(sandbox, command, timeout_seconds=3).json()
    assert out["timed_out"] is True
    assert out["exit_code"] == 124
    assert "started" in out["stdout"]
    assert time.monotonic() - started < 10


def test_commands_run_in_the_base_directory(alice: Any, sandbox: dict[str, Any]) -> None:
    alice.run(sandbox, 'python3 -c \'open("made-here.txt", "w").write("x")\'')
    exists = alice.http.get("/exists/made-here.txt", headers=alice.data_headers(sandbox))
    assert exists.json() == {"path": "made-here.txt", "exists": True}


@pytest.mark.parametrize(
    "path",
    ["..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "a%2F..%2F..%2Fescape"],
)
@pytest.mark.parametrize("verb", ["download", "list", "exists"])
def test_path_escape_is_403(alice: Any, sandbox: dict[str, Any], verb: str, path: str) -> None:
    resp = alice.http.get(f"/{verb}/{path}", headers=alice.data_headers(sandbox))
    assert resp.status_code == 403
    assert "escapes" in resp.json()["detail"]
    assert "code" not in resp.json()  # the runtime's own body, passed through


def test_symlink_escape_is_403(alice: Any, sandbox: dict[str, Any]) -> None:
    alice.run(sandbox, "ln -s /etc outside")
    resp = alice.http.get("/download/outside%2Fpasswd", headers=alice.data_headers(sandbox))
    assert resp.status_code == 403


@pytest.mark.parametrize("name", ["../escape.txt", "/tmp/escape.txt"])
def test_upload_escape_is_403(alice: Any, sandbox: dict[str, Any], name: str) -> None:
    resp = alice.http.post(
        "/upload", files={"file": (name, b"x")}, headers=alice.data_headers(sandbox)
    )
    assert resp.status_code == 403


def test_files_round_trip(alice: Any, sandbox: dict[str, Any]) -> None:
    headers = alice.data_headers(sandbox)
    resp = alice.http.post("/upload", files={"file": ("a/b/c.txt", b"hello")}, headers=headers)
    assert resp.json() == {"path": "a/b/c.txt", "size": 5}
    assert alice.http.get("/download/a%2Fb%2Fc.txt", headers=headers).content == b"hello"
    assert alice.http.get("/download/a/b/c.txt", headers=headers).content == b"hello"
    listing = alice.http.get("/list/a", headers=headers).json()
    assert [(e["name"], e["type"]) for e in listing] == [("b", "directory")]
    (entry,) = alice.http.get("/list/a%2Fb", headers=headers).json()
    assert entry["name"] == "c.txt"
    assert entry["size"] == 5
    assert entry["type"] == "file"
    assert isinstance(entry["mod_time"], float)
    assert alice.http.get("/download/missing", headers=headers).status_code == 404
    assert alice.http.get("/list/a%2Fb%2Fc.txt", headers=headers).status_code == 404
    assert alice.http.get("/exists/nope", headers=headers).json()["exists"] is False


def test_custom_runtime_command(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready(template="echo")
    resp = alice.http.get("/whatever", headers=alice.data_headers(sandbox))
    assert resp.json()["path"] == "/whatever"


def test_broken_runtime_command_fails_the_sandbox(api: Any) -> None:
    with LocalBroker(runtime_command="{python} -c 'import sys; sys.exit(7)'", warn=False) as b:
        client = api(b.issue_kubernetes_token("team-a", "alice"), b)
        name = client.create().json()["name"]
        state = client.http.get(f"/v1/sandboxes/{name}", params={"wait": "ready"}).json()
        assert state["phase"] == "Failed"
        assert state["reason"] == "RuntimeExited"
        assert "status 7" in state["message"]


def test_sandbox_does_not_inherit_credentials(
    broker: LocalBroker, alice: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", "secret-token-value")
    monkeypatch.setenv("CI_JOB_JWT_V2", "secret-jwt-value")
    sandbox = alice.ready(env={"MINE": "yes"})
    out = alice.run(sandbox, "env").json()["stdout"]
    assert "secret-token-value" not in out
    assert "secret-jwt-value" not in out
    assert "MINE=yes" in out
    assert "PATH=" in out


def test_large_upload_to_an_escaping_path_gets_the_runtime_403(
    alice: Any, sandbox: dict[str, Any]
) -> None:
    boundary = "b0undary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="../x"\r\n\r\n'
    ).encode()

    def body() -> Any:
        yield head
        for _ in range(16):
            yield b"x" * (1 << 20)
        yield f"\r\n--{boundary}--\r\n".encode()

    resp = alice.http.post(
        "/upload",
        content=body(),
        headers=alice.data_headers(
            sandbox, **{"Content-Type": f"multipart/form-data; boundary={boundary}"}
        ),
    )
    assert resp.status_code == 403
    assert "escapes" in resp.json()["detail"]


def test_exec_mode_runtime(api: Any) -> None:
    from k8s_agent_sandbox_awx.testing import LocalProcessLauncher

    backend = LocalProcessLauncher(fork_server=False)
    with LocalBroker(backend=backend, warn=False) as b:
        client = api(b.issue_kubernetes_token("team-a", "alice"), b)
        sandbox = client.ready()
        out = client.run(sandbox, "python3 -c 'print(6 * 7)'").json()
        assert out["stdout"] == "42\n"
        pid = b.runtime_pid(sandbox["name"])
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            assert b"k8s_agent_sandbox_awx.broker.runtime" in fh.read()


def _peak_rss(pid: int) -> int:
    """The process's peak resident set size (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_output_is_capped_flagged_and_never_held_in_memory(
    broker: LocalBroker, alice: Any, sandbox: dict[str, Any]
) -> None:
    """50 MB of NUL bytes on stdout and 5 MB on stderr: the runtime keeps the first 1 MiB of
    each, reads and drops the rest (the command is not blocked on a full pipe), flags the answer,
    and its peak memory does not grow with the output."""
    pid = broker.runtime_pid(sandbox["name"])
    assert pid is not None
    before = _peak_rss(pid)
    command = "sh -c 'head -c 50000000 /dev/zero; head -c 5000000 /dev/zero >&2; echo done >&2'"
    resp = alice.run(sandbox, command)
    assert resp.status_code == 200
    out = resp.json()
    assert (out["exit_code"], out["timed_out"], out["output_truncated"]) == (0, False, True)
    assert out["stdout"] == "\0" * MIB
    assert out["stderr"] == "\0" * MIB  # the first MiB: "done" came after it
    assert _peak_rss(pid) - before < 64 * MIB
    small = alice.run(sandbox, f"head -c {MIB} /dev/zero").json()  # exactly the cap: all of it
    assert (len(small["stdout"]), small["output_truncated"]) == (MIB, False)


def test_truncated_output_of_a_timed_out_command_is_kept(
    alice: Any, sandbox: dict[str, Any]
) -> None:
    command = "sh -c 'head -c 3000000 /dev/zero; echo late >&2; sleep 30'"
    out = alice.run(sandbox, command, timeout_seconds=1).json()
    assert (out["exit_code"], out["timed_out"], out["output_truncated"]) == (124, True, True)
    assert out["stdout"] == "\0" * MIB
    assert out["stderr"].startswith("late\n")
