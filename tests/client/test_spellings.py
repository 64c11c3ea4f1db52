"""The one options/spellings table: every spelling of upstream, of the original package and of
the SDK's 0.5.0 that a call accepts or suggests, with the SDK's name for it. What a create maps
(``warmpool`` → ``template``, ``shutdown_after_seconds`` → ``timeout``, ...) and what an error
suggests come from the same row, and an error names the keywords as they were given."""

from __future__ import annotations

from typing import Any

import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox
from k8s_agent_sandbox_awx.errors import ConfigurationError

NOWHERE = {"broker_url": "https://127.0.0.1:9"}  # never reached: every check is local


def _refusal(kind: type[Exception], **options: Any) -> str:
    with pytest.raises(kind) as info:
        Sandbox.create(**NOWHERE, **options)
    return str(info.value)


def test_shutdown_after_seconds_is_timeout_in_a_conflict() -> None:
    """``shutdown_after_seconds`` is the SDK's ``timeout`` (docs/client.md): two values of it
    are refused naming the two keywords given and the SDK's name; the mapping used to say
    ``lifetime_seconds`` (a name the caller had not given, or the 0.5.0 one to keep)."""
    message = _refusal(ConfigurationError, timeout=600, shutdown_after_seconds=300)
    assert "timeout=600" in message and "shutdown_after_seconds=300" in message, message
    assert "lifetime_seconds" not in message, message
    message = _refusal(ConfigurationError, lifetime_seconds=600, shutdown_after_seconds=300)
    assert "lifetime_seconds=600" in message and "shutdown_after_seconds=300" in message
    assert "pass only timeout=" in message, message


@pytest.mark.parametrize(
    ("given", "value", "kind", "rule"),
    [
        ("shutdown_after_seconds", 0, ValueError, "positive"),
        ("shutdown_after_seconds", 1.5, TypeError, "whole number"),
        ("lifetime_seconds", -5, ValueError, "positive"),
        ("keepalive_ttl_seconds", "60", TypeError, "whole number"),
        ("keepalive", -1, ValueError, "positive"),
        ("timeout", 0, ValueError, "positive"),
    ],
)
def test_a_bad_value_is_refused_under_the_name_it_was_given(
    given: str, value: Any, kind: type[Exception], rule: str
) -> None:
    message = _refusal(kind, **{given: value})
    assert f"{given}=" in message and rule in message, message


def test_create_sandbox_names_its_own_spelling(make_client: Any, fake: Any) -> None:
    """``create_sandbox`` has upstream's ``shutdown_after_seconds`` and no ``timeout``: its
    errors name that, and ``timeout=`` there suggests it (the same row of the table)."""
    client = make_client()
    with pytest.raises(ValueError, match="shutdown_after_seconds=") as info:
        client.create_sandbox(shutdown_after_seconds=0)
    assert "timeout=" not in str(info.value).replace("shutdown_after_seconds=", "")
    with pytest.raises(TypeError, match="did you mean 'shutdown_after_seconds'"):
        client.create_sandbox(timeout=60)  # type: ignore[call-arg]
    assert fake.requests == []


def test_a_suggestion_means_the_same_thing_where_it_is_made(make_client: Any) -> None:
    """A spelling is suggested only where it means the SDK's name: ``command_timeout`` is a
    command's limit (``commands.run(timeout=)``), never a sandbox's lifetime (``create``'s
    ``timeout=``), and ``shutdown_after_seconds`` a lifetime, never a command's limit."""
    with pytest.raises(TypeError) as info:
        Sandbox.create(**NOWHERE, command_timeout=5)  # type: ignore[call-arg]
    assert "did you mean 'timeout'" not in str(info.value), str(info.value)
    sandbox = Sandbox(make_client(), _info())
    with pytest.raises(TypeError) as info:
        sandbox.commands.run("true", shutdown_after_seconds=5)  # type: ignore[call-arg]
    assert "did you mean 'timeout'" not in str(info.value), str(info.value)
    with pytest.raises(TypeError, match="did you mean 'timeout'"):
        sandbox.commands.run("true", command_timeout=5)  # type: ignore[call-arg]


def test_the_async_create_maps_the_same_table() -> None:
    import asyncio

    with pytest.raises(ConfigurationError) as info:
        asyncio.run(AsyncSandbox.create(**NOWHERE, timeout=600, shutdown_after_seconds=300))
    assert "shutdown_after_seconds=300" in str(info.value) and "lifetime_seconds" not in str(
        info.value
    )


def _info() -> Any:
    from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget, SandboxInfo

    return SandboxInfo("sbx-1", "default", None, "Ready", True, RouterTarget("sbx-1"))


def test_the_original_configs_keepalive_is_the_clients_keepalive() -> None:
    """``SandboxBrokerConnectionConfig(keepalive_ttl_seconds=)`` is the original package's
    spelling of ``sandbox_keepalive`` (docs/migrating.md: the keepalive works as in the
    original); a client built with it used to refuse it as "not available in this version"."""
    from k8s_agent_sandbox_awx import BrokerSandboxClient, SandboxBrokerConnectionConfig

    url = "https://broker.example"
    config = SandboxBrokerConnectionConfig(broker_url=url, token="t", keepalive_ttl_seconds=60)
    assert config.sandbox_keepalive == 60
    client = BrokerSandboxClient(config)
    try:
        assert client.connection_config.sandbox_keepalive == 60
    finally:
        client.close()
    assert (
        SandboxBrokerConnectionConfig(broker_url=url, keepalive_ttl_seconds=0).sandbox_keepalive
        == 0
    )
    with pytest.raises(ConfigurationError, match=r"keepalive_ttl_seconds=60.*sandbox_keepalive=30"):
        SandboxBrokerConnectionConfig(
            broker_url=url, keepalive_ttl_seconds=60, sandbox_keepalive=30
        )
    environ = {"AGENT_SANDBOX_BROKER_URL": url, "AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS": "30"}
    config = SandboxBrokerConnectionConfig.from_env(environ, keepalive_ttl_seconds=60)
    assert config.sandbox_keepalive == 60  # the keyword wins over the environment
