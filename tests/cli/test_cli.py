"""The agent-sandbox-awx command line, end to end against the local broker."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.cli._cli import main
from k8s_agent_sandbox_awx.client.wire._dialect import LIST, WHOAMI
from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect
from tests._support.isolation import fake_bwrap, need_bwrap
from tests._support.servers import whoami_broker

CLI = [sys.executable, "-m", "k8s_agent_sandbox_awx.cli._cli"]


def test_version_and_help_are_fast_imports() -> None:
    code = (
        "import sys; from k8s_agent_sandbox_awx.cli import _cli; "
        "print(','.join(m for m in ('httpx', 'k8s_agent_sandbox', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    version = subprocess.run([*CLI, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("agent-sandbox-awx ")


def test_missing_broker_url_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.delenv("AGENT_SANDBOX_BROKER_URL", raising=False)
    assert main(["ls"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "AGENT_SANDBOX_BROKER_URL" in err
    assert "Traceback" not in err
    assert "--broker-url" in err and "broker_url=" not in err  # the CLI's way, not Python's


def test_an_errors_notes_are_printed(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """What an error's notes say (a sandbox a failed create left, to delete with `kill`; a
    command that may have started) reaches the CLI's user too, indented under the message."""
    from k8s_agent_sandbox_awx.cli import _cli
    from k8s_agent_sandbox_awx.errors import BrokerProtocolError

    def fails(args: argparse.Namespace) -> int:
        exc = BrokerProtocolError("Could not start a command: the answer has no command_id.")
        exc.add_note("The command may have started in the sandbox:\n  commands.list() shows it.")
        raise exc

    monkeypatch.setattr(_cli, "_cmd_ls", fails)
    assert main(["ls"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "agent-sandbox-awx: error: Could not start a command: the answer has no command_id.",
        "  The command may have started in the sandbox:",
        "    commands.list() shows it.",
    ]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_run_exit_code_becomes_the_process_exit_code(live: Any, broker: Any) -> None:
    env = {**os.environ, **broker.environ("kubernetes")}
    out = subprocess.run(
        [*CLI, "run", "--", "sh", "-c", "echo out; echo err >&2; exit 7"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout, out.stderr) == (7, "out\n", "err\n")
    ok = subprocess.run([*CLI, "run", "--", "true"], env=env, capture_output=True, timeout=60)
    assert ok.returncode == 0
    slow = subprocess.run(
        [*CLI, "run", "--timeout", "0.5", "--", "sleep", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert slow.returncode == 124 and "--timeout" in slow.stderr
    assert slow.stderr.strip().splitlines()[-1].startswith("agent-sandbox-awx: error:")
    assert live(broker) == []


def unsupported(dialect: str, argv: list[str], capsys: Any) -> bool:
    """Whether ``argv`` failed as an operation ``dialect`` lacks: exit 1, one line naming the
    dialect (``UnsupportedOperationError``, whose class the CLI does not print: issue 30)."""
    code, err = main(argv), capsys.readouterr().err
    return code == 1 and "Error" not in err and f"'{dialect}' dialect" in err


@pytest.mark.e2e
def test_whoami_ls_kill(broker: Any, dialect: str, use_env: Any, capsys: Any, live: Any) -> None:
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    use_env(env)
    token = Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
    features = get_dialect(dialect).features

    if WHOAMI in features:
        assert main(["whoami", "--json"]) == 0
        who = json.loads(capsys.readouterr().out)
        assert who["subject"] == "system:serviceaccount:team-a:agent"
        assert main(["whoami"]) == 0
        assert "provider:   kubernetes" in capsys.readouterr().out
    else:
        assert unsupported(dialect, ["whoami", "--json"], capsys)
        assert unsupported(dialect, ["whoami"], capsys)

    from k8s_agent_sandbox_awx import Sandbox

    sandbox = Sandbox.create()
    if LIST in features:
        assert main(["ls", "--json"]) == 0
        [item] = json.loads(capsys.readouterr().out)
        assert item["name"] == sandbox.name and item["phase"] == "Ready"
        assert main(["ls"]) == 0
        assert sandbox.name in capsys.readouterr().out
    else:
        assert unsupported(dialect, ["ls", "--json"], capsys)
        assert unsupported(dialect, ["ls"], capsys)
    assert main(["kill", sandbox.name, "sbx-does-not-exist"]) == 0
    out = capsys.readouterr().out
    # /rpc's delete answers 204 for an absent claim too: it cannot tell "already gone"
    gone = "already gone" if dialect == "v1" else "deleted"
    assert f"{sandbox.name}: deleted" in out and f"sbx-does-not-exist: {gone}" in out
    sandbox.close_connection()
    assert token not in out
    assert live(broker) == []


@pytest.mark.e2e
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_doctor_passes_and_redacts(broker: Any, use_env: Any, capsys: Any) -> None:
    env = broker.environ("gitlab")
    use_env(env)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for check in (
        "config",
        "credentials",
        "audience",
        "expiry",
        "reachability",
        "tls",
        "clock skew",
        "authentication",
    ):
        assert f"PASS  {check}" in out, out
    assert "signature = <redacted>" in out
    assert env["AGENT_SANDBOX_TOKEN"] not in out
    assert env["AGENT_SANDBOX_TOKEN"].rsplit(".", 1)[1] not in out
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and all(c["ok"] for c in report["checks"])


@pytest.mark.e2e
def test_doctor_reports_the_dialect(
    dialect_broker: Any, dialect: str, use_env: Any, capsys: Any
) -> None:
    use_env(dialect_broker.environ("kubernetes"))
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["protocol"] == dialect
    checks = {c["check"]: c["detail"] for c in report["checks"]}
    assert f"'{dialect}' dialect (found out)" in checks["protocol"]
    assert "accepted" in checks["authentication"] or "verified" in checks["authentication"]
    use_env({"AGENT_SANDBOX_BROKER_PROTOCOL": dialect})
    assert main(["doctor"]) == 0
    assert "(pinned by broker_protocol)" in capsys.readouterr().out


@pytest.mark.e2e
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_doctor_fails_with_hints(broker: Any, use_env: Any, capsys: Any) -> None:
    env = broker.environ("kubernetes")
    del env["AGENT_SANDBOX_CA_BUNDLE"]
    use_env(env)
    wrong_aud = broker.issue_kubernetes_token("default", "default", audience="https://elsewhere")
    token_file = Path(env["AGENT_SANDBOX_TOKEN_FILE"])
    token_file.unlink()
    token_file.write_text(wrong_aud)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  credentials" in out and "hint:" in out
    assert "FAIL  tls" in out and "AGENT_SANDBOX_CA_BUNDLE" in out
    assert wrong_aud not in out


@pytest.mark.timeout(30)
def test_dev_without_the_local_extra(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    import k8s_agent_sandbox_awx.cli as cli

    # as if the [local] extra's modules could not be imported
    monkeypatch.delattr(cli, "_local", raising=False)
    monkeypatch.setitem(sys.modules, "k8s_agent_sandbox_awx.cli._local", None)
    assert main(["dev"]) == 1
    err = capsys.readouterr().err
    assert 'python3 -m pip install -e ".[local]"' in err and "Traceback" not in err


def test_dev_help_reaches_the_dev_parser(capsys: Any) -> None:
    with pytest.raises(SystemExit) as info:
        main(["dev", "--help"])
    assert info.value.code == 0
    assert "agent-sandbox-awx dev" in capsys.readouterr().out


@pytest.mark.e2e
def test_doctor_without_broker_url_still_shows_the_providers(
    broker: Any, use_env: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    env = broker.environ("gitlab")
    use_env(env)
    monkeypatch.delenv("AGENT_SANDBOX_BROKER_URL")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  config" in out and "AGENT_SANDBOX_BROKER_URL" in out
    # every built-in provider's decision is shown, the token's provider as found
    for name in ("agent-sandbox-token", "agent-sandbox-token-file", "kubernetes-projected"):
        assert f"provider {name}:" in out, out
    assert "PASS  credentials" in out and "agent-sandbox-token" in out
    assert "AudienceMismatchError" not in out and "not for the broker ''" not in out
    assert "skipped" in out and "without a broker URL" in out
    assert env["AGENT_SANDBOX_TOKEN"] not in out
    assert env["AGENT_SANDBOX_TOKEN"].rsplit(".", 1)[1] not in out
    assert main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"]
    assert {d["name"] for d in report["credentials"]["decisions"]} >= {
        "agent-sandbox-token",
        "kubernetes-projected",
    }
    assert env["AGENT_SANDBOX_TOKEN"].rsplit(".", 1)[1] not in json.dumps(report)


@pytest.mark.parametrize("date", ["garbage", "Mon, 01 Jan 2024 00:00:00 -0000"])
def test_doctor_reports_an_unusable_date_header(date: str) -> None:
    """A broker Date header that cannot be compared is a failed clock-skew check with a hint,
    not a crash of the doctor command."""
    import httpx

    from k8s_agent_sandbox_awx import BrokerSandboxClient, OIDCTokenAuth
    from k8s_agent_sandbox_awx.cli._doctor import DoctorReport, check_broker
    from k8s_agent_sandbox_awx.client.http._config import BrokerConnectionConfig

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ok"}, headers={"Date": date})

    client = BrokerSandboxClient(
        BrokerConnectionConfig(broker_url="https://broker.test"),
        auth=OIDCTokenAuth("opaque"),
        http_transport=httpx.MockTransport(handler),
    )
    doc = DoctorReport()
    try:
        check_broker(doc, client, credentials_ok=False)
    finally:
        client.close()
    skew = next(c for c in doc.checks if c.name == "clock skew")
    assert not skew.ok and date in skew.detail and skew.hint


@pytest.mark.parametrize(
    ("dated", "ok", "shown"),
    [
        (0.0, True, "+0.0s"),  # dated as asked: the 70 s the answer took are no skew
        (69.6, True, "+0.0s"),  # dated as it left (12:01:09 is up to 12:01:10)
        (-120.0, False, "+119.0s"),  # dated 2 minutes before it was asked
        (200.0, False, "-130.0s"),  # after it arrived
    ],
)
def test_doctor_counts_as_skew_only_a_date_outside_the_request(
    dated: float, ok: bool, shown: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker dates its answer between the ask and the answer, in whole seconds: only a
    Date outside that is skew (the doctor took the time after the answer as the broker's:
    an answer that took 70 s was 70 s of skew)."""
    from email.utils import formatdate

    import httpx

    from k8s_agent_sandbox_awx import BrokerSandboxClient, OIDCTokenAuth
    from k8s_agent_sandbox_awx.cli import _doctor
    from k8s_agent_sandbox_awx.client.http._config import BrokerConnectionConfig

    asked = 1_700_000_000.0
    clock = iter([asked, asked + 70.0])  # the ask, then the answer 70 s later
    monkeypatch.setattr(_doctor, "_now", lambda: next(clock))

    def handler(request: httpx.Request) -> httpx.Response:
        date = formatdate(asked + dated, usegmt=True)
        return httpx.Response(200, json={"status": "ok"}, headers={"Date": date})

    client = BrokerSandboxClient(
        BrokerConnectionConfig(broker_url="https://broker.test"),
        auth=OIDCTokenAuth("opaque"),
        http_transport=httpx.MockTransport(handler),
    )
    doc = _doctor.DoctorReport()
    try:
        _doctor.check_broker(doc, client, credentials_ok=False)
    finally:
        client.close()
    skew = next(c for c in doc.checks if c.name == "clock skew")
    assert (skew.ok, skew.detail.split()[0]) == (ok, shown), skew


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--timeout", "-1"], "--timeout"),
        (["--ready-timeout", "-2"], "--ready-timeout"),
        (["--timeout", "inf"], "--timeout"),
    ],
)
def test_run_checks_its_timeouts_before_creating_a_sandbox(
    args: list[str], flag: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    # no broker is configured: the usage error comes first, nothing is created
    monkeypatch.delenv("AGENT_SANDBOX_BROKER_URL", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["run", *args, "--", "echo", "hi"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and "AGENT_SANDBOX_BROKER_URL" not in err


@pytest.mark.e2e
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_doctor_reports_an_unusable_ca_bundle_as_a_check(
    broker: Any, use_env: Any, tmp_path: Path, capsys: Any
) -> None:
    """A CA bundle that exists but holds no certificate fails the tls check; the report (with
    the credential checks) is still printed."""
    env = broker.environ("kubernetes")
    bad = tmp_path / "not-a-ca.pem"
    bad.write_text("not a certificate\n")
    env["AGENT_SANDBOX_CA_BUNDLE"] = str(bad)
    use_env(env)
    assert main(["doctor"]) == 1
    captured = capsys.readouterr()
    assert "PASS  credentials" in captured.out
    assert "FAIL  tls" in captured.out and str(bad) in captured.out
    assert "hint:" in captured.out and "error:" not in captured.err


@pytest.mark.e2e
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_doctor_credentials_hint_fits_the_failure(broker: Any, use_env: Any, capsys: Any) -> None:
    """A token that was found but is refused (wrong audience) gets a hint about that token,
    not the advice to set up a token source."""
    env = broker.environ("kubernetes")
    use_env(env)
    token_file = Path(env["AGENT_SANDBOX_TOKEN_FILE"])
    wrong_aud = broker.issue_kubernetes_token("default", "default", audience="https://elsewhere")
    token_file.unlink()
    token_file.write_text(wrong_aud)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    hint = next(
        line
        for line in out.splitlines()[
            out.splitlines().index(
                next(x for x in out.splitlines() if x.startswith("FAIL  credentials"))
            )
            + 1 :
        ]
        if "hint:" in line
    )
    assert "Set AGENT_SANDBOX_TOKEN or" not in hint and "audience" in hint, hint


def test_doctor_audience_check_uses_the_sdks_url_rule(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A token the SDK would send (aud differs only in case and a trailing slash) passes the
    doctor's audience check too; a token for another service fails it."""
    from k8s_agent_sandbox_awx import clear_credential_cache
    from k8s_agent_sandbox_awx.cli._doctor import DoctorReport, check_credentials
    from k8s_agent_sandbox_awx.testing import unsigned_jwt

    for name in [n for n in os.environ if n.startswith("AGENT_SANDBOX_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    for aud, ok in (["HTTPS://Broker.example/"], True), (["https://other.example"], False):
        clear_credential_cache()
        monkeypatch.setenv("AGENT_SANDBOX_TOKEN", unsigned_jwt({"aud": aud}))
        doc = DoctorReport()
        check_credentials(doc, "https://broker.example")
        checks = {c.name: c.ok for c in doc.checks}
        assert checks.get("credentials") is ok
        if ok:
            assert checks["audience"] is True
    clear_credential_cache()


# ------------------------------------------------------------------ usability (issue 10)


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AGENT_SANDBOX_* variable, no plugin: nothing is looked up beyond this machine."""
    from k8s_agent_sandbox_awx import clear_credential_cache

    for name in [n for n in os.environ if n.startswith("AGENT_SANDBOX_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    clear_credential_cache()


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9", "http://localhost:9/", "http://sandbox-broker.example"]
)
@pytest.mark.parametrize("source", ["flag", "env"])
def test_insecure_http_hint_names_the_cli_flag(
    url: str, source: str, no_credentials: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The CLI cannot pass allow_insecure_http=True: its hint names --allow-insecure-http."""
    if source == "env":
        monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", url)
        argv = ["ls"]
    else:
        argv = ["--broker-url", url, "ls"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "--allow-insecure-http" in err and "allow_insecure_http=True" not in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert main(["--broker-url", url, "doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  config" in out and "--allow-insecure-http" in out, out
    assert "allow_insecure_http=True" not in out


def test_insecure_http_hint_in_python_names_the_argument(no_credentials: None) -> None:
    from k8s_agent_sandbox_awx import ConfigurationError, Sandbox

    with pytest.raises(ConfigurationError) as info:
        Sandbox.create(broker_url="http://127.0.0.1:9")
    assert "allow_insecure_http=True" in str(info.value)
    assert "--allow-insecure-http" not in str(info.value)


@pytest.mark.parametrize(
    ("ports", "shown"),
    [([8000, "3000-3999"], "  ports: 8000, 3000-3999"), ([], "  ports: none"), (None, None)],
)
def test_whoami_shows_the_allowed_ports_when_the_broker_names_them(
    no_credentials: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
    ports: list[Any] | None,
    shown: str | None,
) -> None:
    """``whoami`` shows the ports the caller's policy allows, as the broker's answer names
    them; an older broker's answer without them shows none (no ``ports`` line)."""
    from k8s_agent_sandbox_awx.testing import unsigned_jwt

    policy: dict[str, Any] = {"templates": ["python"], "max_sandboxes": 5}
    if ports is not None:
        policy["ports"] = ports

    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with whoami_broker({"provider": "plain", "subject": "me", "policy": policy}) as url:
        monkeypatch.setenv("AGENT_SANDBOX_TOKEN", unsigned_jwt({"aud": url}))
        assert main(["--allow-insecure-http", "--broker-url", url, "whoami"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert "  max_sandboxes: 5" in lines  # the rest of the policy as before
        assert [line for line in lines if "ports" in line] == ([shown] if shown else [])


def test_allow_insecure_http_flag_reaches_a_loopback_http_broker(
    no_credentials: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``--allow-insecure-http`` lets the CLI use a plain-http broker on this machine."""
    from k8s_agent_sandbox_awx.testing import unsigned_jwt

    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with whoami_broker({"provider": "plain", "subject": "me"}) as url:
        monkeypatch.setenv("AGENT_SANDBOX_TOKEN", unsigned_jwt({"aud": url}))
        assert main(["--broker-url", url, "whoami", "--json"]) == 1  # refused without the flag
        assert "--allow-insecure-http" in capsys.readouterr().err
        assert main(["--allow-insecure-http", "--broker-url", url, "whoami", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["subject"] == "me"


@pytest.mark.e2e
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_run_json(broker: Any, use_env: Any, live: Any, capsys: Any) -> None:
    """``run --json``: one JSON object (documented in docs/client.md); the exit code is still
    the command's."""
    use_env(broker.environ("kubernetes"))
    assert main(["run", "--json", "--", "sh", "-c", "echo out; echo err >&2; exit 7"]) == 7
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result == {
        "sandbox": result["sandbox"],
        "exit_code": 7,
        "stdout": "out\n",
        "stderr": "err\n",
        "timed_out": False,
    }
    assert result["sandbox"] and captured.err == ""
    assert main(["run", "--json", "--timeout", "0.5", "--", "sleep", "5"]) == 124
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["timed_out"] is True and "--timeout" in captured.err
    assert live(broker) == []


@pytest.mark.e2e
def test_kill_json(broker: Any, dialect: str, use_env: Any, capsys: Any) -> None:
    use_env(broker.environ("kubernetes"))
    from k8s_agent_sandbox_awx import Sandbox

    sandbox = Sandbox.create()
    try:
        assert main(["kill", "--json", sandbox.name, "sbx-does-not-exist"]) == 0
        assert json.loads(capsys.readouterr().out) == [
            {"name": sandbox.name, "deleted": True},
            {"name": "sbx-does-not-exist", "deleted": dialect != "v1"},  # /rpc cannot tell
        ]
    finally:
        sandbox.close_connection()


def test_no_credentials_error_is_a_list(
    no_credentials: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """One provider per line, one fix per line (it was one line of 1,000 characters)."""
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", "https://127.0.0.1:9")  # never contacted
    assert main(["whoami"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("agent-sandbox-awx: error: No credential")
    for provider in ("agent-sandbox-token", "agent-sandbox-token-file", "kubernetes-projected"):
        assert sum(line.lstrip().startswith(f"- {provider}: ") for line in lines) == 1, lines
    assert all(line.startswith("  ") for line in lines[1:])  # continuation lines are indented
    fixes = lines[lines.index(next(x for x in lines if "To fix it" in x)) + 1 :]
    assert len(fixes) >= 4 and all(f.lstrip().startswith("- ") for f in fixes), lines
    assert any("AGENT_SANDBOX_TOKEN " in f for f in fixes)
    assert max(map(len, lines)) < 200, max(lines, key=len)


def test_docs_describe_every_json_output() -> None:
    """docs/client.md documents the --json shape of every command that has --json."""
    from k8s_agent_sandbox_awx.cli._cli import _parser

    docs = (Path(__file__).resolve().parents[2] / "docs" / "client.md").read_text()
    parser = _parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    with_json = sorted(
        name
        for name, p in sub.choices.items()
        if any("--json" in a.option_strings for a in p._actions)
    )
    assert with_json == ["create", "doctor", "explain", "extend", "kill", "ls", "run", "whoami"]
    for name in with_json:
        assert f"| `{name}` | " in docs, name


@pytest.mark.e2e
def test_ls_time_left_extend_and_files(
    broker: Any,
    dialect: str,
    use_env: Any,
    capsys: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    use_env(broker.environ("kubernetes", namespace="team-a", service_account="agent"))
    from k8s_agent_sandbox_awx import Sandbox

    sandbox = Sandbox.create(timeout=120)
    try:
        name = sandbox.name
        if LIST in get_dialect(dialect).features:
            assert main(["ls"]) == 0
            out = capsys.readouterr().out
            assert "LEFT" in out.splitlines()[0] and ("1m" in out or "2m" in out)
            assert main(["ls", "--json"]) == 0
            assert 0 < json.loads(capsys.readouterr().out)[0]["seconds_left"] <= 120
        else:
            assert unsupported(dialect, ["ls"], capsys)
        assert main(["extend", name, "300", "--json"]) == 0
        extended = json.loads(capsys.readouterr().out)
        assert 200 < extended["seconds_left"] <= 300 and extended["capped"] is False
        if dialect == "v1":
            assert main(["extend", name, "100000"]) == 1  # over the policy cap: refused, explained
            assert "lifetime_exceeds_policy" in capsys.readouterr().err
        else:  # /rpc cuts the deadline at the cap (3600 s from creation) and says so
            assert main(["extend", name, "100000", "--json"]) == 0
            capped = json.loads(capsys.readouterr().out)
            assert capped["capped"] is True and 3500 < capped["seconds_left"] <= 3600
            assert main(["extend", name, "100000"]) == 0
            assert "(cut at the policy's cap)" in capsys.readouterr().out

        local = tmp_path / "up.txt"
        local.write_bytes(b"from the cli")
        assert main(["files", "put", name, str(local), "d/up.txt", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["path"] == "/app/d/up.txt"
        assert main(["files", "ls", name, "d", "--json"]) == 0
        [entry] = json.loads(capsys.readouterr().out)
        assert (entry["name"], entry["size"], entry["type"]) == ("up.txt", 12, "file")
        assert main(["files", "ls", name]) == 0
        assert "d/" in capsys.readouterr().out
        monkeypatch.chdir(tmp_path)
        assert main(["files", "get", name, "d/up.txt", "copy.txt"]) == 0
        assert (tmp_path / "copy.txt").read_bytes() == b"from the cli"
        assert main(["files", "rm", name, "d", "--json"]) == 1  # not empty: needs -r
        assert "not_empty" in capsys.readouterr().err
        assert main(["files", "rm", name, "d", "-r", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"path": "d", "removed": True}
        assert main(["files", "rm", name, "d"]) == 0
        assert "did not exist" in capsys.readouterr().out
    finally:
        sandbox.kill()


@pytest.mark.e2e
def test_ls_shows_each_sandboxs_lifetime_created_expires_and_left(
    broker: Any, use_env: Any, capsys: Any
) -> None:
    use_env(broker.environ("kubernetes", namespace="team-a", service_account="agent"))
    from k8s_agent_sandbox_awx import Sandbox

    with Sandbox.create(timeout=120) as sandbox:
        info = sandbox.get_info()
        assert main(["ls"]) == 0
        header, row = capsys.readouterr().out.splitlines()
        assert header.split() == [
            "NAME",
            "PHASE",
            "TEMPLATE",
            "NAMESPACE",
            "CREATED",
            "EXPIRES",
            "LEFT",
        ]
        cells = row.split()
        assert cells[0] == sandbox.name
        created, expires = cells[4], cells[5]
        assert created.endswith("Z") and expires.endswith("Z") and created < expires
        assert created == info.created_at and expires == info.expires_at
        assert main(["ls", "--json"]) == 0
        [item] = json.loads(capsys.readouterr().out)
        assert item["created_at"] == created and item["expires_at"] == expires
        assert 0 < item["seconds_left"] <= 120


# -- doctor: the isolation local sandboxes get here ---------------------------------------------
def _doctor_without_broker(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> tuple[str, Any]:
    """doctor's text and JSON with no broker configured (it fails: no URL)."""
    monkeypatch.delenv("AGENT_SANDBOX_BROKER_URL", raising=False)
    assert main(["doctor"]) == 1
    text = capsys.readouterr().out
    assert main(["doctor", "--json"]) == 1
    return text, json.loads(capsys.readouterr().out)["local_isolation"]


def test_doctor_says_local_sandboxes_are_host_processes(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("AGENT_SANDBOX_LOCAL_ISOLATION", "none")
    text, found = _doctor_without_broker(monkeypatch, capsys)
    said = (
        "local sandboxes here (dev, demo, LocalBroker): isolation none "
        "(AGENT_SANDBOX_LOCAL_ISOLATION='none' was asked for): sandboxes are host processes"
    )
    assert said in text
    assert found["mode"] == "none" and "host processes" in found["detail"]


def test_doctor_says_local_sandboxes_run_in_bubblewrap(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    need_bwrap()
    monkeypatch.setenv("AGENT_SANDBOX_LOCAL_ISOLATION", "auto")
    text, found = _doctor_without_broker(monkeypatch, capsys)
    assert "local sandboxes here (dev, demo, LocalBroker): isolation bwrap (bubblewrap " in text
    assert found["mode"] == "bwrap" and "namespaces of its own" in found["detail"]


def test_doctor_says_why_local_sandboxes_cannot_have_bubblewrap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    with fake_bwrap(tmp_path, monkeypatch, None):
        monkeypatch.setenv("AGENT_SANDBOX_LOCAL_ISOLATION", "auto")
        text, found = _doctor_without_broker(monkeypatch, capsys)
        assert "isolation none (bwrap is not installed (install the bubblewrap package" in text
        assert found["mode"] == "none"
        monkeypatch.setenv("AGENT_SANDBOX_LOCAL_ISOLATION", "bwrap")
        text, found = _doctor_without_broker(monkeypatch, capsys)
        assert "local sandboxes here (dev, demo, LocalBroker): they cannot start: " in text
        assert "AGENT_SANDBOX_LOCAL_ISOLATION='bwrap' needs bubblewrap" in text
        assert found["mode"] is None and "apt-get install bubblewrap" in found["detail"]
    monkeypatch.setenv("AGENT_SANDBOX_LOCAL_ISOLATION", "vm")
    text, found = _doctor_without_broker(monkeypatch, capsys)
    assert "they cannot start: AGENT_SANDBOX_LOCAL_ISOLATION='vm' is not an isolation" in text
    assert found["mode"] is None
