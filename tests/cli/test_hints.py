"""Each friction a first session met says what to do (``cli/_hints.py``): a ``kill`` of an
unknown name, a directory removed without ``-r``, a shell line given as one word, a plain
``http://`` URL against an HTTPS broker, an audience mismatch naming the flag that set the URL."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.cli._cli import main


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
    assert "BrokerUnavailableError" not in err  # no Python class in front (issue 30)
    https = url.replace("http://", "https://")
    assert "it may speak HTTPS" in err and f"Use its https:// URL: --broker-url {https}" in err


@pytest.mark.e2e
def test_an_audience_mismatch_names_the_flag_that_set_the_url(
    broker: Any, use_env: Any, capsys: Any
) -> None:
    use_env(broker.environ("kubernetes"))
    assert main(["--broker-url", "https://elsewhere.example:1", "ls"]) == 1
    err = capsys.readouterr().err
    assert "AudienceMismatchError" not in err and "fix --broker-url if it is mistyped" in err
    assert "AGENT_SANDBOX_BROKER_URL" not in err
    assert main(["doctor", "--broker-url", "https://elsewhere.example:1"]) == 1
    out = capsys.readouterr().out
    assert "fix --broker-url if it is mistyped" in out and "fix AGENT_SANDBOX_BROKER_URL" not in out


def test_the_variable_is_named_when_the_url_came_from_it() -> None:
    from k8s_agent_sandbox_awx.cli._hints import name_the_flag

    text = "... or fix AGENT_SANDBOX_BROKER_URL if it is mistyped."
    assert name_the_flag(text, argparse.Namespace(broker_url=None)) == text
    assert "fix --broker-url" in name_the_flag(text, argparse.Namespace(broker_url="https://x"))
