"""Isolated local sandboxes (bubblewrap): what a sandbox sees and reaches, through the broker.

Real HTTPS, real tokens, httpx. The tests that need a working ``bwrap`` skip where it cannot
run, unless ``AGENT_SANDBOX_REQUIRE_BWRAP=1`` (CI sets it): then they fail, and so does
``test_bubblewrap_works_where_it_is_required``. The others (the choice of isolation, the probe,
the refusals) run everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.broker.backends.local import _bubblewrap
from k8s_agent_sandbox_awx.testing import (
    BWRAP_ISOLATION_WARNING,
    NO_ISOLATION_WARNING,
    IsolationUnavailable,
    LocalBroker,
    LocalProcessLauncher,
    Policy,
    caller_namespace,
)
from tests._support.isolation import REQUIRED, need_bwrap


def test_bubblewrap_works_where_it_is_required() -> None:
    if not REQUIRED:
        pytest.skip("bubblewrap is required only with AGENT_SANDBOX_REQUIRE_BWRAP=1 (CI sets it)")
    probe = _bubblewrap.probe_bwrap()
    assert probe.works, probe.detail


def test_the_requirement_fails_the_run_where_bwrap_is_missing(tmp_path: Path) -> None:
    """The CI gate itself: with AGENT_SANDBOX_REQUIRE_BWRAP=1 and no bwrap on PATH, the test
    above fails (a pytest of its own, whose PATH has no bwrap); without the variable it skips."""
    (tmp_path / "bin").mkdir()
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs"]
    argv += [__file__, "-k", "test_bubblewrap_works_where_it_is_required"]
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "AGENT_SANDBOX_REQUIRE_BWRAP": "1"}
    root = Path(__file__).resolve().parents[2]
    required = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert required.returncode == 1, required.stdout[-2000:]
    assert "1 failed" in required.stdout and "bwrap is not installed" in required.stdout
    del env["AGENT_SANDBOX_REQUIRE_BWRAP"]
    optional = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert optional.returncode == 0, optional.stdout[-2000:]
    assert "1 skipped" in optional.stdout


ISOLATED_TEMPLATES: dict[str, str | list[str] | None] = {
    "python": None,
    # the built-in runtime started as a custom command, on the Unix socket it is given
    "socket": "{python} -m k8s_agent_sandbox_awx.broker.runtime --unix-socket {socket}",
    # a custom runtime on a TCP port
    "tcp": "{python} -m k8s_agent_sandbox_awx.broker.runtime --port-file {port_file}",
}


@pytest.fixture(scope="module")
def isolated() -> Iterator[LocalBroker]:
    """A broker whose sandboxes run in bubblewrap: Kubernetes callers' with the network on,
    GitLab callers' with it off."""
    need_bwrap()
    templates = tuple(ISOLATED_TEMPLATES)
    with LocalBroker(
        isolation="bwrap",
        warn=False,
        templates=ISOLATED_TEMPLATES,
        kubernetes_policy=Policy(templates=templates, namespace=caller_namespace),
        gitlab_policy=Policy(templates=templates, namespace="gitlab-ci", network=False),
    ) as broker:
        yield broker


@pytest.fixture
def on(isolated: LocalBroker, api: Callable[..., Any]) -> Iterator[Any]:
    """A client of the isolated broker whose sandboxes have the network."""
    yield api(isolated.issue_kubernetes_token("team-a", "alice"), isolated)
    isolated.reset()


@pytest.fixture
def off(isolated: LocalBroker, api: Callable[..., Any]) -> Iterator[Any]:
    """A client of the isolated broker whose sandboxes have no network (policy)."""
    yield api(isolated.issue_gitlab_token("group/project"), isolated)
    isolated.reset()


