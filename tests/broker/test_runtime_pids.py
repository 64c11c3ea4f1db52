"""Process ids and the local runtimes, in a private PID namespace: a pid used again is a new
runtime (the fork server remembered every exit by pid forever: a new sandbox was ``Failed``,
``RuntimeExited``, and its runtime outlived its delete), and a broker started in another PID
namespace (a container sharing ``/tmp``) leaves the live brokers' directories alone (it took
them for dead and removed their CA and sandboxes)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.isolation import PID_LAYOUT, host_processes_only

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
