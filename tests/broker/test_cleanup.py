"""Runtimes and files are cleaned up on stop and when the process running the broker dies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker, LocalProcessLauncher
from tests._support.isolation import TCP_PORTS, host_processes_only
from tests._support.programs import process_alive as _alive


def _wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_stop_kills_runtimes_and_removes_files(api: Any) -> None:
    b = LocalBroker(warn=False).start()
    client = api(b.issue_kubernetes_token("team-a", "alice"), b)
    sandboxes = [client.ready() for _ in range(2)]
    pids = [b.runtime_pid(s["name"]) for s in sandboxes]
    assert all(pids)
    tmp = os.path.dirname(b.ca_bundle)
    assert os.path.isdir(tmp)

    def long_command() -> None:  # still running when the broker stops
        with contextlib.suppress(httpx.HTTPError):  # the broker goes away under it
            client.run(sandboxes[0], "sleep 30")

    runner = threading.Thread(target=long_command, daemon=True)
    runner.start()
    time.sleep(0.3)
    b.stop()
    assert _wait_dead([p for p in pids if p is not None], 5) == []
    assert not os.path.exists(tmp)
    runner.join(5)


CRASHER = textwrap.dedent(
    """
    import os, signal, ssl, sys, threading, time, httpx
    from k8s_agent_sandbox_awx.testing import LocalBroker, LocalProcessLauncher

    mode, running, daemon, daemon_command = sys.argv[1:]
    backend = LocalProcessLauncher(fork_server=mode == "fork")  # its own /tmp root directory
    b = LocalBroker(warn=False, backend=backend)
    b.start()
    token = b.issue_kubernetes_token("team-a", "alice")
    http = httpx.Client(base_url=b.url, headers={"Authorization": "Bearer " + token},
                        verify=ssl.create_default_context(cafile=b.ca_bundle), timeout=30)
    name = http.post("/v1/sandboxes", json={}).json()["name"]
    http.get(f"/v1/sandboxes/{name}", params={"wait": "ready"})
    headers = {"X-Sandbox-ID": name, "X-Sandbox-Namespace": "team-a"}
    http.post("/execute", json={"command": daemon_command}, headers=headers).raise_for_status()
    def sleeper():
        http.post("/execute", json={"command": "sleep " + running}, headers=headers)
    threading.Thread(target=sleeper, daemon=True).start()
    time.sleep(0.5)
    found = 0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                found += fh.read() in (b"sleep\\0%s\\0" % m.encode() for m in (running, daemon))
        except OSError:
            pass
    print(b.runtime_pid(name), os.path.dirname(b.ca_bundle), backend.root_dir, found, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _pids_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmdline = fh.read()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry))
    return found