def _sh(client: Any, sandbox: dict[str, Any], script: str, **body: Any) -> dict[str, Any]:
    """``sh -c script`` through the broker's ``/execute``; its result."""
    resp = client.http.post(
        "/execute",
        json={"command": f"sh -c {_quote(script)}", **body},
        headers=client.data_headers(sandbox),
    )
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _start(client: Any, sandbox: dict[str, Any], argv: list[str], **body: Any) -> str:
    """Start a managed command (``/commands``); its id."""
    started = client.http.post(
        "/commands",
        json={"command": argv, "request_id": str(uuid.uuid4()), **body},
        headers=client.data_headers(sandbox),
    )
    assert started.status_code == 200, started.text
    command_id: str = started.json()["command_id"]
    return command_id


def _command(client: Any, sandbox: dict[str, Any], argv: list[str], **body: Any) -> dict[str, Any]:
    """A managed command (``/commands``) run to its end; its status (stdout, exit code)."""
    headers = client.data_headers(sandbox)
    command_id = _start(client, sandbox, argv, **body)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status: dict[str, Any] = client.http.get(f"/commands/{command_id}", headers=headers).json()
        if status["state"] != "running":
            return status
        time.sleep(0.02)
    raise AssertionError(f"command {argv} did not end: {status}")


# -- what a sandbox sees ------------------------------------------------------------------------
def test_pwd_in_a_workspace_cwd_prints_the_sandbox_path(on: Any) -> None:
    sandbox = on.ready()
    assert _sh(on, sandbox, "mkdir -p /workspace/p && pwd")["stdout"] == "/app\n"
    status = _command(on, sandbox, ["pwd"], cwd="/workspace/p")
    assert (status["exit_code"], status["stdout"], status["cwd"]) == (
        0,
        "/workspace/p\n",
        "/workspace/p",
    )
    env = _sh(on, sandbox, "echo $SANDBOX_BASE_DIR $SANDBOX_WORKSPACE_DIR")["stdout"]
    assert env == "/app /workspace\n"
    assert _sh(on, sandbox, "hostname")["stdout"] == f"{sandbox['name']}\n"


def test_the_host_file_system_is_read_only(on: Any, isolated: LocalBroker) -> None:
    sandbox = on.ready()
    # the host's directories, and ones this user can write on the host (the sandbox has a /tmp of
    # its own, so a checkout or home under /tmp is not seen there at all)
    mine = [os.path.dirname(os.path.abspath(__file__)), os.path.expanduser("~")]
    mine = [p for p in mine if os.path.isdir(p) and not p.startswith(tempfile.gettempdir())]
    mine = [p for p in mine if not (p + "/").startswith("/tmp/")]
    for path in ("/etc", "/usr", "/", *mine):
        target = os.path.join(path, f"agent-sandbox-{uuid.uuid4().hex}")
        result = _sh(on, sandbox, f"echo x > {target}")
        assert result["exit_code"] != 0, (path, result)
        assert "Read-only file system" in result["stderr"], result
        assert not os.path.exists(target)
    written = _sh(on, sandbox, "echo a > /app/a && echo w > /workspace/w && echo t > /tmp/t")
    assert written["exit_code"] == 0, written
    # /app and /workspace are the sandbox's own directories on the host
    root = Path(isolated._require_store().sandboxes[sandbox["name"]].handle.root)  # type: ignore[union-attr,arg-type]
    assert (root / "work" / "a").read_text() == "a\n"
    assert (root / "workspace" / "w").read_text() == "w\n"


def test_tmp_and_the_brokers_files_are_private(on: Any, isolated: LocalBroker) -> None:
    first, second = on.ready(), on.ready()
    marker = f"agent-sandbox-{uuid.uuid4().hex}"
    assert _sh(on, first, f"echo mine > /tmp/{marker}")["exit_code"] == 0
    assert _sh(on, first, f"cat /tmp/{marker}")["stdout"] == "mine\n"
    assert _sh(on, second, f"cat /tmp/{marker}")["exit_code"] != 0  # not another sandbox's
    assert not os.path.exists(os.path.join("/tmp", marker))  # nor the host's
    # neither the broker's key and CA nor another sandbox's directory can be read
    broker_dir = os.path.dirname(isolated.ca_bundle)
    store = isolated._require_store()
    other = store.sandboxes[second["name"]].handle.root  # type: ignore[union-attr]
    for path in (os.path.join(broker_dir, "server.pem"), isolated.ca_bundle, other):
        assert os.path.exists(path)  # on the host
        result = _sh(on, first, f"ls -d {path}")
        assert result["exit_code"] != 0, (path, result)


