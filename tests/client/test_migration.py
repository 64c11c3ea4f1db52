"""Drop-in migration from the original package of this name: code in its style (its keywords,
names and environment variables), against a local broker that serves only ``/rpc`` (what the
deployed brokers speak) — see docs/migrating.md. Its README examples themselves are
tests/client/test_original_readme.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, BrokerConnectionConfig, Sandbox
from k8s_agent_sandbox_awx.credentials._chain import explain
from k8s_agent_sandbox_awx.errors import ConfigurationError

Env = Callable[[dict[str, str]], None]


def _original_env(broker: Any, tmp_path: Path) -> dict[str, str]:
    """The environment a user of the original package has: its variable names only (and the
    local broker's CA for TLS, through the standard ``SSL_CERT_FILE``)."""
    token = tmp_path / "token"
    broker.write_projected_token(token, namespace="default", service_account="agent")
    return {
        "BROKER_URL": broker.url,
        "AGENT_SANDBOX_TOKEN_PATH": str(token),
        "AGENT_SANDBOX_WARMPOOL": "python-sandbox-warmpool",
        "AGENT_SANDBOX_NAMESPACE": "agent-sandbox",
        "SSL_CERT_FILE": broker.ca_bundle,
    }


@pytest.mark.e2e
def test_readme_quickstart(rpc_broker: Any, use_env: Env, tmp_path: Path, live: Any) -> None:
    use_env(_original_env(rpc_broker, tmp_path))
    # --- the original's zero-argument style (its README examples: test_original_readme.py) --
    from k8s_agent_sandbox_awx import Sandbox

    sandbox = Sandbox.create(shutdown_after_seconds=600)
    result = sandbox.commands.run("echo hello")
    print(result.stdout)
    sandbox.files.write("/app/hello.txt", "hello from the sandbox")
    print(sandbox.files.read("/app/hello.txt"))
    sandbox.kill()
    # ---------------------------------------------------------------------------------------
    assert result.stdout == "hello\n"
    [claim] = [
        c for c in rpc_broker.claims(include_deleted=True) if c["metadata"]["name"] == sandbox.name
    ]
    assert claim["spec"]["warmPoolRef"] == {"name": "python-sandbox-warmpool"}
    assert claim["metadata"]["namespace"] == "default"  # pinned by the broker, adopted
    assert live(rpc_broker) == []


@pytest.mark.e2e
def test_readme_context_manager_with_keywords(
    rpc_broker: Any, use_env: Env, tmp_path: Path, live: Any
) -> None:
    env = _original_env(rpc_broker, tmp_path)
    use_env({"BROKER_URL": env["BROKER_URL"], "SSL_CERT_FILE": env["SSL_CERT_FILE"]})
    token_path = env["AGENT_SANDBOX_TOKEN_PATH"]
    # --- every keyword of the original's Sandbox.create ----------------------------------
    with Sandbox.create(
        token_path=token_path,
        warmpool="python-sandbox-warmpool",
        namespace="agent-sandbox",
        shutdown_after_seconds=300,
        sandbox_ready_timeout=120,
        keepalive_ttl_seconds=0,
        scopes=["commands", "files"],
        labels={"team": "ml"},
        pod_labels={"app": "agent"},
        pod_annotations={"owner": "me"},
    ) as sandbox:
        sandbox.files.write("data.txt", b"1,2,3")
        assert sandbox.files.read("data.txt") == b"1,2,3"
        assert sandbox.commands.run("cat data.txt").stdout == "1,2,3"
    # ---------------------------------------------------------------------------------------
    assert live(rpc_broker) == []


@pytest.mark.e2e
def test_readme_broker_sandbox_client(
    rpc_broker: Any, use_env: Env, tmp_path: Path, live: Any
) -> None:
    env = _original_env(rpc_broker, tmp_path)
    use_env({"SSL_CERT_FILE": env["SSL_CERT_FILE"]})
    broker_url, token_path = env["BROKER_URL"], env["AGENT_SANDBOX_TOKEN_PATH"]
    # --- the original's client classes --------------------------------------------------
    from k8s_agent_sandbox_awx import (
        BrokerSandbox,
        BrokerSandboxClient,
        SandboxBrokerConnectionConfig,
    )

    config = SandboxBrokerConnectionConfig(broker_url=broker_url, token_path=token_path)
    client = BrokerSandboxClient(config)
    sandbox = client.create_sandbox(warmpool="python-sandbox-warmpool")
    assert isinstance(sandbox, BrokerSandbox)
    print(sandbox.commands.run("echo hi").stdout)
    client.delete_sandbox(sandbox.claim_name)
    client.close()
    # ---------------------------------------------------------------------------------------
    assert live(rpc_broker) == []


@pytest.mark.e2e
def test_async_with_the_original_keywords(rpc_broker: Any, use_env: Env, tmp_path: Path) -> None:
    env = _original_env(rpc_broker, tmp_path)
    del env["AGENT_SANDBOX_TOKEN_PATH"]
    use_env(env)
    token = rpc_broker.issue_gitlab_token("group/project")

    async def main() -> None:
        async with await AsyncSandbox.create(token=token, shutdown_after_seconds=120) as sandbox:
            assert (await sandbox.commands.run("echo hi")).stdout == "hi\n"

    asyncio.run(main())


def test_the_original_variables_are_aliases_ours_first(tmp_path: Path) -> None:
    theirs = {
        "BROKER_URL": "https://theirs.example",
        "SANDBOX_WARMPOOL": "pool-b",
        "AGENT_SANDBOX_WARMPOOL": "pool-a",
        "SANDBOX_NAMESPACE": "ns-b",
        "AGENT_SANDBOX_NAMESPACE": "ns-a",
    }
    config = BrokerConnectionConfig.from_env(theirs)
    assert (config.broker_url, config.template, config.namespace) == (
        "https://theirs.example",
        "pool-a",
        "ns-a",
    )
    ours = {
        **theirs,
        "AGENT_SANDBOX_BROKER_URL": "https://ours.example",
        "AGENT_SANDBOX_TEMPLATE": "python",
    }
    config = BrokerConnectionConfig.from_env(ours)
    assert (config.broker_url, config.template) == ("https://ours.example", "python")


@pytest.mark.parametrize(
    ("names", "winner"),
    [
        (("BROKER_TOKEN",), "agent-sandbox-token"),
        (("KSA_TOKEN_PATH", "BROKER_TOKEN_PATH"), "BROKER_TOKEN_PATH"),
        (("KSA_TOKEN_PATH", "AGENT_SANDBOX_TOKEN_PATH"), "AGENT_SANDBOX_TOKEN_PATH"),
        (("AGENT_SANDBOX_TOKEN_PATH", "AGENT_SANDBOX_TOKEN_FILE"), "AGENT_SANDBOX_TOKEN_FILE"),
    ],
)
def test_the_original_token_variables_in_its_order(
    names: tuple[str, ...], winner: str, tmp_path: Path
) -> None:
    from k8s_agent_sandbox_awx.testing import unsigned_jwt

    audience = "https://broker.example"
    token = unsigned_jwt({"aud": audience, "iss": "https://issuer", "sub": "me"})
    environ = {"AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1"}
    for name in names:
        if name.endswith(("PATH", "FILE")):
            path = tmp_path / name
            path.write_text(token)
            environ[name] = str(path)
        else:
            environ[name] = token
    explanation = explain(audience, environ=environ)
    assert explanation.error is None, explanation.error
    selected = next(d for d in explanation.decisions if d.status == "selected")
    assert winner in (selected.name, selected.detail) or winner in str(selected)


def test_the_original_keywords_are_checked_before_anything_is_sent() -> None:
    # keepalive_ttl_seconds= is the SDK's keepalive=: checked like it
    with pytest.raises(TypeError, match="keepalive"):
        Sandbox.create(keepalive_ttl_seconds="60", broker_url="https://127.0.0.1:9")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="differ"):
        Sandbox.create(keepalive_ttl_seconds=60, keepalive=30, broker_url="https://127.0.0.1:9")
    with pytest.raises(ConfigurationError, match="differ"):
        Sandbox.create(template="a", warmpool="b", broker_url="https://127.0.0.1:9")
    with pytest.raises(ConfigurationError, match="only one"):
        Sandbox.create(token="x", token_path="/t", broker_url="https://127.0.0.1:9")
    with pytest.raises(ConfigurationError, match="backend"):
        Sandbox.create(backend="substrate", broker_url="https://127.0.0.1:9")


def test_the_original_config_hides_its_token() -> None:
    from k8s_agent_sandbox_awx import SandboxBrokerConnectionConfig

    config = SandboxBrokerConnectionConfig(broker_url="https://b.example", token="s3cr3t-token")
    assert "s3cr3t" not in repr(config) and "s3cr3t" not in str(config)
    assert config.token is not None and config.token.get_secret_value() == "s3cr3t-token"
