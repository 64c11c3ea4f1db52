"""The ``dev`` / ``demo`` commands (``agent-sandbox-awx dev``, ``agent-sandbox-awx demo``)."""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from k8s_agent_sandbox_awx.cli._local import demo_main, dev_main


def test_demo_prints_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    before = dict(os.environ)
    assert demo_main([]) == 0
    captured = capsys.readouterr()
    assert "42" in captured.out.splitlines()
    assert "NO isolation" in captured.err
    assert dict(os.environ) == before


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _dev(tmp_path: Path, *args: str) -> Iterator[tuple[dict[str, str], str]]:
    """Run ``agent-sandbox-awx dev`` with ``args``; yield its exports and the token; Ctrl-C."""
    token_file = tmp_path / "tok" / "token"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from k8s_agent_sandbox_awx.cli._local import dev_main; "
            "sys.exit(dev_main(sys.argv[1:]))",
            "--namespace",
            "team-a",
            "--service-account",
            "dev",
            "--ttl",
            "600",
            "--token-file",
            str(token_file),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell without job control starts background jobs with SIGINT ignored, and Python
        # keeps an inherited SIG_IGN: give the child the default disposition, as a terminal would.
        preexec_fn=_default_sigint,
    )
    token = ""
    try:
        assert proc.stdout is not None
        exports: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while len(exports) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("export "):
                name, _, value = line[len("export ") :].strip().partition("=")
                exports[name] = value
        assert set(exports) == {
            "AGENT_SANDBOX_BROKER_URL",
            "AGENT_SANDBOX_CA_BUNDLE",
            "AGENT_SANDBOX_TOKEN_FILE",
        }
        token = Path(exports["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
        yield exports, token
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "NO isolation" in err
    assert not token or token not in err


def _dev_client(exports: dict[str, str], token: str) -> httpx.Client:
    return httpx.Client(
        base_url=exports["AGENT_SANDBOX_BROKER_URL"],
        verify=ssl.create_default_context(cafile=exports["AGENT_SANDBOX_CA_BUNDLE"]),
        headers={"Authorization": f"Bearer {token}"},
    )


def test_dev_prints_exports_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    with _dev(tmp_path) as (exports, token), _dev_client(exports, token) as http:
        me = http.get("/v1/whoami").json()
        assert me["subject"] == "system:serviceaccount:team-a:dev"
        assert http.post("/rpc", json={"op": "status", "claim_name": "broker-x"}).status_code == 404


def test_dev_serves_only_the_dialects_asked_for(tmp_path: Path) -> None:
    with (
        _dev(tmp_path, "--protocols", "rpc") as (exports, token),
        _dev_client(exports, token) as http,
    ):
        assert http.get("/v1/whoami").status_code == 404
        created = http.post("/rpc", json={"op": "create"})
        assert created.status_code == 200, created.text
        assert created.json()["namespace"] == "team-a"


@pytest.mark.parametrize("value", ["v2", "", "v1,grpc"])
def test_dev_refuses_unknown_protocols(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        dev_main(["--protocols", value])
    assert exc.value.code == 2
    assert "--protocols" in capsys.readouterr().err


def test_cli_demo_console_script() -> None:
    script = Path(sys.executable).with_name("agent-sandbox-awx")
    if not script.exists():  # pragma: no cover - not installed as a console script
        pytest.skip("the agent-sandbox-awx console script is not installed")
    proc = subprocess.run([str(script), "demo"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "42" in proc.stdout.splitlines()
