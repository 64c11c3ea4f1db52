"""Issue 30: every message in the user's own language. The CLI's user reads flags and
commands (``--timeout 300``, ``run --background``), never a Python keyword or exception class;
the SDK's user reads keywords (``timeout=300``). Each test reads what the user of that surface
sees: the CLI's stderr, or ``str(exc)``."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.cli._cli import main
from k8s_agent_sandbox_awx.client.http._config import BrokerConnectionConfig
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    ConfigurationError,
    LifetimeExceedsPolicyError,
)

_PYTHON_WORDS = re.compile(r"\b[a-z_]+=|sandbox\.commands|commands\.run|\b[A-Z]\w*Error\b")
"""What a CLI message must not say: a keyword argument, a Python call, an exception class."""


@pytest.fixture
def nothing_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AGENT_SANDBOX_* variable, no plugin: a fresh clone's first command."""
    from k8s_agent_sandbox_awx import clear_credential_cache

    for name in [n for n in os.environ if n.startswith("AGENT_SANDBOX_") or n == "BROKER_URL"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    clear_credential_cache()


def _cli_error(argv: list[str], capsys: Any) -> str:
    assert main(argv) != 0
    err: str = capsys.readouterr().err
    assert err.startswith("agent-sandbox-awx: error: "), err
    return err


def _speaks_flags(err: str) -> None:
    assert not _PYTHON_WORDS.search(err), err


@pytest.mark.e2e
def test_a_time_limit_over_the_runtimes_cap_names_the_cap_and_the_flags(
    broker: Any, use_env: Any, capsys: Any
) -> None:
    """Item 1: ``run --timeout 400`` was "the sandbox runtime answered 400 (field 'timeout'
    must be ... or 'none' ...). See the runtime's detail."; now the cap (300 s) and the next
    step in flags; in Python, the same in keywords."""
    use_env(broker.environ("kubernetes"))
    with Sandbox.create() as sandbox:
        err = _cli_error(
            ["run", "--sandbox", sandbox.name, "--timeout", "400", "--", "true"], capsys
        )
        _speaks_flags(err)
        assert "cap, at most 300 s" in err and "--timeout 300 or less" in err, err
        assert "--background --timeout 0 (with --sandbox NAME or --keep)" in err, err
        for wire in ("field", "'none'", "See the runtime's detail"):
            assert wire not in err, err
        with pytest.raises(BrokerError) as info:
            sandbox.commands.run("true", timeout=400)
        said = str(info.value)
        assert "cap, at most 300 s" in said and "timeout=300 or less" in said, said
        assert "background=True, timeout=0" in said and "--" not in said, said
        # item 13: E2B's home directory; the runtime's "field 'cwd'" named neither root
        with pytest.raises(BrokerError) as info:
            sandbox.commands.run("pwd", cwd="/home/user")
        said = str(info.value)
        assert "'/home/user' does not exist in the sandbox" in said and "field" not in said
        assert "/app and /workspace" in said and "cwd='/app'" in said, said


@pytest.mark.e2e
def test_lifetime_over_the_cap_at_create_and_at_extend(
    broker: Any, use_env: Any, capsys: Any
) -> None:
    """Item 2: ``create --timeout 99999`` names ``--timeout`` (not ``timeout=``); ``extend N
    99999`` gets an extension's ending, not the create's; Python's ``set_timeout`` its own."""
    use_env(broker.environ("kubernetes"))
    err = _cli_error(["create", "--timeout", "99999"], capsys)
    _speaks_flags(err)
    assert "--timeout (or AGENT_SANDBOX_TTL_SECONDS)" in err and "max_lifetime_seconds" in err
    with Sandbox.create() as sandbox:
        err = _cli_error(["extend", sandbox.name, "99999"], capsys)
        _speaks_flags(err)
        assert "a smaller SECONDS in `agent-sandbox-awx extend NAME SECONDS`" in err, err
        assert "AGENT_SANDBOX_TTL_SECONDS" not in err and "clamp-lifetime" not in err, err
        with pytest.raises(LifetimeExceedsPolicyError) as info:
            sandbox.set_timeout(99999)
        assert "set_timeout(seconds)" in str(info.value) and "--" not in str(info.value)
    with pytest.raises(LifetimeExceedsPolicyError) as created:
        Sandbox.create(timeout=99999)
    assert "timeout= (or AGENT_SANDBOX_TTL_SECONDS)" in str(created.value)


@pytest.mark.e2e
def test_the_runtime_port_and_a_port_nothing_listens_on_speak_cli(
    broker: Any, use_env: Any, capsys: Any
) -> None:
    """Item 2: ``port-forward N 8888`` (the runtime's own port) was "ValueError: ... use
    sandbox.commands and sandbox.files"; a port nothing listens on, relayed through the
    forward the CLI runs, named only ``commands.run(..., background=True)``."""
    use_env(broker.environ("kubernetes"))
    with Sandbox.create() as sandbox:
        err = _cli_error(["port-forward", sandbox.name, "8888"], capsys)
        _speaks_flags(err)
        assert "`agent-sandbox-awx run` and `agent-sandbox-awx files`" in err, err
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with sandbox.ports.forward(port) as forward:
            detail = httpx.get(forward.url + "/").json()["detail"]
        assert f"agent-sandbox-awx run --sandbox {sandbox.name} --background" in detail, detail
        with sandbox.ports.client(port) as client, pytest.raises(BrokerError) as info:
            client.get("/")
        assert "sandbox.commands.run(..., background=True" in str(info.value)


@pytest.mark.e2e
def test_a_certificate_that_does_not_verify_names_the_ca_flag(
    broker: Any, wrong_ca_environ: Any, use_env: Any, capsys: Any
) -> None:
    """Item 2: the TLS error said "(or ca_cert=)" to the user who typed ``--ca-bundle``."""
    environ, wrong = wrong_ca_environ
    use_env({k: v for k, v in environ.items() if k != "AGENT_SANDBOX_CA_BUNDLE"})
    err = _cli_error(["--ca-bundle", wrong, "ls"], capsys)
    _speaks_flags(err)
    assert "Set --ca-bundle to the PEM file" in err and "did not verify" in err, err


def test_nothing_configured_points_at_dev(nothing_configured: None, capsys: Any) -> None:
    """Item 3: ``doctor`` said "No credential found for the broker ''" and "aud is ''";
    neither it nor ``run`` mentioned that ``agent-sandbox-awx dev`` prints the lines to paste."""
    err = _cli_error(["run", "--", "true"], capsys)
    _speaks_flags(err)
    assert "No broker URL." in err and "--broker-url (or AGENT_SANDBOX_BROKER_URL)" in err
    assert "`agent-sandbox-awx dev`" in err, err
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "''" not in out and "agent-sandbox-awx dev" in out, out
    assert "No credential found for a broker (no broker URL is set)" in out, out
    assert "skipped without a broker URL" in out
    assert not re.search(r"\b[A-Z]\w*Error\b", out), out
    with pytest.raises(ConfigurationError) as info:
        BrokerConnectionConfig.from_env({})
    assert "broker_url= (or AGENT_SANDBOX_BROKER_URL)" in str(info.value)
    assert "agent-sandbox-awx dev" in str(info.value)


@pytest.mark.parametrize("source", ["env", "flag"])
def test_a_malformed_broker_url_names_its_setting(
    source: str, nothing_configured: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Item 11: "The broker URL 'https:/x' must be an absolute https:// URL with a host" named
    neither the variable nor the flag; ``doctor`` then said "skipped without a broker URL"."""
    argv = ["--broker-url", "https:/sandbox-broker.example"] if source == "flag" else []
    if source == "env":
        monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", "https:/sandbox-broker.example")
    named = "--broker-url" if source == "flag" else "AGENT_SANDBOX_BROKER_URL"
    err = _cli_error([*argv, "ls"], capsys)
    assert "must be an absolute https:// URL with a host" in err and f"Set {named} to" in err
    _speaks_flags(err)
    assert main([*argv, "doctor"]) == 1
    out = capsys.readouterr().out
    assert f"Set {named} to" in out and "without a broker URL" not in out, out
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", "sandbox-broker.example")
    with pytest.raises(ConfigurationError) as info:
        BrokerConnectionConfig.from_env()
    assert "Set AGENT_SANDBOX_BROKER_URL to" in str(info.value)
    with pytest.raises(ConfigurationError) as info:
        BrokerConnectionConfig(broker_url="sandbox-broker.example")
    assert "Set broker_url= (or AGENT_SANDBOX_BROKER_URL) to" in str(info.value)


def test_a_broker_that_cannot_be_reached_leads_with_cannot_connect(
    nothing_configured: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Item 11: it opened with "Could not find out which protocol the broker speaks"."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"https://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", "x.y.z")
    err = _cli_error(["--broker-url", url, "ls"], capsys)
    assert err.startswith(f"agent-sandbox-awx: error: Cannot connect to the broker at {url}: ")
    assert "Check --broker-url and that the broker runs." in err, err
    _speaks_flags(err)
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", url)  # the variable the user set: named
    err = _cli_error(["ls"], capsys)
    assert "Check AGENT_SANDBOX_BROKER_URL and that the broker runs." in err, err


def test_a_ca_bundle_given_as_pem_text_is_never_echoed(
    nothing_configured: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Item 10: a GitLab "Variable" instead of a "File" printed 700 characters of PEM as the
    path; now the message says what it is and how to make it a file, in each CI."""
    pem = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUb3Jp\n-----END CERTIFICATE-----\n"
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", "https://sandbox-broker.example")
    monkeypatch.setenv("AGENT_SANDBOX_CA_BUNDLE", pem)
    for argv in (["ls"], ["run", "--", "true"]):
        err = _cli_error(argv, capsys)
        assert "MIIB" not in err and "BEGIN" not in err, err
        assert "holds PEM text" in err and "Set AGENT_SANDBOX_CA_BUNDLE to the path" in err
        assert "type File" in err and "GitHub Actions" in err
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "MIIB" not in out and "holds PEM text" in out, out
    with pytest.raises(ConfigurationError) as info:
        BrokerConnectionConfig.from_env()
    assert "MIIB" not in str(info.value) and "holds PEM text" in str(info.value)


def test_the_ca_bundle_of_a_stopped_dev_broker_says_so(
    nothing_configured: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    """Item 4 (in part): after Ctrl-C on ``dev`` the exported CA bundle is gone with its
    directory; ``run`` said "... is not a readable file", ``doctor`` "(from ca_cert)". Both now
    say that the local broker from ``dev`` is no longer running, and to start it again."""
    from k8s_agent_sandbox_awx.client.http._config import LOCAL_BROKER_DIR_PREFIX

    pytest.importorskip("trustme")
    from k8s_agent_sandbox_awx.testing import _broker

    assert LOCAL_BROKER_DIR_PREFIX == _broker._TMP_PREFIX  # the directory dev's broker makes
    gone = tmp_path / f"{LOCAL_BROKER_DIR_PREFIX}abc123" / "ca.pem"
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", "https://127.0.0.1:9")
    monkeypatch.setenv("AGENT_SANDBOX_CA_BUNDLE", str(gone))
    err = _cli_error(["run", "--", "true"], capsys)
    assert "local broker from `agent-sandbox-awx dev` is no longer running" in err, err
    assert "Start it again" in err
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "no longer running" in out and "ca_cert" not in out, out
    elsewhere = tmp_path / "ca.pem"  # another missing bundle: its own words, and its variable
    monkeypatch.setenv("AGENT_SANDBOX_CA_BUNDLE", str(elsewhere))
    err = _cli_error(["ls"], capsys)
    assert "is not a readable file. Point AGENT_SANDBOX_CA_BUNDLE at" in err, err


_JWT_LIKE = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJwcm9qZWN0X3BhdGg6ZyJ9.c2ln"


def test_a_gitlab_job_without_id_tokens_is_shown_its_yaml(
    nothing_configured: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Item 9: no ``id_tokens`` in a GitLab job: the error listed the providers and suggested
    a projected ServiceAccount mount and a plugin; now, with ``GITLAB_CI=true``, the job's YAML
    with the broker URL as ``aud``, and a token under another name (``GITLAB_OIDC_TOKEN``) is
    named with ``OIDCTokenAuth.from_env``; its value is never shown."""
    from k8s_agent_sandbox_awx import DefaultCredentials
    from k8s_agent_sandbox_awx.errors import NoCredentialsError

    url = "https://sandbox-broker.example"
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", url)
    monkeypatch.setenv("GITLAB_CI", "true")
    monkeypatch.setenv("GITLAB_OIDC_TOKEN", _JWT_LIKE)
    err = _cli_error(["run", "--", "true"], capsys)
    assert "this GitLab CI job (GITLAB_CI=true)" in err, err
    assert "id_tokens:" in err and "AGENT_SANDBOX_TOKEN:" in err and f"aud: {url}" in err
    assert 'OIDCTokenAuth.from_env("GITLAB_OIDC_TOKEN")' in err and "GITLAB_OIDC_TOKEN holds" in err
    assert "projected ServiceAccount" not in err and "provider plugin" not in err, err
    assert _JWT_LIKE not in err and _JWT_LIKE.split(".")[1] not in err
    lines = err.splitlines()  # the YAML keeps its indentation, one key a line
    yaml = [
        line.strip() for line in lines[lines.index(next(x for x in lines if "id_tokens:" in x)) :]
    ]
    assert yaml[:3] == ["id_tokens:", "AGENT_SANDBOX_TOKEN:", f"aud: {url}"], yaml
    with pytest.raises(NoCredentialsError) as info:
        DefaultCredentials(environ={"GITLAB_CI": "true"}).get_credential(url)
    assert f"aud: {url}" in str(info.value) and "mount a projected" not in str(info.value)
    with pytest.raises(NoCredentialsError) as info:  # elsewhere: every way, as before
        DefaultCredentials(environ={}).get_credential(url)
    assert "projected ServiceAccount" in str(info.value) and "id_tokens:" not in str(info.value)


def test_an_http_broker_url_refused_or_answered_by_https(
    broker: Any, nothing_configured: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Item 5: ``doctor`` with an ``http://`` URL to a remote host (refused, rightly) still said
    "no broker URL" and "Set AGENT_SANDBOX_BROKER_URL"; a loopback ``http://`` URL of a broker
    that speaks HTTPS ended in "RemoteProtocolError ... Retry if that is safe"."""
    from k8s_agent_sandbox_awx import BrokerSandboxClient, OIDCTokenAuth

    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", "http://sandbox-broker.example")
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", broker.issue_gitlab_token("g/p", audience="x"))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "clear text" in out and "no broker URL" not in out, out
    assert "Set AGENT_SANDBOX_BROKER_URL" not in out and "was refused (above)" in out, out
    plain = broker.url.replace("https://", "http://")
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", plain)
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", broker.issue_gitlab_token("g/p", audience=plain))
    err = _cli_error(["--allow-insecure-http", "ls"], capsys)
    assert "may speak HTTPS" in err and "Retry" not in err, err
    assert f"AGENT_SANDBOX_BROKER_URL={broker.url}" in err and "hint: " not in err, err
    _speaks_flags(err)
    auth = OIDCTokenAuth(broker.issue_gitlab_token("g/p", audience=plain))
    with BrokerSandboxClient(broker_url=plain, allow_insecure_http=True, auth=auth) as client:
        with pytest.raises(BrokerError) as info:
            client.list_all_sandboxes()
    assert f"broker_url={broker.url!r}" in str(info.value) and "Retry" not in str(info.value)


@pytest.mark.e2e
def test_explain_reads_the_broker_url_and_ci_logs_name_no_person(
    broker: Any, nothing_configured: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Item 8: ``explain()`` had no default (a TypeError) and there was no ``explain``
    command; ``doctor`` in a CI log printed every claim, ``user_email`` included, and a "local
    sandboxes here" line that means nothing in CI."""
    from k8s_agent_sandbox_awx import explain

    token = broker.issue_gitlab_token("group/project", audience=broker.url)
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", broker.url)
    monkeypatch.setenv("AGENT_SANDBOX_CA_BUNDLE", broker.ca_bundle)
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", token)
    assert explain().selected == "agent-sandbox-token"  # the broker URL, as everything reads it
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert f"credentials for {broker.url}:" in out and "selected: agent-sandbox-token" in out
    assert "payload.project_path = 'group/project'" in out, out
    from k8s_agent_sandbox_awx.credentials import _jwt

    decoded = _jwt.decode_token(token)
    assert decoded is not None
    email = decoded.payload["user_email"]
    assert email in out  # on a developer's machine: shown
    monkeypatch.setenv("GITLAB_CI", "true")
    for argv in (["explain"], ["doctor"]):
        main(argv)
        out = capsys.readouterr().out
        assert "in GitLab CI: the broker's policies match this job" in out, out
        assert "project_path='group/project'" in out and "local sandboxes here" not in out
        assert email not in out and "user_email = <not shown in a CI log>" in out, out
    monkeypatch.delenv("AGENT_SANDBOX_BROKER_URL")
    with pytest.raises(ValueError, match="AGENT_SANDBOX_BROKER_URL"):
        explain()