def test_a_runtime_script_the_template_names_under_tmp_is_seen_read_only(
    api: Callable[..., Any],
) -> None:
    """A template's command may name a host file under /tmp (a checkout there): the sandbox's
    /tmp is its own, so that one file is bound in, read-only; nothing else of the host's /tmp."""
    need_bwrap()
    host_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="awx-runtime-"))  # not the broker's
    try:
        script = host_dir / "runtime.py"
        script.write_text(
            "import runpy\nrunpy.run_module('k8s_agent_sandbox_awx.broker.runtime', "
            "run_name='__main__')\n"
        )
        (host_dir / "other").write_text("not for the sandbox")
        template = f"{{python}} {script} --port-file {{port_file}}"
        with LocalBroker(
            isolation="bwrap",
            warn=False,
            templates={"script": template},
            kubernetes_policy=Policy(templates=("script",), namespace=caller_namespace),
        ) as broker:
            client = api(broker.issue_kubernetes_token("team-a", "alice"), broker)
            sandbox = client.ready()
            seen = _sh(client, sandbox, f"cat {script}; ls {host_dir}; echo x >> {script}")
            assert "run_module" in seen["stdout"] and "other" not in seen["stdout"], seen
            assert "Read-only file system" in seen["stderr"], seen
        assert "x" not in script.read_text().splitlines()
    finally:
        for path in host_dir.iterdir():
            path.unlink()
        host_dir.rmdir()


def test_named_files_binds_only_files_hidden_by_a_private_directory(tmp_path: Path) -> None:
    script, hidden = tmp_path / "runtime.py", tmp_path / "broker"
    script.write_text("")
    hidden.mkdir()
    (hidden / "key.pem").write_text("")
    masked, secret = [str(tmp_path)], [str(hidden)]
    command = ["/usr/bin/python3", str(script), str(hidden / "key.pem"), str(tmp_path), "-m"]
    assert _bubblewrap.named_files(command, masked, [], secret) == [
        "--ro-bind-try", str(script), str(script)]  # fmt: skip
    assert _bubblewrap.named_files(command, [], [], secret) == []  # visible anyway: the host's
    # kept below a hidden directory (a venv under /tmp): seen already, nothing bound over it
    assert _bubblewrap.named_files(command, masked, [str(tmp_path)], secret) == []


def test_named_files_binds_where_a_link_leads_never_over_the_link(tmp_path: Path) -> None:
    """A venv's ``python`` under a kept directory of ``/tmp`` links to an interpreter under a
    hidden home (``network = false`` hides ``/root``): the interpreter is bound where the link
    leads (a bind over the link, inside the venv's read-only bind, failed: "bwrap: Can't
    create file at .../.venv/bin/python"), and nothing when that place is kept too."""
    venv, home = tmp_path / "tmp" / "clone" / ".venv", tmp_path / "root"
    (venv / "bin").mkdir(parents=True)
    (home / "bin").mkdir(parents=True)
    interpreter = home / "bin" / "python3.11"
    interpreter.write_text("")
    (venv / "bin" / "python").symlink_to(interpreter)
    command = [str(venv / "bin" / "python"), "-I", "-c", "pass"]
    masked, kept = [str(tmp_path / "tmp"), str(home)], [str(venv)]
    assert _bubblewrap.named_files(command, masked, kept, []) == [
        "--ro-bind-try", str(interpreter), str(interpreter)]  # fmt: skip
    assert _bubblewrap.named_files(command, masked, [*kept, str(home)], []) == []


