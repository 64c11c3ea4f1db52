"""Kept sandboxes (``cli/_kept.py``): ``create``, ``run --keep`` and ``run --sandbox NAME`` leave
a sandbox to work with, and ``run --background`` a command running in it."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.cli._cli import main
from k8s_agent_sandbox_awx.client.wire._dialect import LIST
from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect

NOWHERE = "https://127.0.0.1:9"  # never contacted: the checks before it fail first


@pytest.mark.e2e
def test_create_then_run_in_it_and_run_keep(
    broker: Any, dialect: str, use_env: Any, live: Any, capsys: Any
) -> None:
    """``create`` prints the new sandbox's name (it lives on), ``run --sandbox NAME`` runs in
    it (a file written by one run is read by the next) and keeps it, ``run --keep`` keeps its
    new sandbox and prints its name; ``kill`` then deletes them."""
    use_env(broker.environ("kubernetes"))
    assert main(["create", "--timeout", "120", "--template", "python"]) == 0
    captured = capsys.readouterr()
    name = captured.out.strip()
    assert re.fullmatch(r"[a-z0-9-]+", name) and captured.err == ""
    assert [c["metadata"]["name"] for c in live(broker, timeout=0)] == [name]

    assert main(["run", "--sandbox", name, "--", "sh", "-c", "echo kept > f.txt; echo ok"]) == 0
    assert capsys.readouterr().out == "ok\n"
    assert main(["run", "--sandbox", name, "--json", "--", "cat", "f.txt"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["sandbox"], result["stdout"], result["exit_code"]) == (name, "kept\n", 0)
    assert main(["run", "--sandbox", name, "--", "sh", "-c", "exit 3"]) == 3
    assert [c["metadata"]["name"] for c in live(broker, timeout=0)] == [name]  # still there

    assert main(["run", "--keep", "--", "sh", "-c", "echo made"]) == 0
    captured = capsys.readouterr()
    [kept] = re.findall(
        r"sandbox (\S+) kept: run in it with `agent-sandbox-awx run --sandbox", captured.err
    )
    assert captured.out == "made\n" and f"`agent-sandbox-awx kill {kept}`" in captured.err
    assert sorted(c["metadata"]["name"] for c in live(broker, timeout=0)) == sorted([name, kept])

    assert main(["create", "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["name"] and made["phase"] == "Ready"
    if dialect == "v1":  # an /rpc status has no deadline
        assert made["seconds_left"] > 0
    assert main(["kill", name, kept, made["name"]]) == 0
    assert capsys.readouterr().err == ""  # all three existed: no warning
    assert live(broker) == []


@pytest.mark.e2e
def test_run_background_starts_the_command_prints_its_id_and_leaves_it_running(
    broker: Any, use_env: Any, capsys: Any
) -> None:
    """``run --sandbox NAME --background [--timeout S|0] -- CMD``: the command id on stdout
    (``--json``: with the sandbox and the time limit), exit 0, and the command goes on after
    the CLI returned (``--timeout 0``: no time limit, past the runtime's cap, 1 s here)."""
    environ = broker.environ("kubernetes")
    use_env(environ)
    sandbox = Sandbox.create(environ=environ, env={"SANDBOX_EXEC_TIMEOUT_SECONDS": "1"})
    with sandbox:
        run = ["run", "--sandbox", sandbox.name, "--background"]
        assert main([*run, "--timeout", "0", "--", "sh", "-c", "echo up; exec sleep 300"]) == 0
        captured = capsys.readouterr()
        command_id = captured.out.strip()
        assert re.fullmatch(r"[0-9a-f-]{36}", command_id), captured.out
        assert f"agent-sandbox-awx kill {sandbox.name}" in captured.err
        assert main([*run, "--json", "--timeout", "0.5", "--", "sleep", "30"]) == 0
        started = json.loads(capsys.readouterr().out)
        assert (started["sandbox"], started["timeout"]) == (sandbox.name, 0.5)
        time.sleep(2.5)  # past the cap: the first still runs, the second timed out
        server = sandbox.commands.get(command_id)
        status = server.status()
        assert (status.state, status.no_time_limit, status.stdout) == ("running", True, "up\n")
        assert sandbox.commands.get(started["command_id"]).wait().state == "timed_out"
        assert server.kill().state == "cancelled"


def test_kill_command_stops_one_background_command_and_the_sandbox_stays(
    broker: Any, use_env: Any, capsys: Any
) -> None:
    """``kill NAME --command ID``: that command is killed (its final state printed; ``--json``
    too), the sandbox and its other commands go on; a repeat is safe; more than one NAME is a
    usage error before anything is sent."""
    environ = broker.environ("kubernetes")
    use_env(environ)
    with Sandbox.create(environ=environ) as sandbox:
        run = ["run", "--sandbox", sandbox.name, "--background", "--timeout", "0", "--"]
        assert main([*run, "sleep", "300"]) == 0
        stopped = capsys.readouterr()
        command_id = stopped.out.strip()
        assert f"kill {sandbox.name} --command {command_id}" in stopped.err
        assert main([*run, "sleep", "301"]) == 0
        other = capsys.readouterr().out.strip()
        assert main(["kill", sandbox.name, "--command", command_id]) == 0
        assert (
            capsys.readouterr().out
            == f"{sandbox.name}: command {command_id} cancelled (exit code 137)\n"
        )
        assert main(["kill", sandbox.name, "--command", command_id, "--json"]) == 0  # a repeat
        again = json.loads(capsys.readouterr().out)
        assert (again["command_id"], again["state"]) == (command_id, "cancelled")
        assert sandbox.commands.get(other).status().state == "running"
        assert sandbox.commands.run("echo alive").stdout == "alive\n"
        assert main(["kill", sandbox.name, "other-sandbox", "--command", command_id]) == 2
        assert "give one NAME" in capsys.readouterr().err
        assert sandbox.commands.get(other).kill().state == "cancelled"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--background", "--", "sleep", "1"], "--sandbox NAME"),
        (["--sandbox", "sb", "--timeout", "0", "--", "sleep", "1"], "--timeout 0"),
    ],
)
def test_run_background_and_no_time_limit_are_checked_before_anything_is_sent(
    args: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", NOWHERE)
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "--background" in err and "Traceback" not in err


@pytest.mark.e2e
def test_create_timeout_is_the_sandboxs_lifetime(
    broker: Any, dialect: str, use_env: Any, live: Any, capsys: Any
) -> None:
    use_env(broker.environ("kubernetes"))
    assert main(["create", "--timeout", "90", "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    if dialect == "v1":  # an /rpc status has no deadline (ls has it)
        assert 0 < made["seconds_left"] <= 90
    if LIST in get_dialect(dialect).features:
        assert main(["ls", "--json"]) == 0
        [listed] = json.loads(capsys.readouterr().out)
        assert listed["name"] == made["name"] and listed["seconds_left"] <= 90
    assert main(["kill", made["name"]]) == 0
    assert live(broker) == []


@pytest.mark.e2e
def test_run_sandbox_refusals(broker: Any, use_env: Any, live: Any, capsys: Any) -> None:
    use_env(broker.environ("kubernetes"))
    assert main(["run", "--sandbox", "sbx-x", "--template", "python", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "--template is for a new sandbox" in err and "leave out one of them" in err
    assert main(["run", "--sandbox", "sbx-never-made", "--", "true"]) == 1
    assert "sbx-never-made" in capsys.readouterr().err
    assert live(broker) == []
