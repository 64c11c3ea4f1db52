"""BrokerConnectionConfig: URL rules, api_url pinning, environment, TLS options."""

from __future__ import annotations

from pathlib import Path

import pytest

from k8s_agent_sandbox_awx import BrokerConnectionConfig, ConfigurationError
from k8s_agent_sandbox_awx._upstream import SandboxDirectConnectionConfig, SandboxError

pytestmark = pytest.mark.upstream  # an upstream SandboxDirectConnectionConfig


def test_is_an_upstream_direct_connection_config() -> None:
    config = BrokerConnectionConfig(broker_url="https://Broker.Example/")
    assert isinstance(config, SandboxDirectConnectionConfig)
    assert config.broker_url == "https://broker.example"
    assert config.api_url == config.broker_url == config.audience


def test_api_url_alone_is_the_broker_url() -> None:
    assert (
        BrokerConnectionConfig(api_url="https://b.example/x/").broker_url == "https://b.example/x"
    )


def test_same_api_url_is_accepted() -> None:
    config = BrokerConnectionConfig(broker_url="https://b.example", api_url="https://b.example/")
    assert config.api_url == "https://b.example"


def test_different_api_url_is_rejected_as_a_bypass() -> None:
    with pytest.raises(ConfigurationError) as info:
        BrokerConnectionConfig(broker_url="https://b.example", api_url="https://router.internal")
    assert "bypass the broker" in str(info.value)
    assert "router" in str(info.value)
    assert isinstance(info.value, SandboxError)


@pytest.mark.parametrize("url", ["http://broker.example", "http://10.0.0.1:8080"])
def test_http_is_rejected_for_remote_hosts_even_with_opt_in(url: str) -> None:
    with pytest.raises(ConfigurationError, match="https://"):
        BrokerConnectionConfig(broker_url=url, allow_insecure_http=True)


def test_http_loopback_needs_the_opt_in() -> None:
    with pytest.raises(ConfigurationError, match="allow_insecure_http"):
        BrokerConnectionConfig(broker_url="http://127.0.0.1:8000")
    config = BrokerConnectionConfig(broker_url="http://127.0.0.1:8000/", allow_insecure_http=True)
    assert config.broker_url == "http://127.0.0.1:8000"
    ok = BrokerConnectionConfig(broker_url="http://[::1]:9", allow_insecure_http=True)
    assert ok.broker_url == "http://[::1]:9"