def test_a_sandbox_sees_only_its_own_processes(on: Any) -> None:
    first, second = on.ready(), on.ready()
    n = uuid.uuid4().int
    marker = f"{1000 + n % 1000}.{n % 10**6:06d}"  # unique on the machine
    _start(on, first, ["sleep", marker])
    seen = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done"
    mine = _sh(on, first, seen)["stdout"]
    assert f"sleep {marker}" in mine
    theirs = _sh(on, second, seen)["stdout"]
    assert f"sleep {marker}" not in theirs
    assert "pytest" not in theirs and "fork-server" not in theirs
    pids = _sh(on, second, "ls -d /proc/[0-9]* | wc -l")["stdout"]
    assert int(pids) < 10, theirs  # bwrap's init, the runtime, the shell and what it runs


# -- the network --------------------------------------------------------------------------------
@contextlib.contextmanager
def _loopback_server() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP server on the host's 127.0.0.1 that records the first line of each connection."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    received: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    received.append(conn.makefile("rb").readline())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], received
    finally:
        stop.set()
        thread.join(5)
        server.close()


CONNECT = (
    "import socket, sys\n"
    "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5)\n"
    "s.sendall(b'hello from the sandbox\\n')\n"
    "s.close()\n"
)


def test_network_off_by_policy_reaches_nothing_but_the_broker_reaches_it(off: Any) -> None:
    sandbox = off.ready()  # the broker reached its runtime: it is Ready
    with _loopback_server() as (port, received):
        status = _command(off, sandbox, [sys.executable, "-c", CONNECT, str(port)])
        assert status["exit_code"] != 0, status
        assert "Connection refused" in status["stderr"] or "unreachable" in status["stderr"]
        time.sleep(0.2)
        assert received == []
    links = _sh(off, sandbox, "cat /proc/net/dev")["stdout"]
    assert [line.split(":")[0].strip() for line in links.splitlines()[2:]] == ["lo"]
    # the data plane still works: files and commands
    assert _sh(off, sandbox, "echo still here")["stdout"] == "still here\n"


def test_network_on_reaches_the_host(on: Any) -> None:
    sandbox = on.ready()
    with _loopback_server() as (port, received):
        status = _command(on, sandbox, [sys.executable, "-c", CONNECT, str(port)])
        assert status["exit_code"] == 0, status
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            time.sleep(0.02)
    assert received == [b"hello from the sandbox\n"]


def test_a_tcp_runtime_cannot_serve_a_sandbox_without_network(off: Any, on: Any) -> None:
    created = off.create(template="tcp")
    assert created.status_code == 201, created.text
    name = created.json()["name"]
    failed = off.http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20}).json()
    assert (failed["phase"], failed["reason"]) == ("Failed", "NetworkNotIsolated"), failed
    assert "{socket}" in failed["message"] and "network=True" in failed["message"]
    # with the network on it is reached on its port; with {socket} it needs no network
    assert _sh(on, on.ready(template="tcp"), "echo tcp")["stdout"] == "tcp\n"
    assert _sh(off, off.ready(template="socket"), "echo uds")["stdout"] == "uds\n"


# -- the data plane, unchanged ------------------------------------------------------------------
def test_the_file_api_and_managed_commands_work_unchanged(on: Any) -> None:
    sandbox = on.ready()
    headers = on.data_headers(sandbox)
    http = on.http
    wrote = http.post(
        "/fs/write",
        data={"path": "/workspace/d/f.txt"},
        files={"file": ("blob", b"data")},
        headers=headers,
    )
    assert wrote.status_code == 200, wrote.text
    assert _sh(on, sandbox, "cat /workspace/d/f.txt")["stdout"] == "data"
    read = http.get("/fs/read", params={"path": "/workspace/d/f.txt"}, headers=headers)
    assert read.content == b"data"
    listed = http.get("/fs/list", params={"path": "/workspace/d"}, headers=headers).json()
    assert [e["path"] for e in listed] == ["/workspace/d/f.txt"]
    uploaded = http.post("/upload", files={"file": ("up.txt", b"up")}, headers=headers)
    assert uploaded.status_code == 200, uploaded.text
    assert http.get("/download/up.txt", headers=headers).content == b"up"
    assert _sh(on, sandbox, "cat /app/up.txt")["stdout"] == "up"
    status = _command(
        on, sandbox, ["sh", "-c", "echo $X; pwd"], envs={"X": "y"}, cwd="/workspace/d"
    )
    assert (status["exit_code"], status["stdout"]) == (0, "y\n/workspace/d\n")


