"""``agent-sandbox-awx port-forward NAME PORT [--local-port N]`` (issue 23): a subprocess that
prints the local URL, forwards through the broker until SIGINT, then exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import Sandbox
from tests._support.port_server import free_port, start_in_sandbox

CLI = [sys.executable, "-m", "k8s_agent_sandbox_awx.cli._cli"]


@pytest.mark.e2e
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_port_forward_prints_the_url_forwards_and_stops_on_sigint(broker: Any) -> None:
    env = broker.environ("kubernetes")
    port, local = free_port(), free_port()
    with Sandbox.create(environ=env) as sandbox:
        handle = start_in_sandbox(sandbox, port)
        argv = [*CLI, "port-forward", sandbox.name, str(port), "--local-port", str(local)]
        process = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stdout is not None
            url = process.stdout.readline().strip()
            assert url == f"http://127.0.0.1:{local}"
            answer = httpx.get(url + "/headers", timeout=10)
            assert answer.status_code == 200
            assert "authorization" not in {k.lower() for k, _ in answer.json()["headers"]}
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=15)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        assert process.returncode == 0, err
        assert f"to port {port} of sandbox" in err and "stopped" in err
        token = Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text().strip()
        assert token.split(".")[2] not in out + err
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/headers")
        handle.kill()


def test_port_forward_help_and_bad_port(capsys: Any) -> None:
    from k8s_agent_sandbox_awx.cli._cli import main

    with pytest.raises(SystemExit):
        main(["port-forward", "--help"])
    assert "--local-port" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["port-forward", "sbx", "70000"])
    assert info.value.code == 2 and "not a TCP port" in capsys.readouterr().err
