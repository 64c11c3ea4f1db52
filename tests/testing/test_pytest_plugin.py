"""The ``sandbox_broker`` pytest fixture (the ``pytest11`` plugin)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

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