def test_the_sandbox_roots_cannot_be_replaced(on: Any) -> None:
    """In the host-process layout a command can remove /app or /workspace and put a link or
    another directory there (the runtime then refuses: root_replaced); isolated, each is a
    mount point: removing, moving or replacing it fails, and the file API keeps working."""
    sandbox = on.ready()
    headers = on.data_headers(sandbox)
    assert _sh(on, sandbox, "echo kept > /workspace/f && echo kept > /app/f")["exit_code"] == 0
    for attempt in (
        "rm -rf /workspace",
        "cd / && mv /app /app.old",
        "cd / && mv /workspace /workspace.old",
        "rmdir /app",
        "cd /tmp && ln -s /etc link && mv -T link /workspace",
        "mkdir /tmp/other && mv -T /tmp/other /app",
    ):
        result = _sh(on, sandbox, attempt)
        assert result["exit_code"] != 0, (attempt, result)
    # rm -rf emptied /workspace but could not remove it; /app is untouched
    listed = on.http.get("/fs/list", params={"path": "/workspace"}, headers=headers)
    assert listed.status_code == 200, listed.text
    assert listed.json() == []
    read = on.http.get("/fs/read", params={"path": "/app/f"}, headers=headers)
    assert (read.status_code, read.content) == (200, b"kept\n")
    assert _sh(on, sandbox, "pwd")["stdout"] == "/app\n"


# -- cleanup ------------------------------------------------------------------------------------
def _host_pids_with(marker: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(entry))
    return found


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if os.path.exists(f"/proc/{p}")]:
            return True
        time.sleep(0.05)
    return False


