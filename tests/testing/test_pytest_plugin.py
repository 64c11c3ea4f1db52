"""The ``sandbox_broker`` pytest fixture and the ``dev`` / ``demo`` commands."""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from k8s_agent_sandbox_awx.cli._local import demo_main, dev_main
from k8s_agent_sandbox_awx.testing import LocalBroker


def test_fixture_sets_zero_arg_environment(sandbox_broker: LocalBroker) -> None:
    assert os.environ["AGENT_SANDBOX_BROKER_URL"] == sandbox_broker.url
    assert os.environ["AGENT_SANDBOX_CA_BUNDLE"] == sandbox_broker.ca_bundle
    assert "AGENT_SANDBOX_TOKEN" not in os.environ
    token_file = Path(os.environ["AGENT_SANDBOX_TOKEN_FILE"])
    assert token_file.is_symlink()  # kubelet layout
    token = token_file.read_text()
    ctx = ssl.create_default_context(cafile=os.environ["AGENT_SANDBOX_CA_BUNDLE"])
    with httpx.Client(verify=ctx) as http:
        me = http.get(
            os.environ["AGENT_SANDBOX_BROKER_URL"] + "/v1/whoami",
            headers={"Authorization": f"Bearer {token}"},
        )
    assert me.status_code == 200
    assert me.json()["subject"] == "system:serviceaccount:default:default"


def test_fixture_makes_sandbox_create_work(sandbox_broker: LocalBroker) -> None:
    try:
        from k8s_agent_sandbox_awx import Sandbox
    except ImportError as exc:  # pragma: no cover - the client is built in parallel
        pytest.skip(f"the broker client is not available: {exc}")
    with Sandbox.create() as sandbox:
        result = sandbox.commands.run("python3 -c 'print(6 * 7)'")
    assert result.stdout == "42\n"
    assert sandbox_broker.claims(include_deleted=True)


PLUGIN_PROBE = textwrap.dedent(
    """
    def test_unrelated():
        assert True

    def test_needs_broker(sandbox_broker):
        pass
    """
)

BLOCK_EXTRA = textwrap.dedent(
    """
    import sys
    for name in ("uvicorn", "starlette", "trustme", "jwt"):
        sys.modules[name] = None
    """
)


def test_plugin_without_the_extra(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PLUGIN_PROBE)
    (tmp_path / "conftest.py").write_text(BLOCK_EXTRA)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert "1 passed" in out, out
    assert "1 failed" in out or "1 error" in out, out
    assert "[local] extra" in out


def test_plugin_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, k8s_agent_sandbox_awx.testing._pytest_plugin; "
        "heavy = ('uvicorn', 'starlette', 'jwt', 'trustme', 'cryptography', 'httpx', "
        "'k8s_agent_sandbox_awx.testing._broker'); "
        "print(','.join(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


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
