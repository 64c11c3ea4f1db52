"""The CLI a person uses (issue 23): ``create``, ``run --keep`` and ``run --sandbox NAME`` leave
a sandbox to work with, the global options are taken after the command too, every
sub-command's ``--help`` describes it and its arguments, and each friction a first session met
says what to do."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.cli._cli import _parser, main
from k8s_agent_sandbox_awx.client.wire._dialect import LIST
from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect

NOWHERE = "https://127.0.0.1:9"  # never contacted: the checks before it fail first


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[Any]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append(((*path, name), sub))
                found += _walk(sub, (*path, name))
    return found


def test_every_subcommands_help_has_a_description_and_explains_its_arguments(
    capsys: Any,
) -> None:
    """Walks every sub-command (and theirs): ``--help`` starts with a description line, and
    every argument and option has a help text (``ls``, ``kill NAME`` ... used to show none)."""
    commands = _walk(_parser())
    assert {path[0] for path, _ in commands} >= {"create", "run", "ls", "kill", "files", "extend"}
    for path, sub in commands:
        assert sub.description, f"`{' '.join(path)}` has no description"
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (path, action.dest)
        if path[0] in ("dev", "demo"):
            continue  # their own parser answers --help (test_cli.py)
        with pytest.raises(SystemExit) as info:
            main([*path, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert " ".join(sub.description.split()[:4]) in " ".join(out.split()), (path, out)


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "--broker-url", NOWHERE],
        ["kill", "sbx-x", "--broker-url", NOWHERE],
        ["files", "ls", "sbx-x", "--broker-url", NOWHERE],
        ["run", "--broker-url", NOWHERE, "--", "true"],
        ["create", "--broker-url", NOWHERE, "--debug"],
    ],
)
def test_global_options_are_taken_after_the_command(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``ls --broker-url URL`` used to be ``unrecognized arguments`` (exit 2): the URL is used
    (here: the credential lookup names it)."""
    for name in ("AGENT_SANDBOX_BROKER_URL", "AGENT_SANDBOX_TOKEN", "AGENT_SANDBOX_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", "https://127.0.0.1:8")
    if "--debug" in argv:
        with pytest.raises(Exception, match=r"127\.0\.0\.1:9"):  # --debug after it: raised
            main(argv)
        return
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err and NOWHERE in err, err
    assert main(["--broker-url", "https://127.0.0.1:7", *argv]) == 1  # the later one wins
    assert NOWHERE in capsys.readouterr().err