def test_deleting_a_sandbox_kills_everything_it_started(on: Any, isolated: LocalBroker) -> None:
    sandbox = on.ready()
    n = uuid.uuid4().int
    marker = f"{2000 + n % 1000}.{n % 10**6:06d}"  # unique on the machine (other runs' sleeps)
    # a command still running, and a daemon that left its session
    _start(on, sandbox, ["sh", "-c", f"(setsid sleep {marker} > /dev/null 2>&1 &); sleep {marker}"])
    deadline = time.monotonic() + 15
    while len(_host_pids_with(f"sleep\0{marker}")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = _host_pids_with(f"sleep\0{marker}")
    runtime = isolated.runtime_pid(sandbox["name"])
    assert len(pids) == 2 and runtime is not None
    assert on.http.delete(f"/v1/sandboxes/{sandbox['name']}").status_code in (200, 202)
    isolated.delete_all()
    assert _gone([*pids, runtime]), "a process of the deleted sandbox is still running"


# -- choosing the isolation (no bwrap needed) ---------------------------------------------------
@pytest.fixture
def fresh_probe() -> Iterator[None]:
    _bubblewrap.forget_probe()
    yield
    _bubblewrap.forget_probe()


def _fake_bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str | None) -> None:
    """PATH with only ``tmp_path/bin`` (and ``true``): a ``bwrap`` running ``script``, or none."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if script is not None:
        fake = bin_dir / "bwrap"
        fake.write_text(f"#!/bin/sh\n{script}\n")
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_bwrap_asked_for_but_missing_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe: None
) -> None:
    _fake_bwrap(tmp_path, monkeypatch, None)
    with pytest.raises(IsolationUnavailable) as raised:
        LocalProcessLauncher(isolation="bwrap", root_dir=str(tmp_path / "root"))
    message = str(raised.value)
    assert "isolation='bwrap'" in message and "not installed" in message
    assert "apt-get install bubblewrap" in message
    assert not (tmp_path / "root").exists()  # nothing made before the refusal
    with pytest.raises(IsolationUnavailable, match="bubblewrap"):
        LocalBroker(isolation="bwrap", warn=False).start()


def test_a_bwrap_that_cannot_make_namespaces_is_detected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe: None
) -> None:
    said = "bwrap: No permissions to creating new namespace, likely because the kernel does not"
    _fake_bwrap(
        tmp_path,
        monkeypatch,
        f'[ "$1" = --version ] && echo bubblewrap 9.9 && exit 0\necho "{said}" >&2; exit 1',
    )
    probe = _bubblewrap.probe_bwrap()
    assert not probe.works and said in probe.detail and "bubblewrap 9.9" in probe.detail
    auto = _bubblewrap.choose("auto")
    assert (auto.mode, auto.reason) == ("none", probe.detail)
    with pytest.raises(IsolationUnavailable, match="No permissions"):
        _bubblewrap.choose("bwrap")
    assert _bubblewrap.probe_bwrap() is probe  # run once, then cached


def test_auto_without_bwrap_warns_why(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_probe: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _fake_bwrap(tmp_path, monkeypatch, None)
    with caplog.at_level(logging.WARNING, "k8s_agent_sandbox_awx.testing"):
        with LocalBroker(isolation="auto") as broker:
            assert broker.isolation == "none"
    text = caplog.text
    assert NO_ISOLATION_WARNING in text and "bwrap is not installed" in text
    assert BWRAP_ISOLATION_WARNING not in text


def test_an_unknown_isolation_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"isolation='vm'.*'auto' or 'bwrap' or 'none'"):
        _bubblewrap.choose("vm")
    with pytest.raises(ValueError, match=r"isolation='vm'.*'bwrap' or 'none'"):
        LocalBroker(isolation="vm")
    with pytest.raises(ValueError, match="give the backend its own"):
        LocalBroker(isolation="none", backend=LocalProcessLauncher(isolation="none"))
    monkeypatch.setenv(_bubblewrap.ISOLATION_ENV, "sandboxed")
    with pytest.raises(ValueError, match=f"{_bubblewrap.ISOLATION_ENV}='sandboxed'"):
        _bubblewrap.choose(None)
    monkeypatch.setenv(_bubblewrap.ISOLATION_ENV, "none")
    assert _bubblewrap.choose(None).mode == "none"


def test_network_off_without_isolation_fails_the_sandbox(api: Callable[..., Any]) -> None:
    policy = Policy(namespace="gitlab-ci", network=False)
    with LocalBroker(isolation="none", warn=False, gitlab_policy=policy) as broker:
        client = api(broker.issue_gitlab_token("group/project"), broker)
        name = client.create().json()["name"]
        got = client.http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20})
        state = got.json()
    assert (state["phase"], state["reason"]) == ("Failed", "NetworkNotIsolated"), state
    assert "bubblewrap" in state["message"] and "network=True" in state["message"]


def test_policy_network_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"Policy\.network must be True or False"):
        Policy(network="off")  # type: ignore[arg-type]


PORT_APP = (Path(__file__).parents[1] / "_support" / "port_app.py").read_text()
"""The app's source, given with ``-c``: a checkout under /tmp is not seen in the sandbox."""


def test_a_port_of_an_isolated_sandbox_with_the_network(on: Any) -> None:
    """issue 23: isolated with the network on, a sandbox's server is on the host's loopback,
    reached by a port request."""
    sandbox = on.ready()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _start(on, sandbox, [sys.executable, "-c", PORT_APP, str(port)], timeout=120)
    headers = on.data_headers(sandbox, **{"X-Sandbox-Port": str(port)})
    deadline = time.monotonic() + 15
    while True:
        answer = on.http.get("/headers", headers=headers)
        if answer.status_code != 502 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert answer.status_code == 200, answer.text
    assert "authorization" not in {k.lower() for k, _ in answer.json()["headers"]}


def test_a_port_of_a_sandbox_without_network_is_refused_naming_why(off: Any) -> None:
    sandbox = off.ready()
    answer = off.http.get("/", headers=off.data_headers(sandbox, **{"X-Sandbox-Port": "8000"}))
    assert answer.status_code == 502 and answer.json()["code"] == "sandbox_unreachable"
    assert "network of its own" in answer.json()["detail"]
