"""Every sub-command's parser: ``--help`` describes it and each of its arguments, and the global
options are taken after the command too (``cli/_common.py``, ``finish_subcommands``)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from k8s_agent_sandbox_awx.cli._cli import _parser, main

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
