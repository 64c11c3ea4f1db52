"""Issue 19, attacked: ways around the rules of its fixes that still work on the local broker
and runtime. Each test states the rule it holds the code to and is a strict ``xfail`` until the
defect is fixed (then it passes, and the marker goes).

- a lowercase method (``post /execute``) runs a command the broker does not count (item 1:
  counting is decided on what is forwarded, and httpx forwards ``POST``);
- a body the broker frames differently from the client (a ``GET`` with a body, a chunked body
  that also declares a ``Content-Length``) is a ``500`` and an "Exception in ASGI application"
  traceback (item 13);
- a lone surrogate in a command's argv or environment kills the runtime's answer: ``502``, and a
  command left ``running`` forever without a process, which fills ``max_running`` (items 2/11);
- ``cwd="/workspace"`` follows a replaced root (item 5);
- a reader that replays from ``after=0`` again and again holds the command forever (item 2);
- a process id used again makes a new sandbox ``Failed`` (``RuntimeExited``), and its runtime
  outlives its delete: the fork server remembers every exit by pid forever (items 4/14);
- a broker started in another PID namespace (a container sharing ``/tmp``) takes every live
  broker for dead and removes its directory, CA and sandboxes included (item 4's sweep).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.isolation import PID_LAYOUT, ROOTS_ARE_MOUNTS, host_processes_only


def _raw(
    broker: LocalBroker,
    api: Any,
    sandbox: dict[str, Any],
    method: str,
    target: str,
    body: bytes = b"",
    extra: tuple[str, ...] = (),
    *,
    content_length: bool = True,
) -> tuple[int, bytes, bytes]:
    """``method target`` byte for byte over TLS (no client library rewrites it)."""
    url = urllib.parse.urlsplit(broker.url)
    host, port = url.hostname or "", url.port or 443
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    if content_length:
        lines.append(f"Content-Length: {len(body)}")
    lines += ["Content-Type: application/json", f"Authorization: Bearer {api.token}"]
    lines += [f"{k}: {v}" for k, v in api.data_headers(sandbox).items()]
    lines += list(extra)
    context = ssl.create_default_context(cafile=broker.ca_bundle)
    with (
        socket.create_connection((host, port), timeout=15) as sock,
        context.wrap_socket(sock, server_hostname=host) as tls,
    ):
        tls.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, rest


# -- item 1: what is counted is what is forwarded -------------------------------------------------


@pytest.mark.parametrize("path", ["/execute", "/commands"])
def test_a_lowercase_method_is_counted_or_refused(
    broker: LocalBroker, alice: Any, path: str
) -> None:
    """``post /execute`` (h11 accepts any token as a method) reaches the runtime as ``POST``:
    it must be counted like ``POST`` (or refused); else a test's "never runs twice" check, and
    ``drop_connection_after_execute``, miss it."""
    sandbox = alice.ready()
    marker = Path(tempfile.mkdtemp()) / "ran"
    command: Any = f"touch {marker}" if path == "/execute" else ["touch", str(marker)]
    status, _, body = _raw(
        broker, alice, sandbox, "post", path, json.dumps({"command": command}).encode()
    )
    deadline = time.monotonic() + 5
    while status == 200 and not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not marker.exists() or broker.execution_count(sandbox["name"]) == 1, (status, body)
    shutil.rmtree(marker.parent, ignore_errors=True)


# -- item 13: no traceback for a body the broker frames differently -------------------------------

FRAMINGS = {
    "a GET with a body": ("GET", "/fs/list?path=/app", b"hello", (), True),
    "chunked and a Content-Length": (
        "POST",
        "/fs/mkdir",
        b'1a\r\n{"path": "/app/d", "x": 1}\r\n0\r\n\r\n',
        ("Transfer-Encoding: chunked", "Content-Length: 5"),
        False,
    ),
}


@pytest.mark.parametrize("framing", list(FRAMINGS))
def test_a_body_framed_differently_is_no_500_and_no_traceback(
    broker: LocalBroker, alice: Any, framing: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    method, target, body, extra, content_length = FRAMINGS[framing]
    sandbox = alice.ready()
    status, _, answer = _raw(
        broker, alice, sandbox, method, target, body, extra, content_length=content_length
    )
    assert status < 500, answer[:200]
    assert "Exception in ASGI application" not in caplog.text


# -- a lone surrogate: a refusal, not a broken runtime answer and a ghost command -----------------


@pytest.mark.parametrize("where", ["argv", "envs"])
def test_a_lone_surrogate_is_refused_and_leaves_no_ghost_command(alice: Any, where: str) -> None:
    """JSON can carry ``"\\ud800"``; the runtime must refuse it (400, like a NUL byte), not die
    in the answer (the broker's 502 tells the client to create a new sandbox) and leave a
    command ``running`` with no process: it cannot be killed, is never swept, and counts
    against ``SANDBOX_COMMAND_MAX_RUNNING``, so the sandbox soon refuses every command."""
    sandbox = alice.ready(env={"SANDBOX_COMMAND_MAX_RUNNING": "1"})
    headers = alice.data_headers(sandbox)
    bad: dict[str, Any] = {"command": ["echo", "\ud800"]}
    if where == "envs":
        bad = {"command": ["true"], "envs": {"A": "\ud800"}}
    # json.dumps escapes the surrogate as \ud800: a valid JSON body
    started = alice.http.post("/commands", content=json.dumps(bad), headers=headers)
    assert started.status_code == 400, started.text
    after = alice.http.post("/commands", json={"command": ["true"]}, headers=headers)
    assert after.status_code == 200, after.text  # max_running (1) is not taken by a ghost
    listed = alice.http.get("/commands", headers=headers).json()["commands"]
    assert [c for c in listed if c["state"] == "running" and c["pid"] is None] == []


# -- item 5: a command's cwd under a replaced root ------------------------------------------------


@host_processes_only(ROOTS_ARE_MOUNTS)
def test_a_command_cwd_never_follows_a_replaced_root(alice: Any, tmp_path: Path) -> None:
    sandbox = alice.ready()
    outside = tmp_path / "outside"
    outside.mkdir()
    swapped = alice.run(
        sandbox,
        f'sh -c "rm -rf $SANDBOX_WORKSPACE_DIR && ln -s {outside} $SANDBOX_WORKSPACE_DIR"',
    ).json()
    assert swapped["exit_code"] == 0, swapped
    headers = alice.data_headers(sandbox)
    refused = alice.http.get("/fs/list", params={"path": "/workspace"}, headers=headers)
    assert refused.json()["code"] == "root_replaced"  # the file API's rule
    started = alice.http.post(
        "/commands",
        json={"command": ["touch", "written-through-cwd"], "cwd": "/workspace"},
        headers=headers,
    )
    time.sleep(0.5)
    assert not (outside / "written-through-cwd").exists()
    assert started.status_code in (400, 403), started.text


# -- item 2: a reader that never acknowledges -----------------------------------------------------

SMALL_WINDOW = {
    "SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES": "4096",
    "SANDBOX_COMMAND_LIVE_WINDOW_BYTES": "16384",
    "SANDBOX_COMMAND_UNACKED_BYTES": "65536",
}
CHATTY = [
    "python3",
    "-u",
    "-c",
    "import time\nwhile True:\n    print('x' * 60)\n    time.sleep(0.0005)",
]


@pytest.mark.slow
def test_a_reader_replaying_from_the_start_does_not_hold_the_command(
    broker: LocalBroker, alice: Any
) -> None:
    """Reading is not acknowledging: a raw client that reads every stream to its end and then
    asks for ``after=0`` again never moves its pin, so nothing after the retained output may
    leave the window and the window's bound (its size plus ``SANDBOX_COMMAND_UNACKED_BYTES``)
    becomes a wall the command waits at, indefinitely. The command must keep running (a pin
    that never moves should give way at that bound, as a stalled reader's does)."""
    sandbox = alice.ready(env=SMALL_WINDOW)
    headers = alice.data_headers(sandbox)
    started = alice.http.post("/commands", json={"command": CHATTY, "timeout": 60}, headers=headers)
    command_id = started.json()["command_id"]

    def last_seq() -> int:
        status = alice.http.get(f"/commands/{command_id}", headers=headers).json()
        return int(status["last_seq"])

    stop = threading.Event()

    def replay_from_zero() -> None:
        with httpx.Client(
            base_url=broker.url,
            verify=ssl.create_default_context(cafile=broker.ca_bundle),
            headers={"Authorization": f"Bearer {alice.token}", **headers},
            timeout=30,
        ) as http:
            while not stop.is_set():
                params = {"after": 0, "duration": 2}
                with http.stream("GET", f"/commands/{command_id}/events", params=params) as r:
                    for _ in r.iter_bytes():
                        pass

    reader = threading.Thread(target=replay_from_zero, daemon=True)
    reader.start()
    try:
        time.sleep(7)  # past the start's own 5 s hold
        before = last_seq()
        time.sleep(3)
        progressed = last_seq() - before
    finally:
        stop.set()
        reader.join(15)
        alice.http.post(f"/commands/{command_id}/kill", headers=headers)
    assert progressed > 100, progressed  # unheld it prints more than 1,000 lines a second


# -- items 4/14: the fork server's memory of exits, and the sweep of dead brokers -----------------


@functools.cache
def _private_pid_namespace() -> bool:
    """Whether this process may run a child in a new PID namespace and set its next PID."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = "echo 100 > /proc/sys/kernel/ns_last_pid"
    try:
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", probe],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture
def pid_namespace() -> None:
    if not _private_pid_namespace():
        pytest.skip("needs unshare(1) and the right to make a PID namespace and set its next PID")


def _in_pid_namespace(script: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under a new PID namespace with TMPDIR=``tmp``: the brokers it starts sweep
    only ``tmp``, never this machine's temporary directory (where other brokers live)."""
    path = tmp / "script.py"
    path.write_text(textwrap.dedent(script))
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": src}
    argv = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(path), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


PID_REUSE = """
    import json, os, ssl, time, httpx
    from k8s_agent_sandbox_awx.testing import LocalBroker
    out = {}
    with LocalBroker(warn=False) as b:
        token = b.issue_kubernetes_token("team-a", "alice")
        tls = ssl.create_default_context(cafile=b.ca_bundle)
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=b.url, verify=tls, headers=auth, timeout=30) as h:
            def ready():
                name = h.post("/v1/sandboxes", json={}).json()["name"]
                params = {"wait": "ready", "timeout": 20}
                return name, h.get(f"/v1/sandboxes/{name}", params=params).json()
            first, _ = ready()
            pid = b.runtime_pid(first)
            h.delete(f"/v1/sandboxes/{first}")
            while h.get(f"/v1/sandboxes/{first}").status_code != 404:
                time.sleep(0.05)
            time.sleep(0.5)
            # the next sandbox's supervisor and runtime get the pids the first one had
            with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
                fh.write(str(pid - 2))
            second, obj = ready()
            out["phase"], out["message"] = obj["phase"], obj.get("message")
            h.delete(f"/v1/sandboxes/{second}")
            while h.get(f"/v1/sandboxes/{second}").status_code != 404:
                time.sleep(0.05)
            time.sleep(1)  # its runtime is stopped by now
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    out["left_running"] = b"--fork-server" in fh.read()
            except FileNotFoundError:
                out["left_running"] = False
    print(json.dumps(out))
"""


@host_processes_only(PID_LAYOUT)
@pytest.mark.usefixtures("pid_namespace")
def test_a_pid_used_again_is_a_new_runtime(tmp_path: Path) -> None:
    """With ``pid_max`` 32768 (this machine, many containers) a long-running ``dev`` broker
    wraps around PIDs. Forced here in a private PID namespace (``ns_last_pid``)."""
    done = _in_pid_namespace(PID_REUSE, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["phase"] == "Ready", out
    assert not out["left_running"], out


SWEEPER = """
    from k8s_agent_sandbox_awx.testing import LocalBroker
    with LocalBroker(warn=False):
        pass
"""


@pytest.mark.usefixtures("pid_namespace")
def test_a_broker_in_another_pid_namespace_leaves_live_brokers_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this broker lives in tmp_path too
    with LocalBroker(warn=False) as live:
        assert live._tmp is not None and live._tmp.startswith(str(tmp_path))
        done = _in_pid_namespace(SWEEPER, tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        assert os.path.isfile(live.ca_bundle), "the live broker's CA was removed"
        token = live.issue_kubernetes_token("team-a", "alice")
        tls = ssl.create_default_context(cafile=live.ca_bundle)
        with httpx.Client(base_url=live.url, verify=tls, timeout=30) as http:
            created = http.post(
                "/v1/sandboxes", json={}, headers={"Authorization": f"Bearer {token}"}
            )
            assert created.status_code == 201, created.text
