"""BrokerConnectionConfig: URL rules, api_url pinning, environment, TLS options."""

from __future__ import annotations

import pytest

from k8s_agent_sandbox_awx import BrokerConnectionConfig, ConfigurationError
from k8s_agent_sandbox_awx._upstream import SandboxDirectConnectionConfig, SandboxError


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
    from k8s_agent_sandbox_awx._jwt import normalise_url

    assert BrokerConnectionConfig(broker_url=url).broker_url == normalise_url(url)