@pytest.mark.parametrize("mode", ["fork", "exec"])
def test_runtimes_die_when_the_test_process_crashes(mode: str) -> None:
    running, daemon = _marker(), _marker()
    proc = subprocess.run(
        [sys.executable, "-c", CRASHER, mode, running, daemon, DAEMON.format(daemon)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -9, proc.stderr
    pid_text, tmp, root, found = proc.stdout.split()
    assert found == "2", "the command and the daemon were not running when the broker died"
    runtime = int(pid_text)
    assert _wait_dead([runtime], 10) == [], "the runtime outlived the crashed broker"
    leftovers = [p for p in _pids_with(running) + _pids_with(daemon) if _alive(p)]
    assert _wait_dead(leftovers, 5) == [], "a command outlived the crashed broker"
    # the next broker sweeps the crashed one's temporary directories
    assert os.path.isdir(tmp)
    assert os.path.isdir(root)
    with LocalBroker(warn=False):
        assert not os.path.exists(tmp)
        assert not os.path.exists(root), "the crashed broker's runtimes directory was left"


def _marker() -> str:
    """A unique ``sleep`` argument: the processes of one test, found by their command line."""
    return f"{random.randint(100, 999)}.{random.randint(10**8, 10**9)}"


def _start_in_background(client: Any, sandbox: dict[str, Any], command: str) -> None:
    def run() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the runtime dies under it
            client.run(sandbox, command)

    threading.Thread(target=run, daemon=True).start()


def _running(marker: str, count: int = 1, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(pids := [p for p in _pids_with(marker) if _alive(p)]) < count:
        assert time.monotonic() < deadline, f"the {marker} processes did not start"
        time.sleep(0.02)
    return pids


# A command that leaves a process in a session of its own (setsid) behind and returns.
DAEMON = (
    'python3 -c \'import subprocess as s; s.Popen(["sleep", "{}"], start_new_session=True, '
    "stdout=s.DEVNULL, stderr=s.DEVNULL)'"
)


@pytest.mark.parametrize("mode", ["fork", "exec"])
def test_commands_do_not_outlive_a_killed_runtime(api: Any, mode: str) -> None:
    """The runtime is SIGKILLed (as the OOM killer would) while a command runs and after a
    command left a setsid daemon: neither the command's group nor the daemon survives the
    sandbox's delete."""
    backend = LocalProcessLauncher(fork_server=mode == "fork")
    with LocalBroker(backend=backend, warn=False) as b:
        client = api(b.issue_kubernetes_token("team-a", "alice"), b)
        sandbox = client.ready()
        running, daemon = _marker(), _marker()
        assert client.run(sandbox, DAEMON.format(daemon)).json()["exit_code"] == 0
        _start_in_background(client, sandbox, f"sleep {running}")
        pids = _running(running) + _running(daemon)
        runtime = b.runtime_pid(sandbox["name"])
        assert runtime is not None
        os.kill(runtime, signal.SIGKILL)
        assert _wait_dead([runtime]) == []
        assert client.http.delete(f"/v1/sandboxes/{sandbox['name']}").status_code in (202, 404)
        assert _wait_dead(pids, 5) == [], "a command outlived its sandbox"


@pytest.mark.parametrize("how", ["deleted", "broker stopped"])
def test_a_setsid_daemon_dies_with_its_sandbox(api: Any, how: str) -> None:
    with LocalBroker(warn=False) as b:
        client = api(b.issue_kubernetes_token("team-a", "alice"), b)
        sandbox = client.ready()
        daemon = _marker()
        assert client.run(sandbox, DAEMON.format(daemon)).json()["exit_code"] == 0
        pids = _running(daemon)
        time.sleep(0.2)
        assert [p for p in pids if _alive(p)] == pids  # it lives as long as its sandbox
        if how == "deleted":
            assert client.http.delete(f"/v1/sandboxes/{sandbox['name']}").status_code == 202
        else:
            b.stop()
        assert _wait_dead(pids, 5) == [], "a daemon outlived its sandbox"


def _sockets_to_port(port: int) -> list[str]:
    """This process's IPv4 TCP sockets whose remote port is ``port`` (their states, in hex)."""
    states = {}
    with open("/proc/net/tcp") as fh:
        next(fh)
        for line in fh:
            fields = line.split()
            if int(fields[2].split(":")[1], 16) == port:
                states[fields[9]] = fields[3]
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in states:
                found.append(states[link[8:-1]])
    return found


def _settled(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while (value := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


@host_processes_only(TCP_PORTS)
@pytest.mark.parametrize("how", ["deleted", "expired", "runtime exited"])
def test_router_connections_to_a_runtime_close_with_its_sandbox(
    broker: LocalBroker, alice: Any, how: str
) -> None:
    """The broker's keep-alive connections to a sandbox's runtime do not outlive it (no socket
    left in CLOSE_WAIT once the runtime exited)."""
    sandbox = alice.ready(lifetime_seconds=2) if how == "expired" else alice.ready()
    assert alice.run(sandbox, "echo hi").json()["stdout"] == "hi\n"
    handle = broker._require_store().sandboxes[sandbox["name"]].handle
    assert handle is not None
    assert _sockets_to_port(handle.port)  # the router kept its connection alive
    pid = broker.runtime_pid(sandbox["name"])
    assert pid is not None
    if how == "deleted":
        assert alice.http.delete(f"/v1/sandboxes/{sandbox['name']}").status_code == 202
    if how == "runtime exited":
        os.kill(pid, signal.SIGKILL)
    assert _wait_dead([pid], 10) == []
    if how == "runtime exited":  # the broker notices (the sandbox stays listed, Failed)

        def not_failed() -> bool:
            state = alice.http.get(f"/v1/sandboxes/{sandbox['name']}").json()
            return (state["phase"], state["reason"]) != ("Failed", "RuntimeExited")

        assert _settled(not_failed) is False
    assert _settled(lambda: _sockets_to_port(handle.port)) == []


class _SlowStops(LocalProcessLauncher):
    """The real launcher, its runtimes' terminations counted and held 0.5 s before they begin
    (so that a second deletion surely comes while the first is under way)."""

    def __init__(self) -> None:
        super().__init__()
        self.terminations: list[str] = []

    async def _terminate(self, handle: Any, *, remove: bool = True) -> None:
        self.terminations.append(handle.name)
        await asyncio.sleep(0.5)
        await super()._terminate(handle, remove=remove)


def test_a_sandbox_deleted_twice_at_once_is_stopped_once(api: Any) -> None:
    """The API's delete and the test kit's ``reset`` (``delete_all``) at once: one stop of the
    runtime, which the second waits for. Two stops each signalled the group, the second after
    the first had forgotten its exit: a SIGKILL to a group number that may be another's, and a
    3 s wait for an exit report that never came (every test's teardown took 3 s)."""
    launcher = _SlowStops()
    with LocalBroker(backend=launcher, warn=False) as b:
        client = api(b.issue_kubernetes_token("team-a", "alice"), b)
        sandbox = client.ready()
        name = sandbox["name"]
        handle = b._require_store().sandboxes[name].handle
        assert client.http.delete(f"/v1/sandboxes/{name}").status_code == 202
        b.reset()  # during the first stop's 0.5 s hold
        assert launcher.terminations == [name]
        assert b.sandboxes() == []
        b._call(launcher.stop(handle))  # a stop of a runtime already stopped: nothing to do
        assert launcher.terminations == [name]

        other = client.ready()["name"]  # the launcher alone, stopped twice at once
        handle = b._require_store().sandboxes[other].handle

        async def twice() -> None:
            await asyncio.gather(launcher.stop(handle), launcher.stop(handle))

        b._call(twice())
        assert launcher.terminations == [name, other]
        assert handle.pid is not None and _wait_dead([handle.pid]) == []