# ------------------------------------------------------------ create, run --keep, --sandbox


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
    assert [c["metadata"]["name"] for c in live(broker)] == [name]

    assert main(["run", "--sandbox", name, "--", "sh", "-c", "echo kept > f.txt; echo ok"]) == 0
    assert capsys.readouterr().out == "ok\n"
    assert main(["run", "--sandbox", name, "--json", "--", "cat", "f.txt"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["sandbox"], result["stdout"], result["exit_code"]) == (name, "kept\n", 0)
    assert main(["run", "--sandbox", name, "--", "sh", "-c", "exit 3"]) == 3
    assert [c["metadata"]["name"] for c in live(broker)] == [name]  # still there

    assert main(["run", "--keep", "--", "sh", "-c", "echo made"]) == 0
    captured = capsys.readouterr()
    [kept] = re.findall(
        r"sandbox (\S+) kept: run in it with `agent-sandbox-awx run --sandbox", captured.err
    )
    assert captured.out == "made\n" and f"`agent-sandbox-awx kill {kept}`" in captured.err
    assert sorted(c["metadata"]["name"] for c in live(broker)) == sorted([name, kept])

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


# ------------------------------------------------------------------------------- frictions


@pytest.mark.e2e
def test_kill_of_a_name_never_seen_warns(
    broker: Any, dialect: str, use_env: Any, capsys: Any
) -> None:
    """Exit 0 stays (already gone is fine), and stderr says the name is unknown (v1: /rpc's
    delete cannot tell an absent sandbox from a deleted one)."""
    use_env(broker.environ("kubernetes"))
    assert main(["kill", "sbx-typo"]) == 0
    err = capsys.readouterr().err
    if dialect == "v1":
        assert err == (
            "agent-sandbox-awx: warning: no sandbox sbx-typo at the broker (never created, "
            "already deleted or expired, or another identity's); check the name with "
            "`agent-sandbox-awx ls`.\n"
        )
    else:
        assert err == ""


@pytest.mark.e2e
def test_files_rm_of_a_directory_suggests_r(broker: Any, use_env: Any, capsys: Any) -> None:
    use_env(broker.environ("kubernetes"))
    from k8s_agent_sandbox_awx import Sandbox

    with Sandbox.create() as sandbox:
        sandbox.files.write("d/x.txt", b"x")
        assert main(["files", "rm", sandbox.name, "d"]) == 1
        err = capsys.readouterr().err
        assert "not_empty" in err
        assert (
            "hint: it is a directory that is not empty; `agent-sandbox-awx files rm -r NAME PATH`"
            in err
        )
        assert sandbox.files.exists("d/x.txt")


@pytest.mark.e2e
def test_a_shell_line_given_as_one_word_gets_a_hint(
    broker: Any, use_env: Any, live: Any, capsys: Any
) -> None:
    """``run -- "a && b"`` ran a program named ``a && b`` (exit 127) with no word why."""
    use_env(broker.environ("kubernetes"))
    assert main(["run", "--", "echo a && echo b"]) == 127
    err = capsys.readouterr().err
    assert "hint: 'echo a && echo b' ran as the name of one program" in err
    assert "`agent-sandbox-awx run -- sh -c 'echo a && echo b'`" in err
    assert main(["run", "--", "sh", "-c", "exit 127"]) == 127  # a real 127: no hint
    assert "hint" not in capsys.readouterr().err
    assert live(broker) == []


@pytest.mark.e2e
def test_a_plain_http_url_against_an_https_broker_hints_https(
    broker: Any, use_env: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    env = broker.environ("kubernetes")
    use_env(env)
    monkeypatch.delenv("AGENT_SANDBOX_CA_BUNDLE")
    url = env["AGENT_SANDBOX_BROKER_URL"].replace("https://", "http://")
    Path(env["AGENT_SANDBOX_TOKEN_FILE"]).write_text(
        broker.issue_kubernetes_token("default", "default", audience=url)
    )
    assert main(["ls", "--broker-url", url, "--allow-insecure-http"]) == 1
    err = capsys.readouterr().err
    assert "BrokerUnavailableError" in err
    https = url.replace("http://", "https://")
    assert (
        f"hint: {url} is a plain http:// URL; the broker may speak HTTPS: try --broker-url {https}"
        in err
    )


@pytest.mark.e2e
def test_an_audience_mismatch_names_the_flag_that_set_the_url(
    broker: Any, use_env: Any, capsys: Any
) -> None:
    use_env(broker.environ("kubernetes"))
    assert main(["--broker-url", "https://elsewhere.example:1", "ls"]) == 1
    err = capsys.readouterr().err
    assert "AudienceMismatchError" in err and "fix --broker-url if it is mistyped" in err
    assert "AGENT_SANDBOX_BROKER_URL" not in err
    assert main(["doctor", "--broker-url", "https://elsewhere.example:1"]) == 1
    out = capsys.readouterr().out
    assert "fix --broker-url if it is mistyped" in out and "fix AGENT_SANDBOX_BROKER_URL" not in out


def test_the_variable_is_named_when_the_url_came_from_it() -> None:
    from k8s_agent_sandbox_awx.cli._everyday import name_the_flag

    text = "... or fix AGENT_SANDBOX_BROKER_URL if it is mistyped."
    assert name_the_flag(text, argparse.Namespace(broker_url=None)) == text
    assert "fix --broker-url" in name_the_flag(text, argparse.Namespace(broker_url="https://x"))
