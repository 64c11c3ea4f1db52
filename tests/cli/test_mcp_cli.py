"""``agent-sandbox-awx mcp``'s command line: cheap without the [mcp] extra, its options checked
before anything is imported or sent, the [mcp] extra's range in one place."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.cli import _mcp
from k8s_agent_sandbox_awx.cli._cli import main
from k8s_agent_sandbox_awx.mcp._address import is_loopback, parse_listen

CLI = [sys.executable, "-m", "k8s_agent_sandbox_awx.cli._cli"]
ROOT = Path(__file__).resolve().parents[2]
# as if the [mcp] extra were not installed: its modules cannot be imported
WITHOUT_MCP = """\
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mcp", "mcp_types"):
            raise ImportError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from k8s_agent_sandbox_awx.cli._cli import main
sys.exit(main(sys.argv[1:]))
"""


def _without_mcp(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": "/usr/bin:/bin", "AGENT_SANDBOX_BROKER_URL": "https://broker.test", **env}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_MCP, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environ,
        stdin=subprocess.DEVNULL,
    )


def test_mcp_without_the_extra_says_how_to_install_it() -> None:
    run = _without_mcp("mcp")
    assert run.returncode == 1 and run.stdout == ""
    first, _, hint = run.stderr.partition(" could not be imported): install it: ")
    assert first in (
        "agent-sandbox-awx: error: `agent-sandbox-awx mcp` needs the [mcp] extra (mcp",
        "agent-sandbox-awx: error: `agent-sandbox-awx mcp` needs the [mcp] extra (mcp_types",
    )
    assert hint.startswith('python3 -m pip install -e ".[mcp]" in a clone')
    assert f"{sys.executable} -m pip install 'mcp>=2.3,<3'" in run.stderr
    assert "Traceback" not in run.stderr


def test_help_and_the_other_commands_never_need_the_extra() -> None:
    run = _without_mcp("mcp", "--help")
    assert (
        run.returncode == 0
        and "--http [HOST:]PORT" in run.stdout
        and "--allow-remote" in run.stdout
    )
    run = _without_mcp("--help")
    assert run.returncode == 0 and "mcp" in run.stdout
    code = (
        "import sys; from k8s_agent_sandbox_awx.cli import _cli; _cli._parser(); "
        "print(','.join(m for m in ('mcp', 'mcp_types', 'anyio', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--http", "0.0.0.0:8765"], "listens beyond this machine"),
        (["--http", "sandbox-host:8765"], "anyone who reaches the port acts with this server's"),
        (["--http", "[::]:8765"], "add --allow-remote if a network policy"),
        (["--allow-remote"], "--allow-remote is for HTTP mode: add --http [HOST:]PORT"),
        (["--idle-timeout", "5"], "--idle-timeout is for HTTP mode"),
        (["--http", "127.0.0.1:http"], "the port must be a number from 0 to 65535"),
        (["--http", ":8765"], "no host before the ':'"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(
    args: list[str], says: str, capsys: Any
) -> None:
    assert main(["mcp", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agent-sandbox-awx: error: mcp: ") and says in err, err


def test_a_non_loopback_address_with_allow_remote_gets_past_the_check(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """--allow-remote lets a non-loopback address through (the next check, the missing
    broker URL, stops it here, before anything listens)."""
    monkeypatch.delenv("AGENT_SANDBOX_BROKER_URL", raising=False)
    assert main(["mcp", "--http", "0.0.0.0:0", "--allow-remote"]) == 1
    err = capsys.readouterr().err
    assert "No broker URL" in err and "--broker-url" in err and "listens beyond" not in err


def test_a_taken_port_is_one_line(tmp_path: Path) -> None:
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        run = subprocess.run(
            [*CLI, "mcp", "--http", f"127.0.0.1:{port}", "--broker-url", "https://broker.test"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    finally:
        taken.close()
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        f"agent-sandbox-awx: error: mcp: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def test_addresses() -> None:
    assert parse_listen("8765") == ("127.0.0.1", 8765)
    assert parse_listen("localhost:0") == ("localhost", 0)
    assert parse_listen("[::1]:9") == ("::1", 9)
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com", "localhost.example.com"):
        assert not is_loopback(host), host


def test_the_mcp_extra_is_the_sdk_range_the_hint_names_and_dev_installs_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["mcp"] == [_mcp.MCP_REQUIREMENT]
    dev = extras["dev"][0]
    assert dev.startswith("k8s-agent-sandbox-awx[") and "mcp" in dev.split("[")[1].rstrip(
        "]"
    ).split(",")
