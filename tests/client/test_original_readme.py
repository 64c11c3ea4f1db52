"""The original package's README examples, as published on its package-index pages, run unchanged.

Each test quotes one example (the calls, names, keywords and attribute accesses as published;
``print`` is kept and its output checked) and names the page and versions it comes from. The
environment is the one the README's "Configuration" section names, pointed at a local broker:
one that serves only ``/rpc`` (what deployed brokers speak) and, where the example does not
depend on the dialect, also a v1 broker (``dialect_broker``).

Source: the stored copies of the package index's project page of k8s-agent-sandbox-awx and of its
``/<version>/`` pages (0.1.0, 0.2.0, 0.3.0, 0.5.2, 0.6.0, 0.7.0, 0.8.0, 0.9.0). Only the opening
of each page (about 1,500 characters) is stored: the examples below are every code example in
those openings. An example cut off by the end of the stored text is completed with the fewest
characters that close the call, and the test says so.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.errors import ConfigurationError, UnsupportedOperationError

pytestmark = [pytest.mark.e2e, pytest.mark.upstream]  # end to end: upstream result types and errors


def _readme_env(broker: Any, tmp_path: Path) -> dict[str, str]:
    """What the README's "Configuration" section has a user set: the broker URL and the
    projected token file (``AGENT_SANDBOX_BROKER_URL``, ``AGENT_SANDBOX_TOKEN_PATH``), here for
    the local broker, whose CA is trusted through the standard ``SSL_CERT_FILE``."""
    token = tmp_path / "agent-sandbox-token"
    broker.write_projected_token(token, namespace="default", service_account="agent")
    return {
        "AGENT_SANDBOX_BROKER_URL": broker.url,
        "AGENT_SANDBOX_TOKEN_PATH": str(token),
        "SSL_CERT_FILE": broker.ca_bundle,
    }


def _claim(broker: Any, name: str) -> dict[str, Any]:
    [claim] = [c for c in broker.claims(include_deleted=True) if c["metadata"]["name"] == name]
    return claim


def test_project_page_quick_start(
    dialect_broker: Any, use_env: Any, tmp_path: Path, capsys: Any, live: Any
) -> None:
    """The package index's project page of k8s-agent-sandbox-awx (the 0.5.0 README): the
    quick start."""
    use_env(_readme_env(dialect_broker, tmp_path))
    # --- README ---------------------------------------------------------------------------
    from k8s_agent_sandbox_awx import Sandbox

    sandbox = Sandbox.create()
    result = sandbox.commands.run('echo "Hello from Agent Sandbox!"')
    print(result.stdout)
    sandbox.kill()
    # ---------------------------------------------------------------------------------------
    assert capsys.readouterr().out == "Hello from Agent Sandbox!\n\n"
    assert live(dialect_broker) == []


def test_quick_start_0_5_2_to_0_9_0(
    dialect_broker: Any, use_env: Any, tmp_path: Path, capsys: Any
) -> None:
    """the package index's page of k8s-agent-sandbox-awx 0.9.0 (the same text in 0.5.2, 0.6.0,
    0.7.0 and 0.8.0), the quick start: the sandbox is left to its timeout (300 s, the
    original's default since 0.5.2)."""
    use_env(_readme_env(dialect_broker, tmp_path))
    before = dt.datetime.now(dt.UTC)
    # --- README ---------------------------------------------------------------------------
    from k8s_agent_sandbox_awx import Sandbox

    sandbox = Sandbox.create(keepalive_ttl_seconds=0)
    result = sandbox.commands.run('echo "Hello from Agent Sandbox!"')
    print(result.stdout)
    # Leave it available until its timeout; call sandbox.kill() for early cleanup.
    # ---------------------------------------------------------------------------------------
    assert capsys.readouterr().out == "Hello from Agent Sandbox!\n\n"
    lifecycle = _claim(dialect_broker, sandbox.name)["spec"]["lifecycle"]
    shutdown = dt.datetime.fromisoformat(lifecycle["shutdownTime"])
    assert dt.timedelta(seconds=290) < shutdown - before < dt.timedelta(seconds=310)
    sandbox.kill()


def test_streaming_0_6_0(dialect_broker: Any, use_env: Any, tmp_path: Path, capsys: Any) -> None:
    """the package index's page of k8s-agent-sandbox-awx 0.6.0, "Streaming and background
    commands": stream stdout and stderr while the command runs. The stored text ends inside
    the call at ``on_stderr=lambda chunk``; the test completes it as the ``on_stdout=`` line
    above it, to standard error, and closes the call."""
    use_env(_readme_env(dialect_broker, tmp_path))
    from k8s_agent_sandbox_awx import Sandbox

    sandbox = Sandbox.create(keepalive_ttl_seconds=0)
    # --- README ---------------------------------------------------------------------------
    result = sandbox.commands.run(
        [
            "python3",
            "-u",
            "-c",
            "import os,time; print(os.getenv('DEMO')); time.sleep(1); print('done')",
        ],
        timeout=30,
        envs={"DEMO": "hello"},
        cwd="/app",
        on_stdout=lambda chunk: print(chunk, end="", flush=True),
        on_stderr=lambda chunk: print(chunk, end="", flush=True, file=sys.stderr),
    )
    # ---------------------------------------------------------------------------------------
    sandbox.kill()
    assert (result.stdout, result.exit_code) == ("hello\ndone\n", 0)
    assert capsys.readouterr().out == "hello\ndone\n"


def test_streaming_0_7_0_to_0_9_0(
    dialect_broker: Any, use_env: Any, tmp_path: Path, capsys: Any
) -> None:
    """the package index's page of k8s-agent-sandbox-awx 0.9.0 (the same text in 0.7.0 and
    0.8.0), "Streaming and background commands": command strings are shell scripts; a
    callback streams output while ``run()`` waits. The stored text ends after the
    ``on_stdout=`` argument; the test closes the call."""
    use_env(_readme_env(dialect_broker, tmp_path))
    # --- README ---------------------------------------------------------------------------
    from k8s_agent_sandbox_awx import Sandbox

    sandbox = Sandbox.create()
    result = sandbox.commands.run(
        "echo hello; sleep 1; echo world",
        on_stdout=lambda data: print(data, end="", flush=True),
    )
    # ---------------------------------------------------------------------------------------
    sandbox.kill()
    assert result.stdout == "hello\nworld\n"
    assert capsys.readouterr().out == "hello\nworld\n"


def test_broker_sandbox_client_0_1_0_to_0_3_0(
    rpc_broker: Any, use_env: Any, tmp_path: Path, live: Any
) -> None:
    """the package index's page of k8s-agent-sandbox-awx 0.1.0 (the same in 0.2.0 and 0.3.0): the
    README's only code is its import line; the stored text has no example that uses it. After
    it, the calls of upstream ``SandboxClient`` that ``BrokerSandboxClient`` overlays (the
    original's class, in upstream's call shape: ``connection_config=``, ``create_sandbox``,
    ``delete_sandbox(claim_name)``), with both URLs set to the broker URL as the 0.5.0 README
    says."""
    env = _readme_env(rpc_broker, tmp_path)
    use_env({"SSL_CERT_FILE": env["SSL_CERT_FILE"]})
    broker_url, token_path = env["AGENT_SANDBOX_BROKER_URL"], env["AGENT_SANDBOX_TOKEN_PATH"]
    # --- README ---------------------------------------------------------------------------
    from k8s_agent_sandbox_awx import BrokerSandboxClient, SandboxBrokerConnectionConfig

    # ---------------------------------------------------------------------------------------
    config = SandboxBrokerConnectionConfig(
        broker_url=broker_url, api_url=broker_url, token_path=token_path
    )
    client = BrokerSandboxClient(connection_config=config)
    sandbox = client.create_sandbox(warmpool="python-sandbox-warmpool")
    result = sandbox.commands.run("echo hi")
    assert (result.stdout, result.exit_code) == ("hi\n", 0)
    assert _claim(rpc_broker, sandbox.claim_name)["metadata"]["name"].startswith("broker-")
    client.delete_sandbox(sandbox.claim_name)
    assert live(rpc_broker) == []


def test_api_url_must_be_the_broker_url() -> None:
    """the package index's project page of k8s-agent-sandbox-awx (0.5.0; the same text in 0.5.2):
    "Set both broker_url and api_url to the broker URL. The model rejects a different api_url
    to prevent accidental direct-router bypass." """
    from k8s_agent_sandbox_awx import SandboxBrokerConnectionConfig

    url = "https://broker.example"
    config = SandboxBrokerConnectionConfig(broker_url=url, api_url=url)
    assert (config.broker_url, config.api_url) == (url, url)
    with pytest.raises(ConfigurationError, match="api_url"):
        SandboxBrokerConnectionConfig(broker_url=url, api_url="https://router.example")


GKE_CALLS: dict[str, Callable[[Any], Any]] = {
    "suspend": lambda sandbox: sandbox.suspend(),
    "resume": lambda sandbox: sandbox.resume(),
    "restore": lambda sandbox: sandbox.restore(),
    "is_suspended": lambda sandbox: sandbox.is_suspended(),
    "snapshots": lambda sandbox: sandbox.snapshots.create(),
}


@pytest.mark.parametrize("name", list(GKE_CALLS))
def test_the_original_gke_features_say_they_are_not_here(
    name: str, rpc_broker: Any, use_env: Any, tmp_path: Path
) -> None:
    """The original's 0.9+ snapshot and suspend/resume/restore API (GKE pod snapshots; its
    README section is past the stored opening of the 0.9.0 page, the names are from
    shared/reference/original-package.md): a clear error, raised before anything is sent,
    that names the feature and docs/migrating.md."""
    use_env(_readme_env(rpc_broker, tmp_path))
    from k8s_agent_sandbox_awx import Sandbox

    with Sandbox.create() as sandbox:
        with pytest.raises(UnsupportedOperationError) as caught:
            GKE_CALLS[name](sandbox)
        assert sandbox.commands.run("true").exit_code == 0  # the sandbox is untouched
    message = str(caught.value)
    assert caught.value.operation == name
    assert name in message and "GKE" in message and "migrating.md" in message


def test_the_original_gke_features_say_they_are_not_here_async(
    rpc_broker: Any, use_env: Any, tmp_path: Path
) -> None:
    """The same refusal from an ``AsyncSandbox`` (one implementation for both)."""
    import asyncio

    from k8s_agent_sandbox_awx import AsyncSandbox

    use_env(_readme_env(rpc_broker, tmp_path))

    async def main() -> None:
        async with await AsyncSandbox.create() as sandbox:
            with pytest.raises(UnsupportedOperationError, match=r"suspend\(\).*GKE"):
                await sandbox.suspend()
            with pytest.raises(UnsupportedOperationError, match=r"snapshots.*GKE"):
                await sandbox.snapshots.list()

    asyncio.run(main())