@pytest.mark.parametrize(
    "url", ["ftp://b.example", "b.example", "https://user:pw@b.example", "https://b.example/?a=1"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        BrokerConnectionConfig(broker_url=url)
    assert "pw" not in str(info.value)


def test_from_env_missing_url_names_the_variable() -> None:
    with pytest.raises(ConfigurationError, match="AGENT_SANDBOX_BROKER_URL"):
        BrokerConnectionConfig.from_env({})


def test_from_env_reads_variables_and_arguments_win(tmp_path: pytest.TempPathFactory) -> None:
    ca = tmp_path / "ca.pem"  # type: ignore[operator]
    ca.write_text("x")
    env = {
        "AGENT_SANDBOX_BROKER_URL": "https://env.example/",
        "AGENT_SANDBOX_CA_BUNDLE": str(ca),
        "AGENT_SANDBOX_TEMPLATE": "python",
    }
    config = BrokerConnectionConfig.from_env(env)
    assert (config.broker_url, config.ca_cert, config.template) == (
        "https://env.example",
        str(ca),
        "python",
    )
    config = BrokerConnectionConfig.from_env(env, broker_url="https://arg.example", template="go")
    assert (config.broker_url, config.template) == ("https://arg.example", "go")


def test_from_env_missing_ca_bundle_is_explained(tmp_path: pytest.TempPathFactory) -> None:
    env = {"AGENT_SANDBOX_BROKER_URL": "https://b", "AGENT_SANDBOX_CA_BUNDLE": "/nonexistent.pem"}
    with pytest.raises(ConfigurationError, match="AGENT_SANDBOX_CA_BUNDLE"):
        BrokerConnectionConfig.from_env(env)


def test_extra_headers_cannot_carry_authorization() -> None:
    with pytest.raises(ConfigurationError, match="Authorization"):
        BrokerConnectionConfig(broker_url="https://b", extra_headers={"Authorization": "Bearer x"})
    with pytest.raises(ValueError, match="reserved"):
        BrokerConnectionConfig(broker_url="https://b", extra_headers={"X-Sandbox-ID": "x"})


def test_unreadable_tls_files_are_configuration_errors(tmp_path: pytest.TempPathFactory) -> None:
    from k8s_agent_sandbox_awx import BrokerSandboxClient

    missing = str(tmp_path / "missing.pem")  # type: ignore[operator]
    config = BrokerConnectionConfig(broker_url="https://b.example", ca_cert=missing)
    with pytest.raises(ConfigurationError, match="CA bundle"):
        BrokerSandboxClient(config, auth=object())  # type: ignore[arg-type]
    config = BrokerConnectionConfig(broker_url="https://b.example", client_cert=(missing, missing))
    with pytest.raises(ConfigurationError, match="client certificate"):
        BrokerSandboxClient(config, auth=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url", ["HTTPS://Broker.Example:443/", "https://b.example:8443/base/", "https://[::1]:443"]
)
def test_the_broker_url_follows_the_one_url_rule(url: str) -> None:
    """One URL normaliser: the broker URL (the only origin a token goes to) is normalised by
    the same rule as a token's audience (``_jwt.normalise_url``)."""
    from k8s_agent_sandbox_awx.credentials._jwt import normalise_url

    assert BrokerConnectionConfig(broker_url=url).broker_url == normalise_url(url)


# ------------------------------------------- issue 19, item 12: every problem is a typed error


def _pem(tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


def test_a_ca_bundle_with_an_http_broker_names_the_variable(tmp_path: Path) -> None:
    """``AGENT_SANDBOX_CA_BUNDLE`` with an ``http://`` loopback broker raised pydantic's
    ``ValidationError`` ("client_cert and ca_cert require an https:// api_url"), which
    ``except SandboxError`` did not catch and which named no variable."""
    from k8s_agent_sandbox_awx import Sandbox

    env = {
        "AGENT_SANDBOX_BROKER_URL": "http://127.0.0.1:9",
        "AGENT_SANDBOX_CA_BUNDLE": _pem(tmp_path),
    }
    attempts = [
        lambda: BrokerConnectionConfig.from_env(env, allow_insecure_http=True),
        lambda: Sandbox.create(environ=env, allow_insecure_http=True),
        lambda: BrokerConnectionConfig(
            broker_url="http://127.0.0.1:9",
            allow_insecure_http=True,
            ca_cert=env["AGENT_SANDBOX_CA_BUNDLE"],
        ),
    ]
    for attempt in attempts:
        with pytest.raises(SandboxError) as info:
            attempt()
        assert isinstance(info.value, ConfigurationError)
        message = str(info.value)
        assert "AGENT_SANDBOX_CA_BUNDLE" in message and "https://" in message, message
    with pytest.raises(ConfigurationError, match=r"client_cert=.*https://"):
        BrokerConnectionConfig(
            broker_url="http://127.0.0.1:9", allow_insecure_http=True, client_cert=("c", "k")
        )


BAD_SETTINGS = [
    ({"request_timeout": 0}, "request_timeout", "greater than 0"),
    ({"request_timeout": "soon"}, "request_timeout", "valid number"),
    ({"max_attempts": 50}, "max_attempts", "less than or equal to 10"),
    ({"poll_interval": 0}, "poll_interval", "greater than 0"),
    ({"max_connections": 0}, "max_connections", "greater than or equal to 1"),
    ({"template": 5}, "template", "AGENT_SANDBOX_TEMPLATE"),
    ({"server_port": "x"}, "server_port", "valid integer"),
    ({"client_cert": "cert.pem"}, "client_cert", "valid tuple"),
    ({"extra_headers": {"X-Team": 1}}, "extra_headers", "extra_headers.X-Team"),
    ({"extra_headers": ["X-Team"]}, "extra_headers", "valid dictionary"),
]


@pytest.mark.parametrize(("settings", "setting", "says"), BAD_SETTINGS)
def test_an_invalid_setting_is_a_typed_error_naming_it(
    settings: dict[str, object], setting: str, says: str
) -> None:
    """pydantic's ``ValidationError`` escaped from every way of building a config (the model,
    ``model_validate``, a client's settings, ``Sandbox.create``'s, a config plus overrides)."""
    from k8s_agent_sandbox_awx import BrokerSandboxClient
    from k8s_agent_sandbox_awx.client._base import client_overrides
    from k8s_agent_sandbox_awx.errors import InvalidSettingError

    base = BrokerConnectionConfig(broker_url="https://b.example")
    attempts = [
        lambda: BrokerConnectionConfig(broker_url="https://b.example", **settings),
        lambda: BrokerConnectionConfig.model_validate(
            {"broker_url": "https://b.example", **settings}
        ),
        lambda: BrokerSandboxClient(broker_url="https://b.example", **settings),
    ]
    if setting == "request_timeout":
        attempts.append(lambda: client_overrides({"config": base, **settings}))  # type: ignore[typeddict-item]
    for attempt in attempts:
        with pytest.raises(InvalidSettingError) as info:
            attempt()
        error = info.value
        assert isinstance(error, ConfigurationError) and isinstance(error, ValueError)
        assert error.setting == setting and says in str(error), str(error)
        assert "validation error" not in str(error) and "pydantic" not in str(error)


def test_an_invalid_setting_never_shows_the_value(tmp_path: Path) -> None:
    from k8s_agent_sandbox_awx import SandboxBrokerConnectionConfig
    from k8s_agent_sandbox_awx.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError, match="token=") as info:
        SandboxBrokerConnectionConfig(broker_url="https://b.example", token=["s3cret-t0ken"])
    assert "s3cret-t0ken" not in str(info.value) and info.value.__cause__ is None
    with pytest.raises(InvalidSettingError) as info:
        BrokerConnectionConfig(broker_url="https://b.example", extra_headers={"X-Key": 42424242})
    assert "42424242" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("X-Key", "s3cret\r\nX-Injected: 1"),
        ("X-Key", "s3cr\u00e9t"),
        ("X Key", "s3cret-v"),
        ("X-Key", "a\x00"),
    ],
)
def test_an_extra_header_the_http_client_cannot_send_is_refused(name: str, value: str) -> None:
    """A header with a line break failed at the first request (h11's ``LocalProtocolError``,
    retried as a connection error); a non-ASCII value raised ``UnicodeEncodeError`` when the
    client was built. The value is never shown."""
    from k8s_agent_sandbox_awx import BrokerSandboxClient

    with pytest.raises(ConfigurationError, match="extra_headers") as info:
        BrokerSandboxClient(broker_url="https://b.example", extra_headers={name: value})
    assert value not in str(info.value) and "s3cr" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "https://bro ker.example",
        "https://broker.example/a\x7fb",
        "https://broker..example",
        "https://" + "a" * 64 + ".example",
        "https://bro%20ker.example",
        "https://xn--zz.example",
    ],
)
def test_a_broker_url_the_http_client_cannot_use_is_refused_first(url: str) -> None:
    """These URLs passed the URL checks and failed at the first request: a raw ``idna`` error,
    ``httpx.InvalidURL``, or a DNS failure reported as an unreachable broker."""
    from k8s_agent_sandbox_awx import BrokerSandboxClient

    with pytest.raises(ConfigurationError, match="AGENT_SANDBOX_BROKER_URL"):
        BrokerSandboxClient(broker_url=url)


