"""``agent-sandbox-awx broker check`` and ``broker serve``: exit codes, output, the extra."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx.broker.config import load_config
from tests._support.broker_server import CLI, Pki, write_config

SECRET_TEXT = "the-token-file-content-never-printed"

BLOCK = """\
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from k8s_agent_sandbox_awx.cli._cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(*args: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    argv = (
        [sys.executable, "-c", BLOCK.format(blocked=set(blocked)), *args]
        if blocked
        else [
            *CLI,
            *args,
        ]
    )
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    pki = Pki(tmp_path)
    pki.write(pki.issue())
    path = write_config(tmp_path, pki)
    (tmp_path / "token").write_text(SECRET_TEXT)
    text = path.read_text().replace(
        'provider = "kubernetes"\n', 'provider = "kubernetes"\ntoken_file = "token"\n'
    )
    path.write_text(text)
    return path


def test_check_prints_the_effective_configuration_and_exits_0(config: Path) -> None:
    # nothing beyond the core: the standard library reads TOML
    run = _run("broker", "check", "--config", str(config), blocked=("uvicorn", "starlette"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"# The effective broker configuration of {config}\n")
    assert f'token_file = "{config.parent / "token"}"' in run.stdout
    assert "shutdown_grace_seconds = 30  # default" in run.stdout
    assert SECRET_TEXT not in run.stdout + run.stderr
    assert run.stderr == f"# {config}: OK\n"
    # what it printed is a configuration that loads to the same values
    rendered = config.with_name("rendered.toml")
    rendered.write_text(run.stdout)
    again, first = load_config(rendered), load_config(config)
    assert (again.server, again.issuers, again.policies) == (
        first.server,
        first.issuers,
        first.policies,
    )


def test_check_lists_every_problem_on_stderr_and_exits_2(config: Path) -> None:
    text = config.read_text().replace('kind = "local"', 'kind = "locl"')
    config.write_text(text + "\n[[policies]]\nname = 'x'\nissuer = 'nobody'\n")
    run = _run("broker", "check", "--config", str(config))
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.splitlines()
    assert lines[0] == (
        f"agent-sandbox-awx: error: the broker configuration {config} has 4 problems:"
    )
    assert all(line.startswith(f"  {config}: ") and "; fix: " in line for line in lines[1:])
    assert any("backend.kind: 'locl' is not one of" in line for line in lines)
    assert any("policies[1].issuer (policy \"x\"): 'nobody' is not the" in line for line in lines)
    assert len(lines) == 5 and "Traceback" not in run.stderr


def test_check_of_a_missing_file(tmp_path: Path) -> None:
    run = _run("broker", "check", "--config", str(tmp_path / "nope.toml"))
    assert run.returncode == 2
    assert f"{tmp_path / 'nope.toml'}: does not exist; fix: give --config" in run.stderr


def test_serve_refuses_a_bad_configuration_before_listening(config: Path) -> None:
    config.write_text(config.read_text().replace("127.0.0.1:0", "127.0.0.1"))
    run = _run("broker", "serve", "--config", str(config))
    assert run.returncode == 2
    assert "server.listen: '127.0.0.1': is not host:port" in run.stderr


def test_serve_without_the_broker_extra_names_it(config: Path) -> None:
    run = _run("broker", "serve", "--config", str(config), blocked=("uvicorn",))
    assert run.returncode == 1
    assert "`agent-sandbox-awx broker serve` needs the [broker] extra (uvicorn" in run.stderr
    assert 'pip install -e ".[broker]"' in run.stderr and "Traceback" not in run.stderr


def test_serve_on_a_taken_address_says_so(config: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        config.write_text(config.read_text().replace("127.0.0.1:0", f"127.0.0.1:{port}"))
        run = _run("broker", "serve", "--config", str(config))
    finally:
        taken.close()
    assert run.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} (server.listen): Address already in use" in (
        run.stderr
    )


def test_broker_needs_an_action_and_a_config() -> None:
    run = _run("broker")
    assert run.returncode == 2 and "ACTION" in run.stderr
    run = _run("broker", "serve")
    assert run.returncode == 2 and "--config" in run.stderr
    run = _run("broker", "--help")
    assert run.returncode == 0 and "check" in run.stdout and "serve" in run.stdout