@pytest.mark.parametrize("source", ["env", "flag"])
def test_the_cli_reports_a_ca_bundle_with_an_http_broker(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--allow-insecure-http --broker-url http://...`` with a CA bundle: exit 1, one line on
    stderr naming where the bundle came from and the fix, no traceback (doctor too)."""
    from k8s_agent_sandbox_awx.cli._cli import main

    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("AGENT_SANDBOX_CA_BUNDLE", raising=False)
    argv = ["--allow-insecure-http", "--broker-url", "http://127.0.0.1:9"]
    if source == "env":
        monkeypatch.setenv("AGENT_SANDBOX_CA_BUNDLE", _pem(tmp_path))
        named, fix = "AGENT_SANDBOX_CA_BUNDLE", "unset AGENT_SANDBOX_CA_BUNDLE"
    else:
        argv += ["--ca-bundle", _pem(tmp_path)]
        named, fix = "--ca-bundle", "leave out --ca-bundle"
    for command in (["ls"], ["run", "--", "true"]):
        assert main([*argv, *command]) == 1
        err = capsys.readouterr().err
        assert err.startswith("agent-sandbox-awx: error: "), err
        assert "ConfigurationError" not in err  # no Python class in front (issue 30)
        assert named in err and fix in err and "https://" in err
        assert err.count("\n") == 1 and "Traceback" not in err and "ValidationError" not in err
    assert main([*argv, "doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  config" in out and named in out, out


def test_the_cli_reports_an_invalid_broker_host(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from k8s_agent_sandbox_awx.cli._cli import main

    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", "x.y.z")
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", "https://xn--zz.example")
    assert main(["ls"]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "AGENT_SANDBOX_BROKER_URL" in err, err
    assert "Traceback" not in err and "IDNAError" not in err
